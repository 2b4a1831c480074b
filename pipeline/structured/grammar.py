"""The grammar backend: structured-output specs compiled into per-request token matchers.

    backend = GuidanceBackend(tokenizer_json, vocab_size, eos_token_ids)
    grammar = backend.compile(kind, text)        # ValueError: the spec cannot be enforced
    matcher = grammar.matcher()                  # one per request (a copy: compile once)
    backend.fill_bitmasks([(matcher, row)], bitmask)  # bit t of a row: token t allowed
    matcher.accept(token_ids); matcher.rollback(n); matcher.is_terminated()

    sample/grammar_mask.apply_bitmask(logits, bitmask)   # the worker: refused -> -inf

A bitmask row is `ceil(vocab_size / 32)` int32 words; token t is bit (t % 32) of word t // 32
(little-endian, so the row's bytes unpacked little-endian are the tokens in order). EOS is
allowed only where the grammar may end. The one backend is llguidance (vLLM's "guidance"):
it reads the model's tokenizer.json itself and fills masks for a whole batch on its own
threads (the GIL released). Another backend implements `GrammarBackend` and `Matcher`.

`check_spec` is the front end's early check (a 400 before anything reaches the engine):
a JSON Schema must be one (the `jsonschema` meta-schema), and the backend must be able to
build the grammar (regex and Lark syntax, schema features it cannot enforce).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Protocol

import numpy as np

_JSON_OBJECT = {"type": "object"}
# JSON as json.dumps writes it (", " and ": ", no other whitespace): what a client parses the
# same either way, and a small or unsure model cannot wander into pages of whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False}


class Matcher(Protocol):
    def accept(self, token_ids: list[int]) -> bool:
        """Advances over the tokens; False if the grammar refuses one (the matcher is then
        in an error state)."""

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool:
        """The output is complete: nothing more may follow (the request finishes)."""

    def copy(self) -> Matcher: ...


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, kind: str, text: str) -> CompiledGrammar: ...

    def fill_bitmasks(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None: ...


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


# ---- llguidance ---------------------------------------------------------------------------


def guidance_grammar(kind: str, text: str) -> str:
    """A spec (structured/params.py's kinds) as an llguidance grammar."""
    from llguidance import LLMatcher

    if kind == "json":
        return LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_JSON_OBJECT, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        alternatives = " | ".join(
            json.dumps(choice, ensure_ascii=False) for choice in json.loads(text)
        )
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(text)
    raise ValueError(f"structured outputs: kind {kind!r} is unknown")


def check_grammar(kind: str, text: str, tokenizer=None) -> str:
    """The llguidance grammar of a spec, or ValueError saying what is wrong with it."""
    from llguidance import LLMatcher

    try:
        grammar = guidance_grammar(kind, text)
    except ValueError as exc:
        raise ValueError(f"{_FIELD[kind]}: {exc}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"{_FIELD[kind]}: cannot be enforced: {_one_line(messages[0])}")
    return grammar


_FIELD = {
    "json": "structured_outputs.json",
    "json_object": "structured_outputs.json_object",
    "regex": "structured_outputs.regex",
    "choice": "structured_outputs.choice",
    "grammar": "structured_outputs.grammar",
}


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())[:2000]


@functools.lru_cache(maxsize=256)  # a spec that passed once passes again at no cost
def check_spec(kind: str, text: str) -> None:
    """ValueError naming the problem if the spec is not one the engine can enforce."""
    if kind == "json":
        check_json_schema(json.loads(text), "structured_outputs.json")
    check_grammar(kind, text)


def check_json_schema(schema, field: str) -> None:
    """ValueError "FIELD: not a valid JSON Schema at PATH: why" (the `jsonschema`
    meta-schema of the schema's own draft). Each distinct schema is checked once (the
    check is pure Python, ~16 ms for a 50-property draft 2020-12 object): clients send the
    same tools with every request."""
    try:
        text = json.dumps(schema, sort_keys=True, ensure_ascii=False)
    except RecursionError:
        raise ValueError(f"{field}: {_TOO_DEEP}") from None
    cached = len(text) <= _MAX_CACHED_SCHEMA_CHARS
    problem = (_schema_problem if cached else _schema_problem.__wrapped__)(text)
    if problem is not None:
        raise ValueError(f"{field}: {problem}")


_TOO_DEEP = "nests too deeply for a JSON Schema this server checks and enforces"
# The cache holds at most ~16 MiB of schema text.
_MAX_CACHED_SCHEMA_CHARS = 32 << 10


@functools.lru_cache(maxsize=512)
def _schema_problem(text: str) -> str | None:
    """Why the schema (canonical JSON text) is not a JSON Schema; None if it is one."""
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top level)"
        return f"not a valid JSON Schema at {where}: {exc.message}"
    except RecursionError:  # the meta-schema check recurses a few frames a level
        return _TOO_DEEP
    return None


class GuidanceMatcher:
    def __init__(self, matcher) -> None:
        self.inner = matcher

    def accept(self, token_ids: list[int]) -> bool:
        return bool(self.inner.consume_tokens(list(token_ids))) and not self.inner.is_error()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """Stopped, or broken by a token outside the grammar (nothing valid can follow)."""
        return self.inner.is_stopped() or self.inner.is_error()

    @property
    def error(self) -> str | None:
        return self.inner.get_error() if self.inner.is_error() else None

    def copy(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.inner.deep_copy())


class GuidanceGrammar:
    """A compiled grammar: a pristine matcher, copied for each request (microseconds)."""

    def __init__(self, pristine) -> None:
        self._pristine = pristine

    def matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._pristine.deep_copy())


class GuidanceBackend:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids) -> None:
        """`tokenizer_json`: the text of the model's tokenizer.json (~0.2 s to build for a
        50K vocabulary: once per engine); `vocab_size`: the model's logits width."""
        from llguidance import LLExecutor, LLTokenizer

        eos = [int(t) for t in eos_token_ids]
        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        # every CPU: the masks are filled between steps, while the model waits (llguidance's
        # default, 80% of the CPUs, is one thread on a 2-CPU machine)
        self._executor = LLExecutor(num_threads=max(1, os.cpu_count() or 1))

    def compile(self, kind: str, text: str) -> GuidanceGrammar:
        from llguidance import LLMatcher

        grammar = check_grammar(kind, text, self.tokenizer)
        pristine = LLMatcher(self.tokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ValueError(
                f"{_FIELD[kind]}: cannot be enforced: {_one_line(pristine.get_error())}"
            )
        return GuidanceGrammar(pristine)

    def fill_bitmasks(
        self, matchers: list[tuple[GuidanceMatcher, int]], bitmask: np.ndarray
    ) -> None:
        """Fills row `row` of `bitmask` (int32 [rows, bitmask_words], C-contiguous) for each
        matcher, on llguidance's threads."""
        if not matchers:
            return
        words = bitmask.shape[1]
        self._executor.unsafe_compute_mask_ptr(
            [(m.inner, row) for m, row in matchers],
            bitmask.ctypes.data,
            words * 4,
            bitmask.shape[0],
        )
