"""A SentencePiece (`llama`-model) GGUF tokenizer rebuilt as a BPE ranked by score, against
transformers' own reading of the same file (GGUFLlamaConverter)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import transformers

from ringllm.pipeline.models.gguf_config import open_gguf
from ringllm.pipeline.models.gguf_tokenizer import build_tokenizer

# pieces with scores that make the merge order matter: "▁the" outranks "th" + "e", and
# "he" outranks "th", so "the" alone splits as t + he
WORDS = ["▁the", "▁a", "▁cat", "▁sat", "▁on", "▁mat", "he", "th", "▁t", "at", "▁c", "ca"]
WORDS += ["▁s", "sa", "▁m", "ma", "on", "▁o", "e", "t", "h", "a", "c", "s", "m", "o", "n"]
WORDS += ["▁", "\n", "hello", "▁hello", "ll", "l", "lo", "el"]
TEXTS = ["the cat sat on the mat", "hello\nthe mat", "a  cat", "xyz é 日本", "mathello"]


def write_spm_gguf(path, add_space_prefix: bool):
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256  # control, unknown, bytes
    scores = [0.0] * len(pieces)
    for i, word in enumerate(WORDS):
        pieces.append(word)
        types.append(1)
        scores.append(-float(i))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_pieces_and_their_order_are_transformers(tmp_path):
    path = write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=True)
    ours = build_tokenizer(open_gguf(path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text  # unknown characters fall back to their bytes


def test_without_a_space_prefix_nothing_is_prepended(tmp_path):
    """Gemma's files set add_space_prefix false: "the" is t + he (no "▁the"), and text
    decodes as it was, leading space and all."""
    tokenizer = build_tokenizer(open_gguf(write_spm_gguf(tmp_path / "g.gguf", False)))
    pieces = [tokenizer.id_to_token(i) for i in tokenizer.encode("the cat").ids]
    assert pieces == ["t", "he", "▁cat"]
    for text in [*TEXTS, " leading space"]:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_a_vocab_of_another_length_than_its_scores_is_refused(tmp_path):
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.add_token_scores([0.0])
    writer.add_token_types([2, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_error(), match="2 tokens, 1 scores, 2 types"):
        build_tokenizer(open_gguf(path))


def gguf_error():
    from ringllm.pipeline.models.gguf_file import GGUFFormatError

    return GGUFFormatError
