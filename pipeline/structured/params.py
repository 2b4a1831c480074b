"""What a request's output must match: `StructuredOutputsParams` (vLLM's name and fields).

    json         a JSON Schema (a dict, or its JSON text): the output is JSON valid against it
    json_object  True: the output is some JSON object
    regex        the output matches the regular expression, whole
    choice       the output is exactly one of these strings
    grammar      a Lark grammar (llguidance's dialect: EBNF-like rules, regex terminals)

Exactly one is set. It rides on `SamplingParams.structured_outputs`; the engine core
compiles it (pipeline/core/structured_output.py) and masks each step's logits so that only
tokens that keep the output inside the language can be sampled. Across processes it
travels as `(kind, text)` (`spec`, `from_spec`): kind one of SPEC_KINDS, text canonical
(a schema re-serialised with sorted keys), so equal specs share one compiled grammar.

`prefix_token_ids` is the engine's, not the caller's: a request replayed into a new engine
core (after a crash) has the tokens it had already produced at the end of its prompt, and
the matcher must consume them before it constrains the next one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPEC_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A spec's text crosses the request ring inside one ADD record's blob.
MAX_SPEC_BYTES = 256 << 10  # with a long prompt it still fits the request ring (~830 KiB)


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    num_prefix_tokens: int = 0  # see the module docstring (set by the engine's replay)

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        if self.json_object:
            given.append("json_object")
        elif self.json_object not in (None, False):
            raise ValueError(f"json_object: must be true or false, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                f"must be given, got {', '.join(given) or 'none'}"
            )
        if self.json is not None:
            self.json = _schema_object(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}: must be a non-empty string")
        if self.choice is not None:
            if (
                isinstance(self.choice, str)
                or not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice: must be a non-empty list of non-empty strings"
                )
            self.choice = list(self.choice)
        if not isinstance(self.num_prefix_tokens, int) or self.num_prefix_tokens < 0:
            raise ValueError(
                f"num_prefix_tokens: must be an int >= 0, got {self.num_prefix_tokens!r}"
            )
        kind, text = self.spec()
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise ValueError(
                f"structured_outputs.{kind}: {len(text.encode())} bytes, more than the "
                f"{MAX_SPEC_BYTES} a spec may have"
            )

    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): what crosses processes and keys the compile cache."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True, ensure_ascii=False)
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice, ensure_ascii=False)
        return "grammar", self.grammar

    @classmethod
    def from_spec(cls, kind: str, text: str, num_prefix_tokens: int = 0) -> StructuredOutputsParams:
        if kind == "json":
            return cls(json=json.loads(text), num_prefix_tokens=num_prefix_tokens)
        if kind == "json_object":
            return cls(json_object=True, num_prefix_tokens=num_prefix_tokens)
        if kind == "choice":
            return cls(choice=json.loads(text), num_prefix_tokens=num_prefix_tokens)
        if kind in ("regex", "grammar"):
            return cls(**{kind: text}, num_prefix_tokens=num_prefix_tokens)
        raise ValueError(f"structured outputs: kind {kind!r} is not one of {SPEC_KINDS}")


def _schema_object(schema: Any) -> dict | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(
            f"structured_outputs.json: a JSON Schema is an object (or true / false), "
            f"got {type(schema).__name__}"
        )
    return schema
