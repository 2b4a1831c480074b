"""`ringllm bench pp` on a tiny random llama of 4 layers: every configuration runs and
reports throughput and TTFT, each pipeline configuration its stages (as many as it has, the
layers as split, every rank running every step, what one stage sent the next received),
the stage figures add up on hand-made counters, and bad flags fail before an engine is
built, said without a traceback. Behaviour only, never timings."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

from ringllm.tools import cli
from ringllm.tools.bench import commands as bench
from ringllm.tools.bench.pp import parse_configs
from ringllm.tools.bench.pp_stages import stage_summary

CONFIGS = "pp1,pp2,pp2:3,1"
NUM_PROMPTS, OUTPUT_LEN = 2, 4


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringllm")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "pp", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def tiny_model(model_factory):
    return str(model_factory("llama", num_layers=4))


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """The whole benchmark once; (result, printed table)."""
    out = tmp_path_factory.mktemp("bench_pp") / "pp.json"
    argv = [
        "--model", tiny_model, "--dtype", "float32", "--configs", CONFIGS,
        "--num-prompts", str(NUM_PROMPTS), "--input-len", "12", "--output-len", str(OUTPUT_LEN),
        "--ttft-requests", "2", "--num-iters", "1", "--num-iters-warmup", "0",
        "--num-gpu-blocks-override", "64", "--swap-space", "0", "--result-json", str(out),
    ]  # fmt: skip
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert run_cli(argv) == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_every_config_reports_throughput_and_ttft(run):
    result, table = run
    assert result["baseline"] == "pp1"
    configs = result["configs"]
    assert list(configs) == ["pp1", "pp2", "pp2:3,1"]
    for name, summary in configs.items():
        assert summary["output_tok_s"] > 0
        assert summary["median_ttft_ms"] > 0 and summary["median_engine_ttft_ms"] > 0
        (only,) = summary["runs"]
        assert only["output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert len(only["ttft_s"]) == 2
        assert summary["speedup_over_baseline"] > 0
        assert name in table
    assert configs["pp1"]["stages"] == [] and configs["pp1"]["layer_partition"] == [4]
    assert "Pipeline Parallel Benchmark Result" in table and "bubble" in table


@pytest.mark.parametrize(("name", "partition"), [("pp2", [2, 2]), ("pp2:3,1", [3, 1])])
def test_pipeline_configs_report_each_stage(run, name, partition):
    summary = run[0]["configs"][name]
    assert summary["layer_partition"] == partition
    first, last = summary["stages"]
    assert (first["start_layer"], first["end_layer"]) == (0, partition[0])
    assert (last["start_layer"], last["end_layer"]) == (partition[0], 4)
    # every rank ran every step; the prefill and each decode step at least
    assert first["steps"] == last["steps"] >= OUTPUT_LEN
    assert first["bytes_sent"] == last["bytes_received"] > 0
    assert first["bytes_received"] == 0 and last["bytes_sent"] == 0
    for stage in (first, last):
        assert stage["step_s"] >= stage["recv_wait_s"] + stage["send_wait_s"]
        assert 0.0 <= stage["bubble"] <= 1.0
    assert first["recv_wait_s"] == 0.0  # the first stage waits for no stage


def test_stage_summary_per_step_figures():
    totals = {
        "steps": 10, "step_s": 1.0, "recv_wait_s": 0.25, "send_wait_s": 0.05,
        "ring_wait_s": 0.5, "bytes_sent": 10 * 2048, "bytes_received": 0,
    }  # fmt: skip
    stage = stage_summary(totals, wall_s=2.0, num_runs=2, layers=(0, 15))
    assert stage["steps_per_run"] == 5
    assert stage["step_ms"] == pytest.approx(100.0)
    assert stage["compute_ms_per_step"] == pytest.approx(70.0)
    assert stage["ring_wait_ms_per_step"] == pytest.approx(50.0)
    assert stage["sent_kib_per_step"] == pytest.approx(2.0)
    assert stage["bubble"] == pytest.approx(1 - 0.7 / 2.0)


def test_configs_parse_partitions_across_commas():
    configs = parse_configs("pp1, pp2,pp2:17,13,pp3:10,10,10")
    assert [(c.name, c.pipeline_parallel_size, c.layer_partition) for c in configs] == [
        ("pp1", 1, None),
        ("pp2", 2, None),
        ("pp2:17,13", 2, "17,13"),
        ("pp3:10,10,10", 3, "10,10,10"),
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--configs", "pp1,tp2"), "configs: 'tp2' is not a configuration"),
        (("--configs", "pp0"), "configs: 'pp0'"),
        (("--configs", "pp1,pp1"), "twice"),
        (("--configs", "pp2:3,2"), "pp2:3,2: .*adds up to 5 layers, the model has 4"),
        (("--configs", "pp2:4"), "1 entries for pipeline_parallel_size 2"),
        (("--num-iters", "0"), "num_iters"),
        (("--ttft-requests", "0"), "ttft_requests"),
        (("--tensor-parallel-size", "2"), "tensor_parallel_size"),
    ],
)
def test_bad_flags_fail_before_an_engine_is_built(tiny_model, flags, message):
    with pytest.raises(ValueError, match=message):
        run_cli(["--model", tiny_model, *flags])


def test_the_console_script_says_a_bad_partition_without_a_traceback(tiny_model, capsys):
    assert cli.main(["bench", "pp", "--model", tiny_model, "--configs", "pp1,pp2:2,1"]) == 2
    err = capsys.readouterr().err
    assert "ringllm bench: error: configs: pp2:2,1:" in err and "adds up to 3 layers" in err
    assert "Traceback" not in err


def test_the_pipeline_flags_are_the_configs(capsys):
    with pytest.raises(SystemExit):
        run_cli(["--pipeline-parallel-size", "2"])
    assert "unrecognized arguments: --pipeline-parallel-size" in capsys.readouterr().err
