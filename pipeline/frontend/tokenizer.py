"""The front end's tokenizer: a `tokenizers.Tokenizer` plus what an HF folder says about it.

The engine core sees token ids only; everything that turns text into ids and back goes
through `Tokenizer`, built from a Hugging Face model folder:

    tokenizer.json            required: the fast tokenizer (model, normalizer, decoder,
                              post-processor, added tokens)
    tokenizer_config.json     optional: bos/eos/pad/unk token strings, add_bos_token,
                              add_eos_token, chat_template
    generation_config.json    optional: eos_token_id (int or list), bos/pad ids

Invariants:
- `encode(text)` starts with exactly one BOS when BOS is wanted, whether tokenizer.json's
  post-processor adds it, tokenizer_config.json's `add_bos_token` asks for it, or both
  (never twice). Likewise `add_eos_token` appends one EOS.
- `decode` is the backend's decode and nothing more. NOTE: we never apply HF's
  `clean_up_tokenization_spaces`: it is not prefix-stable, so streamed text could not
  equal the final text; transformers v5 ignores it for BPE models too.
- Every token that tokenizer_config.json names (bos, eos, pad, unk, additional special
  tokens) is a *special* added token of the backend, as transformers makes it at load, so
  it is encoded atomically and `skip_special_tokens` drops it. A named bos/eos that the
  vocabulary lacks is an error; other named tokens it lacks are ignored.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

logger = logging.getLogger(__name__)

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def read_json_file(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def special_token_text(value: Any) -> str | None:
    """The text of a special token as tokenizer_config.json writes it.

    HF writes either the plain string or a serialized AddedToken
    (`{"__type": "AddedToken", "content": "<s>", ...}`).
    """
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token: expected a string or an AddedToken object, got {value!r}")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2 byte-level BPE's alphabet: the character that shows each byte -> the byte.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') show as themselves; the other
    68 show as chr(256 + n), n counting them in byte order (so a space is 'Ġ', U+0120).
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    alphabet: dict[str, int] = {}
    num_shifted = 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + num_shifted)] = byte
            num_shifted += 1
    return alphabet


_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Decoders whose per-token effect token_bytes knows; with any other, it decodes the token.
_PER_TOKEN_DECODERS = {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}


def _decoder_steps(backend: tokenizers.Tokenizer) -> list[dict[str, Any]]:
    """The decoder pipeline of `backend` as JSON dicts (a Sequence flattened)."""
    if backend.decoder is None:
        return []
    spec = json.loads(backend.decoder.__getstate__())
    return spec["decoders"] if spec.get("type") == "Sequence" else [spec]


def _as_id_list(value: Any, field: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(
            f"{GENERATION_CONFIG_FILE}: {field} must be an int or a list of ints, got {value!r}"
        )
    return list(values)


# Texts longer than this are tokenized with encode_batch, which releases the GIL.
_RELEASE_GIL_CHARS = 8192


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens resolved to ids."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
    ) -> None:
        self._backend = backend
        self.tokenizer_config: dict[str, Any] = dict(tokenizer_config or {})
        generation_config = generation_config or {}

        self.special_tokens: dict[str, str] = self._register_named_special_tokens()
        self._added_text_by_id: dict[int, str] = {
            token_id: added.content
            for token_id, added in backend.get_added_tokens_decoder().items()
        }
        self._special_ids: frozenset[int] = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )

        self.bos_token_id: int | None = self._named_id(
            "bos_token", generation_config.get("bos_token_id")
        )
        self.pad_token_id: int | None = self._named_id(
            "pad_token", generation_config.get("pad_token_id")
        )
        eos_ids = set(_as_id_list(generation_config.get("eos_token_id"), "eos_token_id"))
        config_eos_id = self._named_id("eos_token", None)
        if config_eos_id is not None:
            eos_ids.add(config_eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self._check_ids_in_vocab(eos_ids, "eos_token_id")

        self._prepend_bos_id, self._append_eos_id = self._plan_bos_eos()
        self._decoder_steps = _decoder_steps(backend)
        self._decoder_kinds = {step["type"] for step in self._decoder_steps}
        self._byte_level_alphabet = byte_level_alphabet()

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """Load tokenizer.json (+ optional tokenizer_config.json, generation_config.json)."""
        folder = Path(folder)
        tokenizer_path = folder / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"{TOKENIZER_FILE} not found in tokenizer folder {folder} "
                f"({'the folder exists' if folder.is_dir() else 'the folder does not exist'}); "
                "ringllm needs the fast-tokenizer file that `tokenizers`/transformers save "
                "(slow-only folders with just tokenizer.model are not supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust loader raises a plain Exception
            raise ValueError(f"{tokenizer_path}: cannot be loaded by `tokenizers` ({exc})") from exc
        # NOTE: a tokenizer.json may pad or cut every text (sentence-transformers' BERT
        # folders pad to 128 and truncate): a prompt is its tokens, and its length is the
        # engine's to check, never silently changed
        backend.no_padding()
        backend.no_truncation()
        return cls(
            backend,
            read_json_file(folder / TOKENIZER_CONFIG_FILE),
            read_json_file(folder / GENERATION_CONFIG_FILE),
        )

    def _plan_bos_eos(self) -> tuple[int | None, int | None]:
        """The BOS to prepend and the EOS to append that tokenizer.json does not add itself.

        NOTE: the post-processor is probed with an empty text, so a template that already
        adds BOS (Llama's) is not doubled by `add_bos_token: true`. transformers v5 ignores
        `add_bos_token` once tokenizer.json exists; v4's Llama tokenizers honoured it, and
        so do we. `add_bos_token: false` does not remove a BOS the post-processor adds.
        """
        probe_ids = self._backend.encode("", add_special_tokens=True).ids
        bos_id = self.bos_token_id if self.tokenizer_config.get("add_bos_token") else None
        if probe_ids[:1] == [bos_id]:
            bos_id = None
        eos_text = self.special_tokens.get("eos_token")
        eos_id = self._token_id(eos_text) if eos_text is not None else None
        if not self.tokenizer_config.get("add_eos_token") or probe_ids[-1:] == [eos_id]:
            eos_id = None
        return bos_id, eos_id

    # -- special tokens ----------------------------------------------------------------

    def _register_named_special_tokens(self) -> dict[str, str]:
        """Mark every token tokenizer_config.json names as a special added token.

        NOTE: transformers appends a named token that the vocabulary lacks as a new id,
        which the model's embedding does not have. We refuse that for bos/eos (generation
        depends on them) and leave the others (pad, unk, extras) unset, with a warning.
        """
        named: dict[str, str] = {}
        extra = []
        for key in ("additional_special_tokens", "extra_special_tokens"):  # v4 / v5 names
            value = self.tokenizer_config.get(key) or []
            extra += list(value.values()) if isinstance(value, dict) else list(value)
        fields = [(field, self.tokenizer_config.get(field)) for field in _NAMED_SPECIAL_TOKENS]
        fields += [("additional_special_tokens", value) for value in extra]
        for field, value in fields:
            text = special_token_text(value)
            if text is None:
                continue
            if self._backend.token_to_id(text) is not None:
                named.setdefault(field, text)
                self._backend.add_special_tokens(
                    [tokenizers.AddedToken(text, special=True, normalized=False)]
                )
            elif field in ("bos_token", "eos_token"):
                raise ValueError(
                    f"{TOKENIZER_CONFIG_FILE}: {field} {text!r} is not a token of "
                    f"{TOKENIZER_FILE} (vocabulary of {self.vocab_size} tokens)"
                )
            else:
                logger.warning(
                    "%s: %s %r is not in the vocabulary; ignored",
                    TOKENIZER_CONFIG_FILE,
                    field,
                    text,
                )
        named.pop("additional_special_tokens", None)
        return named

    def _token_id(self, text: str) -> int:
        token_id = self._backend.token_to_id(text)
        assert token_id is not None, "checked in _register_named_special_tokens"
        return token_id

    def _named_id(self, field: str, fallback_id: Any) -> int | None:
        text = self.special_tokens.get(field)
        if text is not None:
            return self._token_id(text)
        if fallback_id is None:
            return None
        (token_id,) = _as_id_list(fallback_id, field + "_id")
        self._check_ids_in_vocab([token_id], field + "_id")
        return token_id

    def _check_ids_in_vocab(self, ids: Iterable[int], field: str) -> None:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{GENERATION_CONFIG_FILE}: {field} {token_id} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )

    @property
    def all_special_ids(self) -> frozenset[int]:
        """Ids that `skip_special_tokens` drops: every special added token."""
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (HF's `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    # -- text <-> ids ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS as the model wants them.

        NOTE: `tokenizers`' `encode` holds the GIL for its whole run (a 1 MB text: 0.5 s in
        which no other Python thread runs, measured), `encode_batch` releases it; long texts
        take the batch call, so tokenizing on a worker thread leaves the event loop free."""
        if len(text) > _RELEASE_GIL_CHARS:
            ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos_id is not None:
            ids.insert(0, self._prepend_bos_id)
        if add_special_tokens and self._append_eos_id is not None:
            ids.append(self._append_eos_id)
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest vocabulary piece): a
        text of more than max_model_len times this cannot fit the context, whatever it is."""
        pieces = self._backend.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in pieces), default=1)

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = False,
    ) -> str:
        """Text of `ids`.

        `spaces_between_special_tokens` joins special tokens and the runs of other tokens
        between them with one space, as HF's slow tokenizers do (fast ones ignore the flag).
        NOTE: slow tokenizers split at non-special added tokens too; a SentencePiece GGUF
        (Gemma's) marks "\n", tabs and runs of spaces as such, and padding those with
        spaces would change the text, so they stay in their runs.
        """
        ids = list(ids)
        if not spaces_between_special_tokens:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id not in self._special_ids:
                run.append(token_id)
                continue
            if skip_special_tokens:
                continue
            if run:
                pieces.append(self._backend.decode(run, skip_special_tokens=False))
                run = []
            pieces.append(self._added_text_by_id[token_id])
        if run:
            pieces.append(self._backend.decode(run, skip_special_tokens=False))
        return " ".join(pieces)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary strings of `ids` (byte-level BPE shows a space as 'Ġ')."""
        return [self._backend.id_to_token(token_id) for token_id in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (OpenAI logprobs report them), also when
        they are part of a multi-byte character that the token alone cannot show.

        Concatenating them for a sequence gives its UTF-8 text, up to the decoder's
        whole-text rules (SentencePiece's leading-space strip).
        """
        if token_id in self._added_text_by_id:
            return self._added_text_by_id[token_id].encode("utf-8")
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        kinds = self._decoder_kinds
        if not kinds <= _PER_TOKEN_DECODERS:
            return self._backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if "ByteLevel" in kinds:
            alphabet = self._byte_level_alphabet
            return b"".join(
                bytes([alphabet[ch]]) if ch in alphabet else ch.encode("utf-8") for ch in token
            )
        byte_match = _BYTE_FALLBACK_TOKEN.fullmatch(token)
        if "ByteFallback" in kinds and byte_match:
            return bytes([int(byte_match.group(1), 16)])
        for step in self._decoder_steps:
            if step["type"] == "Replace" and "String" in step["pattern"]:
                token = token.replace(step["pattern"]["String"], step["content"])
            elif step["type"] == "Metaspace":
                token = token.replace(step.get("replacement", "▁"), " ")
        return token.encode("utf-8")

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)
