"""`ringllm bench kernels` on the CPU: the complete result JSON, the bytes-moved
arithmetic, the kernel-replay timing, the correctness gate, and the GPU check script's
syntax. No timing is asserted (a noisy 2-core machine): only that timings exist and
are finite and positive."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringllm.pipeline.ops.cpu import kernel_sets
from ringllm.pipeline.ops.cpu_kernels import attention_tiles_usable
from ringllm.tools.bench import kernels as bench_kernels
from ringllm.tools.bench.kernels import (
    DecodeShape,
    HostClock,
    ReplayingLoader,
    check_output,
    decode_bytes_moved,
    make_decode_inputs,
)
from ringllm.tools.bench.report import summarize

REPO_ROOT = Path(__file__).resolve().parents[3]
GPU_CHECK = REPO_ROOT / "tools" / "gpu_check.sh"
TINY = ["--batch-size", "2", "--context-len", "40", "--num-heads", "4", "--num-kv-heads", "2",
        "--head-size", "16", "--block-size", "8", "--copy-bytes", str(1 << 20)]  # fmt: skip


def run_cli(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    bench_kernels.add_parser(parser.add_subparsers())
    out = tmp_path / "kernels.json"
    args = parser.parse_args(["kernels", *argv, "--json", str(out)])
    rc = args.func(args)
    return rc, json.loads(out.read_text())


def numbers_in(value) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_in(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [float(value)]
    return []


def test_bytes_moved_hand_computed():
    shape = DecodeShape(batch_size=2, context_len=10, num_heads=4, num_kv_heads=2,
                        head_size=8, block_size=4, dtype="float16")  # fmt: skip
    # K and V: 2 * (2 requests * 2 KV heads * 10 tokens * 8 elements) * 2 bytes = 1280;
    # q and out: 2 requests * 4 heads * 8 elements * 2 bytes = 128 each.
    assert decode_bytes_moved(shape) == {
        "kv_read_bytes": 1280, "query_bytes": 128, "out_bytes": 128, "total_bytes": 1536,
    }  # fmt: skip
    assert (shape.blocks_per_seq, shape.num_blocks) == (3, 6)  # 10 tokens in blocks of 4
    llama = DecodeShape(**bench_kernels.DEFAULT_SHAPES["cuda"])
    # 256 x 1024 tokens x 8 KV heads x 128 x bf16, K and V: exactly 1 GiB; q + out 4 MiB.
    assert decode_bytes_moved(llama)["total_bytes"] == (1 << 30) + (4 << 20)


def test_cpu_mode_writes_a_complete_json(tmp_path):
    rc, result = run_cli(tmp_path, "--device", "cpu", "--iterations", "3", "--warmup", "1", *TINY)
    assert rc == 0
    expected_keys = {
        "benchmark", "device", "shape", "partition_tokens", "timing", "bytes_moved", "copy",
        "variants", "judged_variant", "judged_timing", "fraction_of_copy",
        "target_fraction_of_copy", "all_correct", "meets_target",
    }  # fmt: skip
    assert set(result) == expected_keys
    assert result["shape"] == {"batch_size": 2, "context_len": 40, "num_heads": 4,
                               "num_kv_heads": 2, "head_size": 16, "block_size": 8,
                               "dtype": "bfloat16", "kv_cache_dtype": "auto",
                               "num_blocks": 10}  # fmt: skip
    assert result["bytes_moved"]["total_bytes"] == 2 * 2 * 2 * 40 * 16 * 2 + 2 * 2 * 4 * 16 * 2
    assert result["copy"]["copy_bytes"] == 1 << 20 and result["timing"]["clock"] == "perf_counter"
    # the engine's C kernels, every set this CPU has (and its tile unit, where it has one),
    # judged on the one the engine runs
    tiles = {"c_avx512bf16_tiles"} if attention_tiles_usable() else set()
    assert set(result["variants"]) == {"torch_ref"} | {"c_" + s for s in kernel_sets()} | tiles
    assert result["judged_variant"] == "c_" + kernel_sets()[-1]
    reference = result["variants"]["torch_ref"]
    assert reference["max_abs_diff"] == 0.0
    for variant in result["variants"].values():
        assert set(variant["call"]) == {
            "median_s",
            "mean_s",
            "min_s",
            "gb_per_s",
            "fraction_of_copy",
        }
        assert variant["kernel"] is None and variant["correct"]
        assert variant["call"]["median_s"] > 0
    assert result["all_correct"] and result["judged_timing"] == "call"
    numbers = numbers_in(result)
    assert numbers and all(math.isfinite(n) for n in numbers)
    assert result["copy"]["gb_per_s"] > 0
    judged = result["variants"][result["judged_variant"]]
    assert result["fraction_of_copy"] == judged["call"]["fraction_of_copy"]
    rc, torch_only = run_cli(tmp_path, "--device", "cpu", "--cpu-kernels", "torch",
                             "--iterations", "2", "--warmup", "0", *TINY)  # fmt: skip
    assert rc == 0 and set(torch_only["variants"]) == {"torch_ref"}
    assert torch_only["judged_variant"] == "torch_ref"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the CUDA emulator")
def test_emulator_mode_times_both_plans_and_their_kernels(tmp_path):
    # 2 requests x 2 KV heads = 4 CTAs: "auto" would partition the 40-token contexts.
    rc, result = run_cli(tmp_path, "--device", "cpu", "--cpu-kernels", "emulator",
                         "--partition-tokens", "16", "--iterations", "2", "--warmup", "1",
                         "--dtype", "float32", *TINY)  # fmt: skip
    assert rc == 0 and result["all_correct"]
    single, split = result["variants"]["single_pass"], result["variants"]["partitioned"]
    assert (single["num_partitions"], split["num_partitions"]) == (1, 3)
    assert set(single["kernel"]["per_kernel_s"]) == {"paged_attention_decode_f32"}
    assert set(split["kernel"]["per_kernel_s"]) == {
        "paged_attention_decode_f32", "paged_attention_reduce_f32",
    }  # fmt: skip
    for variant in (single, split):
        assert 0 < variant["max_abs_diff"] < 1e-5
        assert variant["kernel"]["seconds"] > 0
    assert result["judged_variant"] == "partitioned" and result["judged_timing"] == "kernel"
    assert result["fraction_of_copy"] == split["kernel"]["fraction_of_copy"]
    assert all(math.isfinite(n) for n in numbers_in(result))


def test_an_fp8_cache_moves_half_the_kv_bytes_and_stays_correct(tmp_path):
    rc, result = run_cli(
        tmp_path, "--device", "cpu", "--iterations", "2", "--warmup", "0", "--dtype", "float32",
        "--kv-cache-dtype", "fp8", *TINY,
    )  # fmt: skip
    assert rc == 0 and result["all_correct"]
    assert result["shape"]["kv_cache_dtype"] == "fp8"
    assert result["bytes_moved"]["kv_read_bytes"] == 2 * 2 * 2 * 40 * 16 * 1
    assert result["bytes_moved"]["query_bytes"] == 2 * 4 * 16 * 4


def test_replaying_loader_runs_each_launch_once_untimed_then_repeats():
    launches = []

    class FakeLoader:
        def kernel(self, family, name):
            return lambda grid, block, args, shared_mem=0: launches.append((name, shared_mem))

    replay = ReplayingLoader(FakeLoader(), HostClock(), repeats=4)
    replay.kernel("paged_attention", "decode")((1,), (32,), (), shared_mem=64)
    replay.kernel("paged_attention", "reduce")((1,), (32,), ())
    assert launches == [("decode", 64)] * 5 + [("reduce", 0)] * 5
    per_kernel = replay.seconds_per_launch()
    assert set(per_kernel) == {"decode", "reduce"} and all(s >= 0 for s in per_kernel.values())


def test_a_wrong_output_fails_the_correctness_gate():
    expected = torch.randn(4, 8, 16).to(torch.bfloat16)
    assert check_output(expected.clone(), expected, "bfloat16")["correct"]
    off = expected.clone()
    off[3, 7, 15] += 0.25
    result = check_output(off, expected, "bfloat16")
    assert not result["correct"] and result["max_abs_diff"] >= 0.2
    broken = expected.clone()
    broken[0, 0, 0] = float("nan")
    assert not check_output(broken, expected, "bfloat16")["correct"]


def test_block_tables_scatter_every_block_once():
    shape = DecodeShape(batch_size=3, context_len=33, num_heads=2, num_kv_heads=1,
                        head_size=8, block_size=16, dtype="float32")  # fmt: skip
    inputs = make_decode_inputs(shape, "cpu", seed=1)
    ids = inputs.block_tables.flatten().sort().values
    assert inputs.block_tables.shape == (3, 3) and inputs.block_tables.dtype == torch.int32
    assert torch.equal(ids, torch.arange(9, dtype=torch.int32))
    assert not torch.equal(inputs.block_tables.flatten(), torch.arange(9, dtype=torch.int32))
    assert inputs.seq_lens.tolist() == [33, 33, 33]
    assert inputs.key_cache.shape == (9, 1, 16, 8)


def test_bad_shapes_and_devices_are_refused_with_the_value():
    with pytest.raises(ValueError, match="num_heads: 6 query heads .* num_kv_heads 4"):
        DecodeShape(batch_size=1, context_len=1, num_heads=6, num_kv_heads=4,
                    head_size=8, block_size=16, dtype="float32")  # fmt: skip
    with pytest.raises(ValueError, match="block_size: must be a power of two tokens, got 12"):
        DecodeShape(batch_size=1, context_len=1, num_heads=4, num_kv_heads=4,
                    head_size=8, block_size=12, dtype="float32")  # fmt: skip
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            bench_kernels.resolve_device("cuda")


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(GPU_CHECK)], check=True, timeout=60)


def run_sourced(snippet: str, out: Path, **env: str) -> subprocess.CompletedProcess:
    """Runs `snippet` in bash after sourcing gpu_check.sh (which then defines, not runs)."""
    environment = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "OUT": str(out),
        **env,
    }
    return subprocess.run(
        ["bash", "-c", f'source "{GPU_CHECK}"; {snippet}'],
        cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def write_check_outputs(out: Path, kernels: dict, skipped_tests: int, tok_per_s: float) -> None:
    """What steps 1-4 of gpu_check.sh leave in $OUT, for the summary to read."""
    steps = ["setup\t0\t100", "environment\t0\t3", "gpu_tests\t0\t40", "kernels\t0\t20",
             "make_model\t0\t2", "throughput\t0\t90"]  # fmt: skip
    (out / "steps.tsv").write_text("\n".join(steps) + "\n")
    (out / "gpu_tests.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="54" failures="0" errors="0" '
        f'skipped="{skipped_tests}"/></testsuites>'
    )
    (out / "kernels.json").write_text(json.dumps(kernels))
    throughput = {"output_tokens_per_second": tok_per_s, "requests_per_second": 3.0,
                  "total_output_tokens": 32768, "elapsed_time": 4.0}  # fmt: skip
    for name in ("ttft_ms", "tpot_ms"):  # the key names bench throughput reports
        throughput.update(summarize(name, [10.0, 30.0], [99.0]))
    (out / "throughput.json").write_text(json.dumps(throughput))
    (out / "environment.json").write_text(json.dumps({"cuda_available": True}))


@pytest.fixture(scope="module")
def kernels_result(tmp_path_factory) -> dict:
    _, result = run_cli(tmp_path_factory.mktemp("kernels"), "--device", "cpu",
                        "--iterations", "2", "--warmup", "0", *TINY)  # fmt: skip
    return result


@pytest.mark.parametrize(
    "skipped_tests, meets_target, tok_per_s, passed",
    [(0, True, 9000.0, True), (1, True, 9000.0, False), (0, False, 9000.0, False),
     (0, True, 7999.0, False)],
)  # fmt: skip
def test_gpu_check_summary_judges_every_target(
    tmp_path, kernels_result, skipped_tests, meets_target, tok_per_s, passed
):
    write_check_outputs(tmp_path, {**kernels_result, "meets_target": meets_target},
                        skipped_tests, tok_per_s)  # fmt: skip
    python = str(Path(sys.executable))
    done = run_sourced(f'"{python}" -c "$SUMMARY_PY" "$OUT" 255', tmp_path)
    assert done.returncode == (0 if passed else 1), done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["passed"] is passed and summary["total_seconds"] == 255
    assert summary["gpu_tests"]["passed"] is (skipped_tests == 0)
    assert summary["gpu_tests"]["tests"] == 54
    assert summary["decode_kernel"]["passed"] is meets_target
    assert summary["decode_kernel"]["variant"] == kernels_result["judged_variant"]
    assert summary["decode_kernel"]["copy_gb_per_s"] == kernels_result["copy"]["gb_per_s"]
    e2e = summary["throughput"]
    assert e2e["passed"] is (tok_per_s > 8000)
    assert (e2e["mean_ttft_ms"], e2e["median_tpot_ms"]) == (20.0, 20.0)
    assert [s["name"] for s in summary["steps"]][-1] == "throughput"


def test_gpu_check_run_step_records_a_timeout(tmp_path):
    done = run_sourced('run_step sleepy 1 sleep 30 || echo "rc=$?"', tmp_path)
    assert "rc=124" in done.stdout and "timed out after 1 s" in done.stderr
    name, rc, seconds = (tmp_path / "steps.tsv").read_text().split("\t")
    assert (name, rc) == ("sleepy", "124") and int(seconds) < 15
    assert (tmp_path / "sleepy.log").exists()


def make_stand_in_venv(root: Path) -> Path:
    """A venv whose python is this interpreter and whose `ringllm` always fails."""
    venv_bin = root / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f'#!/bin/bash\nexec "{sys.executable}" "$@"\n')
    (venv_bin / "ringllm").write_text('#!/bin/bash\necho "stand-in ringllm $*"; exit 1\n')
    for tool in venv_bin.iterdir():
        tool.chmod(0o755)
    return venv_bin.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU stop")
def test_gpu_check_stops_when_torch_sees_no_gpu(tmp_path):
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "OUT": str(out), "SKIP_INSTALL": "1",
           "VENV": str(make_stand_in_venv(tmp_path))}  # fmt: skip
    done = subprocess.run(["bash", str(GPU_CHECK)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 1
    build = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA device"
    assert f"STOPPED: torch {torch.__version__}" in done.stderr and build in done.stderr
    info = json.loads((out / "environment.json").read_text())
    assert info["cuda_available"] is False and info["torch"] == torch.__version__
    assert (out / "steps.tsv").read_text().splitlines()[:1] == ["setup\tskipped\t0"]
    assert not (out / "gpu_tests.xml").exists()  # stopped before the tests


def sourced_array(name: str, out: Path) -> list[str]:
    done = run_sourced(f'printf "%s\\n" "${{{name}[@]}}"', out)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_gpu_check_model_and_workload_parse_with_the_real_parsers(tmp_path):
    from ringllm.pipeline.config import from_cli_args
    from ringllm.tools import make_model
    from ringllm.tools.bench import throughput as bench_throughput

    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    make_model.add_parser(subparsers)
    bench_throughput.add_parser(subparsers)
    model_dir = tmp_path / "model"
    made = parser.parse_args(
        ["make-model", str(model_dir), *sourced_array("MAKE_MODEL_ARGS", tmp_path)]
    )
    assert made.func(made) == 0
    config = json.loads((model_dir / "config.json").read_text())
    llama3_8b = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                 "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}  # fmt: skip
    assert {k: config[k] for k in llama3_8b} == llama3_8b
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert not list(model_dir.glob("*.safetensors"))  # weights come from --load-format dummy
    workload = sourced_array("THROUGHPUT_ARGS", tmp_path)
    args = parser.parse_args(["throughput", "--model", str(model_dir), *workload])
    engine = from_cli_args(args)
    assert (engine.model.load_format, engine.device.device, engine.model.dtype) == (
        "dummy", "cuda", "bfloat16",
    )  # fmt: skip
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (256, 8192)
    assert (args.num_prompts, args.input_len, args.output_len, args.ignore_eos) == (
        256, 512, 128, True,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU outcome")
def test_gpu_check_steps_after_a_failure_still_run_and_the_summary_fails(tmp_path):
    """Without a GPU: the gpu tests all skip (which fails the check, not passes it), a
    failing benchmark does not stop the script, and a failed make-model skips the
    throughput run. `ringllm` here is a stand-in that fails; pytest is the real one."""
    venv = make_stand_in_venv(tmp_path)
    out = tmp_path / "out"
    steps = 'check_preconditions; gpu_tests; kernels; throughput; "$VENV/bin/python" -c "$SUMMARY_PY" "$OUT" 9'
    done = run_sourced(steps, out, VENV=str(venv))
    assert done.returncode == 1, done.stderr
    assert "step kernels failed with exit status 1" in done.stderr
    assert "step throughput skipped: make-model failed" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["name"], s["exit_status"]) for s in summary["steps"]] == [
        ("gpu_tests", "0"), ("kernels", "1"), ("make_model", "1"), ("throughput", "skipped"),
    ]  # fmt: skip
    tests = summary["gpu_tests"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"] and not tests["passed"]
    assert json.loads((out / "gpu_tests.json").read_text()) == tests
    assert len(tests["skipped_names"]) == tests["skipped"] and tests["failure_names"] == []
    assert not summary["passed"] and not summary["decode_kernel"]["passed"]
    assert "stand-in ringllm bench kernels --device cuda" in (out / "kernels.log").read_text()
