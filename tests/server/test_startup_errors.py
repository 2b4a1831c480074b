"""`ringllm serve` with a model or a flag it cannot run: one line on stderr naming the
problem, exit code 2, no traceback (and no "does not exist" for a file that exists)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import gguf
import pytest


def serve(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ringllm.tools.cli", "serve", *args, "--port", "0"]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)


def the_error_line(result: subprocess.CompletedProcess) -> str:
    """The one line the failed start printed (log lines of a start under way aside)."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and " INFO " not in line and not line.startswith(("usage:", " "))
    ]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory("llama")


def test_a_file_of_an_unknown_kind(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    line = the_error_line(serve(str(path)))
    assert str(path) in line and "is a file but not a .gguf one" in line
    assert "does not exist" not in line


def test_a_folder_without_a_config(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    line = the_error_line(serve(str(tmp_path)))
    assert str(tmp_path) in line and "config.json" in line


def test_a_folder_of_an_architecture_ringllm_lacks(tmp_path, model_path):
    folder = tmp_path / "model"
    shutil.copytree(model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconMambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    line = the_error_line(serve(str(folder)))
    assert "'FalconMambaForCausalLM' is not supported" in line


def test_a_gguf_of_an_architecture_ringllm_lacks(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = the_error_line(serve(str(path)))
    assert "'mamba'" in line


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--max-model-len", "99999999"], "max_model_len: 99999999 tokens"),
        (["--tensor-parallel-size", "3"], "tensor_parallel_size: 3 ranks do not divide"),
    ],
    ids=["max-model-len", "tensor-parallel-size"],
)
def test_a_flag_value_the_engine_refuses(model_path, flags, words):
    line = the_error_line(serve(str(model_path), "--dtype", "float32", *flags))
    assert words in line
