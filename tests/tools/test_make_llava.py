"""tools/make_llava.py's own command: the benchmark shapes' folders, and the zeroed rows past
the tokenizer's vocabulary (a model that only ever picks tokens with text)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ringllm.tools.make_llava import bench_shapes, main, zero_padding_rows
from ringllm.tools.make_model import ModelShape, make_model


def test_the_tiny_shape_is_the_make_model_default(tmp_path, capsys):
    assert main([str(tmp_path / "tiny"), "--shape", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["image_seq_length"] == 16 and config["text_config"]["hidden_size"] == 64


def test_the_benchmark_shape_is_clip_b_before_a_smollm2_135m():
    shape, vision = bench_shapes()["clip-b-smollm2"]
    assert vision.num_image_tokens == 256 and (vision.hidden_size, vision.num_layers) == (768, 12)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (
        576, 30, 9, 3,
    )  # fmt: skip
    assert shape.model_vocab_size == 49152 and shape.intermediate_size == 1536


def test_rows_past_the_tokenizer_are_zeroed(tmp_path):
    out = make_model(tmp_path / "m", ModelShape(arch="llava", model_vocab_size=640))
    zero_padding_rows(out)
    num_tokens = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    weights = load_file(str(out / "model.safetensors"))
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        rows = weights[name]
        assert rows.shape[0] == 640 > num_tokens
        assert torch.count_nonzero(rows[num_tokens:]) == 0
        assert bool((rows[:num_tokens].abs().sum(dim=1) > 0).all())
