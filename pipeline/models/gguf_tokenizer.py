"""GGUF (llama.cpp) tokenizer -> Hugging Face `tokenizer.json` and its config files.

This module owns the tokenizer half of the GGUF -> HF conversion: it rebuilds the
tokenizer a GGUF describes with the `tokenizers` library, and writes `tokenizer.json`,
`tokenizer_config.json` and `chat_template.jinja`:

- `gpt2`: byte-level BPE (vocab `tokenizer.ggml.tokens`, merges `tokenizer.ggml.merges`,
  per-token types `tokenizer.ggml.token_type`);
- `llama`: SentencePiece BPE (Gemma, Llama 2, Mistral's older files): no merges in the
  file, only a score per piece. SentencePiece merges the adjacent pair whose union scores
  highest; a BPE whose merges are every split of every piece, ranked by the score of the
  piece they make, merges the same pairs in the same order. Spaces are "▁", and text the
  vocab lacks falls back to its UTF-8 bytes (the `<0xNN>` pieces).

Invariants:
- Token ids are the GGUF's list positions: token i of the GGUF is id i of the rebuilt
  tokenizer, and a vocab with duplicate strings is rejected rather than renumbered.
- Control tokens (GGUF type 3) become special added tokens, matched before BPE and skipped
  by `decode(skip_special_tokens=True)`; user-defined tokens (type 4) become ordinary
  added tokens.
- Only pre-tokenizers we can rebuild exactly are accepted (`_PRE_TOKENIZERS`); anything
  else is an error, never a silently different tokenization.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from ringllm.pipeline.models.gguf_config import (
    GEMMA_CHAT_TEMPLATE,
    GGUFFormatError,
    architecture_of,
    read_field,
)
from ringllm.pipeline.models.gguf_file import GGUFFile

# llama.cpp's `llama_vocab` token types (the values of `tokenizer.ggml.token_type`).
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6
SPM_SPACE = "\u2581"  # "▁"


def _smollm_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    # SmolLM2 splits every digit on its own first, then applies GPT-2's byte-level regex
    # split without a prefix space (its vocab has no multi-digit tokens).
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _split_then_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    # The regex split as its own step, then the byte-level mapping without a regex of its
    # own: the layout of Qwen2's and Llama 3's tokenizer.json.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# The split patterns of the tokenizers these names stand for (their tokenizer.json files):
# Qwen2 splits digits one by one, Llama 3 in runs of up to three.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PATTERN = _QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|", 1)


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer_config.json key -> GGUF field holding that token's id.
_SPECIAL_TOKEN_FIELDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}

# `tokenizer.ggml.pre` value -> builder of the matching HF pre-tokenizer.
_PRE_TOKENIZERS = {
    "smollm": _smollm_pre_tokenizer,
    "qwen2": lambda: _split_then_byte_level(_QWEN2_PATTERN),
    "llama-bpe": lambda: _split_then_byte_level(_LLAMA3_PATTERN),
    "gpt-2": _gpt2_pre_tokenizer,
    "default": _gpt2_pre_tokenizer,
}


def build_tokenizer(reader: GGUFFile) -> Tokenizer:
    """The tokenizer the GGUF's `tokenizer.ggml.*` fields describe."""
    model_kind = read_field(reader, "tokenizer.ggml.model")
    if model_kind == "llama":
        return _sentencepiece_bpe(reader)
    if model_kind != "gpt2":
        raise GGUFFormatError(
            f"GGUF tokenizer model is {model_kind!r}; supported: byte-level BPE ('gpt2') "
            "and SentencePiece BPE ('llama')"
        )
    pre_kind = read_field(reader, "tokenizer.ggml.pre")
    if pre_kind not in _PRE_TOKENIZERS:
        raise GGUFFormatError(
            f"GGUF pre-tokenizer is {pre_kind!r}; supported: {sorted(_PRE_TOKENIZERS)}"
        )
    if read_field(reader, "tokenizer.ggml.add_eos_token", False):
        raise GGUFFormatError(
            "GGUF sets tokenizer.ggml.add_eos_token; automatic EOS is not supported"
        )

    tokens = list(read_field(reader, "tokenizer.ggml.tokens"))
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFFormatError(
            f"GGUF vocab has {len(tokens)} tokens but only {len(vocab)} distinct strings"
        )
    merges = [_split_merge(merge) for merge in read_field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[pre_kind]()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    special, plain = _added_tokens(tokens, read_field(reader, "tokenizer.ggml.token_type"))
    # Added in id order: `tokenizers` reuses the vocab id of a string it already knows.
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def _sentencepiece_bpe(reader: GGUFFile) -> Tokenizer:
    """A `llama`-model GGUF's SentencePiece BPE (see the module docstring)."""
    if read_field(reader, "tokenizer.ggml.add_eos_token", False):
        raise GGUFFormatError(
            "GGUF sets tokenizer.ggml.add_eos_token; automatic EOS is not supported"
        )
    tokens = list(read_field(reader, "tokenizer.ggml.tokens"))
    scores = list(read_field(reader, "tokenizer.ggml.scores"))
    token_types = list(read_field(reader, "tokenizer.ggml.token_type"))
    if not len(tokens) == len(scores) == len(token_types):
        raise GGUFFormatError(
            f"GGUF has {len(tokens)} tokens, {len(scores)} scores, {len(token_types)} types"
        )
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFFormatError(
            f"GGUF vocab has {len(tokens)} tokens but only {len(vocab)} distinct strings"
        )
    unk_id = int(read_field(reader, "tokenizer.ggml.unknown_token_id", 0))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(tokens, scores, token_types),
            unk_token=tokens[unk_id],
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    steps = [normalizers.Replace(" ", SPM_SPACE)]
    space_prefix = bool(read_field(reader, "tokenizer.ggml.add_space_prefix", True))
    if space_prefix:
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    special, plain = _added_tokens(tokens, token_types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def _merges_by_score(
    tokens: list[str], scores: list[float], token_types: list[int]
) -> list[tuple[str, str]]:
    """Every split (left, right) of a normal piece into two pieces of the vocab, the best
    scoring union first (ties: the lower ids), as SentencePiece's BPE would merge them."""
    normal = {t: i for i, t in enumerate(tokens) if token_types[i] == 1}
    found = []
    for piece, piece_id in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                found.append((-scores[piece_id], normal[left], normal[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def build_tokenizer_config(reader: GGUFFile, tokenizer: Tokenizer, model_max_length: int) -> dict:
    """`tokenizer_config.json`: special-token names, chat template and added tokens."""
    tokens = list(read_field(reader, "tokenizer.ggml.tokens"))
    config = {
        # The generic fast class loads tokenizer.json as written, with nothing re-derived.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        # the front end's Tokenizer prepends the BOS id when this is set (llama.cpp does)
        "add_bos_token": bool(read_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    for hf_key, gguf_key in _SPECIAL_TOKEN_FIELDS.items():
        token_id = read_field(reader, gguf_key, -1)
        if 0 <= token_id < len(tokens):
            config[hf_key] = tokens[token_id]
    config["chat_template"] = read_field(reader, "tokenizer.chat_template", None)
    if config["chat_template"] is None and architecture_of(reader)[0] == "gemma3":
        config["chat_template"] = GEMMA_CHAT_TEMPLATE  # as llama.cpp's built-in one
    config["added_tokens_decoder"] = {
        str(token_id): {
            "content": added.content,
            "lstrip": added.lstrip,
            "normalized": added.normalized,
            "rstrip": added.rstrip,
            "single_word": added.single_word,
            "special": added.special,
        }
        for token_id, added in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return config


def write_hf_tokenizer(reader: GGUFFile, out_dir: pathlib.Path, model_max_length: int) -> Tokenizer:
    """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`."""
    tokenizer = build_tokenizer(reader)
    config = build_tokenizer_config(reader, tokenizer, model_max_length)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    if config["chat_template"] is not None:  # a base model's file may have none
        (out_dir / "chat_template.jinja").write_text(config["chat_template"], encoding="utf-8")
    return tokenizer


def _split_merge(merge: str) -> tuple[str, str]:
    # Byte-level vocabularies spell a space as "Ġ", so a merge holds exactly one space.
    parts = merge.split(" ")
    if len(parts) != 2:
        raise GGUFFormatError(f"GGUF merge {merge!r} is not two tokens separated by one space")
    return parts[0], parts[1]


def _added_tokens(
    tokens: list[str], token_types: list[int]
) -> tuple[list[AddedToken], list[AddedToken]]:
    if len(token_types) != len(tokens):
        raise GGUFFormatError(f"GGUF has {len(token_types)} token types for {len(tokens)} tokens")
    special, plain = [], []
    for token, token_type in zip(tokens, token_types, strict=True):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    return special, plain
