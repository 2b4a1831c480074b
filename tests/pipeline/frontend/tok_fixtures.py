"""Test tokenizers built on the spot: no download, trained in a few milliseconds.

`byte_level_bpe()` is a GPT-2/Qwen-style byte-level BPE; `byte_fallback_bpe()` is a
Llama-2-style BPE over Metaspace with `<0xNN>` byte-fallback tokens. Both are trained on a
few KB of mixed text (accents, Cyrillic, Greek, CJK, Japanese, Korean, emoji, code) with a
small vocabulary, so multi-byte characters are often split across several tokens, which is
what the detokenizer tests need. `write_hf_folder` saves one as an HF model folder that
`transformers.AutoTokenizer` (the oracle) loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SENTENCES = [
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Café, naïve, résumé, déjà vu, façade, jalapeño, Straße, Ærø, smörgåsbord.",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "Καλημέρα κόσμε, τι κάνεις σήμερα;",
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习和自然语言处理。",
    "こんにちは世界。東京は大きな都市です。カタカナとひらがな。",
    "안녕하세요 세계. 한국어 문장입니다.",
    "Emoji: 🎉🚀👍🏽 😀 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ — done.",
    "def add(a, b):\n    return a + b  # numbers 1234567890 and 3.14159\n",
    "Mixed: naïve 中文 🤖 text with    spaces\tand\ttabs\nand newlines.",
    "Math: ∑ x² ≤ ∞, π ≈ 3.14, ∀ε>0 ∃δ>0; arrows → ← ↔.",
]

CORPUS = [f"{sentence} ({i})" for i in range(6) for sentence in _SENTENCES]


def byte_level_bpe(vocab_size: int = 420) -> Tokenizer:
    """Byte-level BPE (every byte is a token, so any text encodes) with ChatML specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def byte_fallback_bpe(vocab_size: int = 300) -> Tokenizer:
    """Llama-2-style: Metaspace BPE whose unknown characters fall back to <0xNN> tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    ascii_only = [ch for ch in "".join(CORPUS) if ord(ch) < 128]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=sorted(set(ascii_only) | {"▁"}),
        limit_alphabet=len(set(ascii_only)) + 1,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # Add the 256 byte tokens after training and switch byte fallback on, as Llama 2 has.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = "<unk>"
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.normalizer = normalizers.Sequence([])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


def write_hf_folder(
    folder: Path,
    tok: Tokenizer,
    tokenizer_config: dict[str, Any] | None = None,
    generation_config: dict[str, Any] | None = None,
    chat_template_file: str | None = None,
) -> Path:
    """Save `tok` as an HF folder: tokenizer.json + the optional config files."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False}
    config.update(tokenizer_config or {})
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    if chat_template_file is not None:
        (folder / "chat_template.jinja").write_text(chat_template_file, encoding="utf-8")
    return folder


def chatml_folder(folder: Path, tok: Tokenizer | None = None, **config: Any) -> Path:
    """A Qwen-like folder: byte-level BPE, ChatML template, EOS <|im_end|>."""
    tokenizer_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    tokenizer_config.update(config)
    return write_hf_folder(folder, tok or byte_level_bpe(), tokenizer_config)
