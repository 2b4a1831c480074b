"""Bad model folders give errors that name what is wrong; good variants load."""

from __future__ import annotations

import json
import shutil

import pytest

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.models.hf_config import load_arch_config
from ringllm.pipeline.models.registry import supported_architectures
from ringllm.pipeline.worker.model_runner import ModelRunner


def copy_model(model_factory, tmp_path, name="llama"):
    dst = tmp_path / "model"
    shutil.copytree(model_factory(name), dst)
    return dst


def load(path, **kwargs):
    return ModelRunner(EngineConfig.from_kwargs(model=str(path), dtype="float32", **kwargs))


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_registry_lists_the_four_architectures():
    assert {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    } <= set(supported_architectures())


def test_both_config_spellings(model_factory):
    legacy = load_arch_config(model_factory("llama"))
    new = load_arch_config(model_factory("qwen3"))
    assert legacy.rope_scaling["rope_type"] == "llama3"
    assert new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert new.head_dim == 32 and legacy.head_dim == 16


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nope")


def test_missing_config(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load(path)


def test_unknown_architecture(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load(path)


def test_missing_field(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    edit_config(path, hidden_size=None)
    with pytest.raises(ValueError, match="hidden_size"):
        load(path)


def test_unsupported_rope(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    edit_config(path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn"):
        load(path)


def test_missing_weights(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(path)


def test_truncated_safetensors(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load(path)


def test_missing_shard(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path, "mistral")
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        load(path)


def test_wrong_shape(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight.*shape \(128, 64\).*\(96, 64\)"):
        load(path)


def test_missing_tensor(model_factory, tmp_path):
    path = copy_model(model_factory, tmp_path)
    edit_config(path, num_hidden_layers=3)
    with pytest.raises(KeyError, match="model.layers.2"):
        load(path)


def test_max_model_len_over_model_limit(model_factory):
    with pytest.raises(
        ValueError, match="max_model_len: 4096 tokens is more than the model allows \\(2048"
    ):
        load(model_factory("llama"), max_model_len=4096)


def test_kv_cache_sized_from_byte_budget(model_factory):
    runner = load(model_factory("llama"), kv_cache_memory_bytes=1 << 20, max_num_seqs=256)
    # 2 layers x (K + V) x 2 KV heads x 16 tokens x 16 dims x 4 bytes = 8 KiB per block.
    assert runner.kv_bytes_per_block == 8192
    assert runner.determine_num_blocks() == (1 << 20) // 8192
    with pytest.raises(ValueError, match="kv_cache_memory_bytes: 100 bytes hold no KV block"):
        load(model_factory("llama"), kv_cache_memory_bytes=100).determine_num_blocks()


def test_dummy_load_format_needs_only_config(tmp_path):
    from ringllm.tools.make_model import ModelShape, make_model

    path = make_model(
        tmp_path / "cfg", ModelShape(arch="qwen2", config_only=True, model_vocab_size=1000)
    )
    assert not (path / "model.safetensors").exists()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load(path)
    runner = load(path, load_format="dummy", num_gpu_blocks_override=4)
    assert runner.arch.vocab_size == 1000
    runner.initialize_kv_cache(4)
    from ringllm.pipeline.worker.model_runner import RunnerRequest

    logits = runner.execute([RunnerRequest([1, 2, 3], 0, [0])]).logits
    assert logits.shape == (1, 1000) and bool(logits.isfinite().all())
