"""tools/make_gguf.py and tools/gguf_quantize.py: block bytes that gguf's own decoder turns
back into the input, and GGUF files that ringllm's reader and engine load as the HF folder.

Oracles: `gguf.quants.dequantize` (the reference decoder) for every encoding; the folder's
safetensors for what the file holds; transformers on the folder for what the engine
generates from an F32 file.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from ringllm.pipeline.models.gguf_config import build_hf_config
from ringllm.pipeline.models.gguf_file import GGUFFile
from ringllm.pipeline.models.gguf_tokenizer import build_tokenizer
from ringllm.pipeline.models.gguf_weights import GGUFWeightSource, rotary_row_order
from ringllm.tools.gguf_quantize import quantize
from ringllm.tools.make_gguf import TYPES, main, make_gguf, rotary_interleave
from ringllm.tools.make_model import ModelShape, make_model

T = gguf.GGMLQuantizationType
# Relative RMS error bounds on N(0, 1) weights: each format's own floor plus a margin
# (a 4-bit level step over a 32-value block's range is ~0.27 sigma: ~7.5% RMS at best).
ERROR_BOUNDS = {
    "f32": 0.0,
    "f16": 1e-3,
    "bf16": 5e-3,
    "q8_0": 0.008,
    "q6_k": 0.02,
    "q5_0": 0.045,
    "q5_1": 0.042,
    "q5_k": 0.04,
    "q4_0": 0.09,
    "q4_1": 0.082,
    "q4_k": 0.075,
}


def relative_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return float(np.sqrt(((approx - exact) ** 2).mean() / (exact**2).mean()))


def round_trip(array: np.ndarray, name: str) -> np.ndarray:
    data = quantize(array, TYPES[name])
    if name == "f32":
        return data
    return gguf.quants.dequantize(data, TYPES[name])


@pytest.mark.parametrize("name", sorted(ERROR_BOUNDS))
def test_every_type_decodes_back_to_its_input(name):
    x = np.random.default_rng(0).standard_normal((32, 512)).astype(np.float32)
    y = round_trip(x, name)
    assert y.shape == x.shape
    assert relative_rms(y, x) <= ERROR_BOUNDS[name]


@pytest.mark.parametrize(("k_quant", "sibling"), [("q4_k", "q4_1"), ("q5_k", "q5_1")])
def test_k_quants_are_no_worse_than_the_32_value_affine_formats(k_quant, sibling):
    # the same affine 4 / 5-bit code per 32 values, scales in 6 bits instead of fp16:
    # the search must win back what the coarser scales lose
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    assert relative_rms(round_trip(x, k_quant), x) <= relative_rms(round_trip(x, sibling), x)


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_scales_span_their_whole_code_range(name):
    # sub-blocks 1000x apart in scale use every bit of the packed 6-bit scales and mins (or
    # Q6_K's int8 scales): a bit packed in the wrong place shows as a wrong sub-block
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 512))
    x *= np.repeat(np.geomspace(1e-3, 1.0, 16), 32)[None, :]
    x[:, 32:64] += 0.3  # positive sub-blocks: their min must clamp to zero, not wrap
    y = round_trip(x.astype(np.float32), name)
    sub_blocks = slice(256 - 64, 512)  # the larger ones: scales well above fp16 rounding
    per_block = relative_rms(y[:, sub_blocks], x[:, sub_blocks])
    assert per_block < 2 * ERROR_BOUNDS[name]


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_k_quants_of_degenerate_rows(name):
    zeros = np.zeros((2, 256), np.float32)
    assert np.array_equal(round_trip(zeros, name), zeros)
    constant = np.full((2, 256), -0.75, np.float32)
    np.testing.assert_allclose(round_trip(constant, name), constant, rtol=0.02)


def test_k_quants_need_whole_super_blocks():
    with pytest.raises(ValueError, match="256"):
        quantize(np.zeros((4, 96), np.float32), T.Q4_K)


def test_rotary_interleave_is_what_the_reader_undoes():
    rows = np.arange(8 * 32 * 3, dtype=np.float32).reshape(8 * 32, 3)
    interleaved = rotary_interleave(rows, 8)
    assert np.array_equal(interleaved[rotary_row_order(8 * 32, 8)], rows)
    # head 0: HF rows 0, 16, 1, 17, ... in file order
    assert list(interleaved[:4, 0] // 3) == [0, 16, 1, 17]


# ---- files --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(model_factory, tmp_path_factory):
    """The conftest variants without rope scaling (a GGUF carries none), and a llama wide
    enough for K-quants (rows of 256)."""
    made = {arch: model_factory(arch, rope_scaling="none") for arch in ("llama", "qwen2", "qwen3")}
    wide = ModelShape(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)
    made["wide"] = make_model(tmp_path_factory.mktemp("wide_llama"), wide)
    return made


def hf_weights(folder) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in load_file(str(folder / "model.safetensors")).items()}


@pytest.mark.parametrize(
    "name", ["q8_0", "q4_0", "f16", "bf16", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "f32"]
)
def test_file_reads_back_as_the_folder(folders, tmp_path, name):
    folder = folders["wide"]
    path = make_gguf(folder, tmp_path / "m.gguf", name)
    source = GGUFWeightSource(path)
    weights = hf_weights(folder)
    assert source.names() == sorted(weights)
    for hf_name, exact in weights.items():
        got = source.get(hf_name).float().numpy()
        assert got.shape == exact.shape, hf_name
        if exact.ndim == 1:  # norms: F32 always
            assert source.qtype(hf_name) is None and np.array_equal(got, exact), hf_name
            continue
        # the file's rows (un-permuted for q / k) are the encoding of the HF rows, exactly
        np.testing.assert_array_equal(got, round_trip(exact, name), err_msg=hf_name)
        assert source.qtype(hf_name) == (None if name in ("f32", "f16", "bf16") else name)
        assert relative_rms(got, exact) <= ERROR_BOUNDS[name] * 1.2, hf_name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_metadata_rebuilds_the_folders_config_and_tokenizer(folders, tmp_path, arch):
    folder = folders[arch]
    path = make_gguf(folder, tmp_path / "m.gguf", "q8_0")
    reader = GGUFFile(path)
    want = json.loads((folder / "config.json").read_text())
    got = build_hf_config(reader)
    for key in (
        "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        "tie_word_embeddings", "max_position_embeddings", "eos_token_id", "bos_token_id",
    ):  # fmt: skip
        assert got[key] == want[key], key
    assert got["rope_theta"] == want.get("rope_theta", 10000.0)
    assert got["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"])
    assert reader.get("tokenizer.chat_template") == (folder / "chat_template.jinja").read_text()
    assert reader.get("general.architecture") == arch
    source = GGUFWeightSource(path)  # every tensor placed, shapes as the config implies
    assert source.names() == sorted(hf_weights(folder))
    assert ("lm_head.weight" in source) == (not want["tie_word_embeddings"])
    assert all(
        source.qtype(n) is None for n in source.names() if n.endswith(("bias", "norm.weight"))
    )
    oracle = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rebuilt = build_tokenizer(reader)
    text = "def f(x):\n    return x  <|im_start|>user\n héllo<|im_end|>"
    assert rebuilt.encode(text).ids == oracle.encode(text).ids


def test_matrices_too_narrow_for_k_quants_fall_back_to_q8_0(folders, tmp_path):
    with pytest.warns(UserWarning, match=r"Q4_K -> Q8_0"):
        path = make_gguf(folders["llama"], tmp_path / "m.gguf", "q4_k")
    source = GGUFWeightSource(path)
    assert source.qtype("model.layers.0.mlp.down_proj.weight") == "q8_0"
    assert GGUFFile(path).get("general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_K_S)


def test_overrides_from_the_command_line(folders, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    args = [str(folders["wide"]), str(out), "--type", "q4_k"]
    args += ["--type-of", "output.weight=q6_k", "--type-of", "*.ffn_down.*=f16"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    source = GGUFWeightSource(out)
    assert source.qtype("lm_head.weight") == "q6_k"
    assert source.qtype("model.layers.1.mlp.down_proj.weight") is None
    assert source.get("model.layers.1.mlp.down_proj.weight").dtype == torch.float16
    assert source.qtype("model.layers.1.mlp.up_proj.weight") == "q4_k"


def test_unknown_type_is_an_error_naming_the_choices(folders, tmp_path):
    with pytest.raises(ValueError, match="q4_k"):
        make_gguf(folders["llama"], tmp_path / "m.gguf", "q3_k")


# ---- the engine ---------------------------------------------------------------------------

PROMPT = [5, 6, 7, 8, 9]


def engine_greedy(path, max_tokens=6) -> list[int]:
    from ringllm.pipeline import LLM, SamplingParams

    llm = LLM(
        str(path), dtype="float32", max_num_seqs=2,
        max_num_batched_tokens=64, num_gpu_blocks_override=32,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def transformers_greedy(folder, max_tokens=6) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=max_tokens, do_sample=False,
            min_new_tokens=max_tokens, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_engine_runs_the_f32_file_as_transformers_runs_the_folder(folders, tmp_path, arch):
    path = make_gguf(folders[arch], tmp_path / f"{arch}.gguf", "f32")
    assert engine_greedy(path) == transformers_greedy(folders[arch])


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q5_0"])
def test_engine_runs_a_block_file_as_transformers_runs_its_decoded_weights(folders, tmp_path, name):
    # the oracle folder holds what the file decodes to (gguf's decoder), in float32
    path = make_gguf(folders["wide"], tmp_path / "wide.gguf", name)
    source = GGUFWeightSource(path)
    decoded = tmp_path / "decoded"
    shutil.copytree(folders["wide"], decoded)
    save_file(
        {n: source.get(n).float().contiguous() for n in source.names()},
        str(decoded / "model.safetensors"),
        metadata={"format": "pt"},
    )
    assert engine_greedy(path) == transformers_greedy(decoded)
