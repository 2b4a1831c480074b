"""`ringllm bench` tools, their shared datasets and reporting, and the transformers peer.

Behaviour only, never timings: the runs are tiny (a random 2-layer model) and the checks
are on counts, keys and consistency between the numbers, which hold on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter

import numpy as np
import pytest

from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.tools.bench import commands as bench
from ringllm.tools.bench.datasets import sample_requests
from ringllm.tools.bench.datasets.request import length_bounds
from ringllm.tools.bench.datasets.text import (
    code_edit_requests,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from ringllm.tools.bench.report import (
    format_table,
    parse_percentiles,
    summarize,
)


@pytest.fixture(scope="module")
def tiny_model(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_folder(tiny_model)


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ringllm")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def run_cli(argv: list[str]) -> int:
    args = bench_parser().parse_args(argv)
    return args.func(args)


# ---- bench throughput / latency ---------------------------------------------------------


def test_throughput_writes_a_complete_result_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["bench", "throughput", "--model", str(tiny_model), "--num-prompts", "5",
            "--input-len", "8", "--output-len", "4", "--ignore-eos", "--max-num-seqs", "2",
            "--metric-percentiles", "50,99.9", "--result-json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    assert "Output token throughput (tok/s)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_requests"] == 5
    assert result["total_input_tokens"] == 5 * 8
    assert result["total_output_tokens"] == 5 * 4 == result["expected_output_tokens"]
    assert result["total_num_tokens"] == 5 * 12
    elapsed = result["elapsed_time"]
    assert elapsed > 0
    assert math.isclose(result["requests_per_second"], 5 / elapsed)
    assert math.isclose(result["tokens_per_second"], 60 / elapsed)
    assert math.isclose(result["output_tokens_per_second"], 20 / elapsed)
    for metric in ("ttft_ms", "tpot_ms", "e2el_ms"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{metric}" in result
        assert 0 < result[f"median_{metric}"] <= result[f"p99.9_{metric}"]
        assert "p90_" + metric not in result  # only the percentiles asked for
    # Every request ends within the run, and its first token comes before its last.
    assert result["p99.9_e2el_ms"] <= 1e3 * elapsed * 1.01
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    engine = result["config"]["engine"]
    assert engine["scheduler"]["max_num_seqs"] == 2  # engine flags reach the engine
    assert engine["model"]["model"] == str(tiny_model)
    assert result["config"]["workload"]["num_prompts"] == 5
    assert result["machine_before"]["cpu_count"] >= 1


def test_throughput_counts_prefix_cache_hits_of_shared_prefixes(tiny_model, tmp_path):
    out = tmp_path / "prefix.json"
    argv = ["bench", "throughput", "--model", str(tiny_model), "--dataset", "prefix-repetition",
            "--num-prompts", "6", "--prefix-len", "32", "--suffix-len", "4", "--num-prefixes", "2",
            "--output-len", "2", "--ignore-eos", "--max-num-seqs", "2", "--result-json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    assert result["total_input_tokens"] == 6 * 36
    # Only whole 16-token blocks of a prefix already computed can be hits: at most the
    # 32-token prefix of each of the 4 requests that do not come first with their prefix.
    assert 0 < result["num_cached_tokens"] <= 4 * 32
    assert result["num_cached_tokens"] % 16 == 0


def test_latency_times_each_iteration(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(tiny_model), "--batch-size", "3",
            "--input-len", "6", "--output-len", "3", "--num-iters", "3",
            "--num-iters-warmup", "1", "--output-json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    latencies = result["latencies"]
    assert len(latencies) == 3 and all(t > 0 for t in latencies)
    assert math.isclose(result["avg_latency"], sum(latencies) / 3)
    assert set(result["percentiles"]) == {"90", "99"}
    assert min(latencies) <= result["percentiles"]["90"] <= max(latencies)
    assert result["config"]["workload"]["batch_size"] == 3


def test_spec_runs_both_engines_side_by_side(tiny_model, tmp_path, capsys):
    """The target as its own draft: every draft accepted, greedy outputs identical."""
    out = tmp_path / "spec.json"
    spec = json.dumps(
        {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    )
    argv = ["bench", "spec", "--model", str(tiny_model), "--dtype", "float32",
            "--speculative-config", spec, "--batch-size", "2", "--input-len", "40",
            "--output-len", "12", "--ignore-eos", "--num-iters", "2", "--num-iters-warmup", "0",
            "--output-json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    assert len(result["plain_latency_s"]) == len(result["spec_latency_s"]) == 2
    assert result["output_tokens_per_iteration"] == {"plain": 24, "spec": 24}
    assert result["identical_outputs"] == result["num_requests"] == 2
    assert result["acceptance_rate"] == 1.0 and result["num_drafts"] > 0
    assert result["mean_acceptance_length"] > 2
    assert result["speedup"] == result["spec_output_tok_s"] / result["plain_output_tok_s"]
    assert (
        result["config"]["engine"]["speculative"]["speculative_config"]["method"] == "draft_model"
    )
    assert "Speculative Decoding Benchmark Result" in capsys.readouterr().out
    with pytest.raises(ValueError, match="needs --speculative-config"):
        run_cli(["bench", "spec", "--model", str(tiny_model)])


def test_bad_arguments_fail_before_the_run(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="metric_percentiles"):
        run_cli(["bench", "throughput", "--model", str(tiny_model), "--metric-percentiles", "0"])
    missing = tmp_path / "no_such_folder" / "r.json"
    with pytest.raises(ValueError, match="result_json"):
        run_cli(["bench", "latency", "--model", str(tiny_model), "--result-json", str(missing)])
    with pytest.raises(ValueError, match="batch_size"):
        run_cli(["bench", "latency", "--model", str(tiny_model), "--batch-size", "0"])


def test_bench_wires_every_tool():
    parser = bench_parser()
    names = {
        "throughput": "run_throughput_command",
        "latency": "run_latency_command",
        "spec": "run_spec_command",
    }
    for command, func in names.items():
        assert parser.parse_args(["bench", command]).func.__name__ == func
    for command in ("serve", "ipc", "kernels"):
        assert callable(parser.parse_args(["bench", command, *_required_args(command)]).func)


def _required_args(command: str) -> list[str]:
    return ["--base-url", "http://127.0.0.1:1"] if command == "serve" else []


# ---- datasets ---------------------------------------------------------------------------


def test_random_lengths_stay_within_the_range_ratio(tokenizer):
    requests = random_requests(tokenizer, 200, 20, 10, 0.5, seed=3)
    in_lens = [r.prompt_len for r in requests]
    out_lens = [r.expected_output_len for r in requests]
    assert (min(in_lens), max(in_lens)) == (10, 30)  # both ends drawn over 200 requests
    assert (min(out_lens), max(out_lens)) == (5, 15)
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    ids = np.concatenate([r.prompt for r in requests])
    assert ids.min() >= 0 and ids.max() < tokenizer.vocab_size
    assert not set(ids.tolist()) & set(tokenizer.all_special_ids)
    assert len(set(ids.tolist())) > tokenizer.vocab_size // 2  # spread over the vocabulary


def test_random_is_seeded_and_exact_without_a_range(tokenizer):
    a = random_requests(tokenizer, 8, 12, 7, 0.0, seed=1)
    assert a == random_requests(tokenizer, 8, 12, 7, 0.0, seed=1)
    assert a != random_requests(tokenizer, 8, 12, 7, 0.0, seed=2)
    assert {(r.prompt_len, r.expected_output_len) for r in a} == {(12, 7)}
    assert length_bounds(3, 0.9) == (1, 6)  # never below one token
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(tokenizer, 2, 8, 8, 1.0, seed=0)
    with pytest.raises(ValueError, match="input_len"):
        random_requests(tokenizer, 2, 0, 8, 0.0, seed=0)


def test_prefix_repetition_shares_prefixes(tokenizer):
    requests = prefix_repetition_requests(tokenizer, 10, 20, 5, 3, 6, seed=0)
    assert len(requests) == 10
    assert all(r.prompt_len == 25 == len(r.prompt) for r in requests)
    assert all(r.expected_output_len == 6 for r in requests)
    groups = Counter(tuple(r.prompt[:20]) for r in requests)
    assert sorted(groups.values()) == [3, 3, 4]
    assert len({tuple(r.prompt[20:]) for r in requests}) == 10  # suffixes are each their own
    first_prefix = [tuple(r.prompt[:20]) for r in requests]
    assert first_prefix != sorted(first_prefix, key=list(groups).index)  # interleaved
    special = set(tokenizer.all_special_ids)
    assert not any(set(r.prompt) & special for r in requests)
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition_requests(tokenizer, 2, 20, 5, 3, 6, seed=0)


def _sharegpt_file(tmp_path):
    data = [
        {"conversations": [
            {"from": "human", "value": "How do I sort a list of numbers in Python quickly?"},
            {"from": "gpt", "value": "Call sorted() on the list, or list.sort() to sort in place."},
        ]},
        {"conversations": [
            {"from": "human", "value": "What is the capital city of the country of France?"},
            {"from": "gpt", "value": "Paris is the capital and the largest city of France."},
            {"from": "human", "value": "This later turn is never used."},
        ]},
        {"conversations": [{"from": "human", "value": "only one turn, dropped"}]},
        {"conversations": [
            {"from": "human", "value": "Hi"},  # too short a prompt: dropped
            {"from": "gpt", "value": "Hello there, how can I help you today?"},
        ]},
        {"id": "no conversations key"},
    ]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_takes_first_turns_and_measures_them(tokenizer, tmp_path):
    path = _sharegpt_file(tmp_path)
    requests = sharegpt_requests(tokenizer, path, 2, None, seed=0)
    assert {r.prompt for r in requests} == {
        "How do I sort a list of numbers in Python quickly?",
        "What is the capital city of the country of France?",
    }
    for r in requests:
        assert r.prompt_len == len(tokenizer.encode(r.prompt))  # as the engine counts it
    sort_request = next(r for r in requests if "sort" in r.prompt)
    reply_text = "Call sorted() on the list, or list.sort() to sort in place."
    assert sort_request.expected_output_len == len(
        tokenizer.encode(reply_text, add_special_tokens=False)
    )
    fixed = sharegpt_requests(tokenizer, path, 5, 9, seed=0)  # oversampled, fixed output
    assert len(fixed) == 5 and {r.expected_output_len for r in fixed} == {9}
    assert {r.prompt for r in fixed} == {r.prompt for r in requests}


def test_code_edit_quotes_real_source_and_is_seeded(tokenizer):
    import sysconfig
    from pathlib import Path

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(errors="replace") for p in stdlib.glob("*.py")]
    first = code_edit_requests(tokenizer, 6, 120, 50, seed=3)
    assert first == code_edit_requests(tokenizer, 6, 120, 50, seed=3)
    assert first != code_edit_requests(tokenizer, 6, 120, 50, seed=4)
    for r in first:
        assert r.prompt.startswith("```python\n") and r.prompt.endswith("```python\n")
        code = r.prompt.split("```python\n")[1].rsplit("\n```", 1)[0]
        assert any(code in source for source in sources)  # a verbatim stretch of a file
        assert len(tokenizer.encode(code, add_special_tokens=False)) >= 120 or any(
            source.endswith(code) or source.endswith(code + "\n") for source in sources
        )  # long enough, unless the file ended first
        assert r.prompt_len == len(tokenizer.encode(r.prompt)) and r.expected_output_len == 50


def test_sharegpt_errors_name_the_file(tokenizer, tmp_path):
    args = argparse.Namespace(dataset="sharegpt", dataset_path=None, num_prompts=2, output_len=None)
    with pytest.raises(ValueError, match="--dataset-path"):
        sample_requests(args, tokenizer, 0)
    with pytest.raises(ValueError, match="does not exist"):
        sharegpt_requests(tokenizer, tmp_path / "missing.json", 2, None, seed=0)
    (tmp_path / "dict.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt_requests(tokenizer, tmp_path / "dict.json", 2, None, seed=0)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no conversation"):
        sharegpt_requests(tokenizer, tmp_path / "empty.json", 2, None, seed=0)


# ---- reporting --------------------------------------------------------------------------


def test_percentiles_of_known_data():
    summary = summarize("x_ms", range(1, 11), [50, 90, 99])
    # Linear interpolation between closest ranks: p90 sits at rank 0.9 * 9 = 8.1.
    assert summary["mean_x_ms"] == pytest.approx(5.5)
    assert summary["median_x_ms"] == pytest.approx(5.5)
    assert summary["p50_x_ms"] == pytest.approx(5.5)
    assert summary["p90_x_ms"] == pytest.approx(9.1)
    assert summary["p99_x_ms"] == pytest.approx(9.91)
    assert summary["std_x_ms"] == pytest.approx(math.sqrt(8.25))
    odd = summarize("y", [7.0, 1.0, 4.0], [100, 25])
    assert odd["median_y"] == 4.0 and odd["p100_y"] == 7.0 and odd["p25_y"] == 2.5
    assert set(summarize("z", [], [99]).values()) == {0.0}


def test_percentile_flag_parsing_and_table():
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("abc", "0", "100.5", "90,"):
        with pytest.raises(ValueError, match="metric_percentiles"):
            parse_percentiles(bad)
    table = format_table("Result", [("Requests", 3), ("Section", None), ("Rate (tok/s)", 1.234)])
    lines = table.splitlines()
    assert "Result" in lines[0] and lines[-1] == "=" * len(lines[0])
    assert lines[1].startswith("Requests:") and lines[1].endswith(" 3")
    assert lines[2].strip("-") == "Section"
    assert lines[3].endswith("1.23")


# ---- transformers peer -----------------------------------------------------------------


def test_peer_left_pads_and_credits_each_request(tiny_model):
    from ringllm.tools import peer_transformers

    ids, mask = peer_transformers.left_padded([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    args = peer_transformers.build_parser().parse_args(
        ["--model", str(tiny_model), "--dtype", "float32", "--num-prompts", "3",
         "--input-len", "6", "--output-len", "4", "--range-ratio", "0.5", "--batch-size", "2"]
    )  # fmt: skip
    result = peer_transformers.run_peer(args)
    # The same dataset module and seed as the engine's run: the same requests.
    expected = random_requests(Tokenizer.from_folder(tiny_model), 3, 6, 4, 0.5, seed=0)
    assert result["total_input_tokens"] == sum(r.prompt_len for r in expected)
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in expected)
    # Static batches run to their longest request: rows 0-1 together, then row 2 alone.
    padded = 2 * max(r.expected_output_len for r in expected[:2]) + expected[2].expected_output_len
    assert result["generated_tokens_with_padding"] == padded
    assert math.isclose(
        result["output_tokens_per_second"], result["total_output_tokens"] / result["elapsed_time"]
    )


# ---- bench step ---------------------------------------------------------------------------


def test_step_profile_counts_every_layers_calls(tiny_model, tmp_path, capsys):
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--model", str(tiny_model), "--batch-size", "3",
            "--context-len", "5", "--iterations", "2", "--dtype", "float32",
            "--result-json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    layers = json.loads((tiny_model / "config.json").read_text())["num_hidden_layers"]
    calls = result["calls_per_step"]
    assert calls["linear (layers)"] == 4 * layers  # q|k|v, o, gate|up, down
    assert calls["attention"] == calls["rotary_embedding"] == calls["silu_and_mul"] == layers
    assert calls["rms_norm"] == 2 * layers + 1 and calls["lm_head"] == calls["sampler"] == 1
    profile = result["profile_s_per_step"]
    assert all(v >= 0 for k, v in profile.items() if k != "rest")
    assert sum(profile.values()) == pytest.approx(result["profiled_step_mean_s"])
    assert result["dtype"] == "float32" and result["cpu"]["isa"]
    assert "Engine Step Benchmark" in capsys.readouterr().out


def test_step_times_the_whole_batch_when_prompts_take_many_steps(tiny_model, tmp_path):
    """Four 40-token prompts through 16-token steps: the first request decodes while the
    others still prefill, so it needs tokens for those steps too: every request must still
    be decoding in the timed steps (the bench refuses otherwise), none of them prefilling."""
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--model", str(tiny_model), "--batch-size", "4",
            "--context-len", "40", "--iterations", "3", "--dtype", "float32",
            "--max-num-batched-tokens", "16", "--result-json", str(out)]  # fmt: skip
    assert run_cli(argv) == 0
    result = json.loads(out.read_text())
    assert result["prefill_steps"] >= 4 * 40 // 16
    assert result["calls_per_step"]["sampler"] == 1


def test_step_refuses_an_empty_workload(tiny_model):
    with pytest.raises(ValueError, match="at least 1"):
        run_cli(["bench", "step", "--model", str(tiny_model), "--batch-size", "0"])


def test_every_listed_module_registers_its_command_through_add_command():
    """The registry: each name in COMMAND_MODULES is a `ringllm bench NAME` whose func is
    the runner its module handed to add_command, and whose description is its docstring."""
    import importlib

    from ringllm.tools.bench.commands import COMMAND_MODULES

    subparsers = bench_parser()._subparsers._group_actions[0].choices["bench"]
    choices = subparsers._subparsers._group_actions[0].choices
    assert list(choices) == [name.replace("_", "-") for name in COMMAND_MODULES]
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"ringllm.tools.bench.{name}")
        name = name.replace("_", "-")
        parser = choices[name]
        assert parser.prog.endswith(f"bench {name}")
        assert parser.get_default("func").__module__ == module.__name__
        if parser.description is not None:
            assert parser.description == module.__doc__


def test_add_command_sets_the_runner_and_keeps_the_description_as_written():
    import argparse

    from ringllm.tools.bench.commands import add_command

    def run(args):
        return 7

    top = argparse.ArgumentParser(prog="ringllm bench")
    sub = top.add_subparsers(dest="bench_command", required=True)
    parser = add_command(sub, "demo", help="a demo", description="line one\n  line two", run=run)
    parser.add_argument("--count", type=int, default=1)
    args = top.parse_args(["demo", "--count", "3"])
    assert args.func(args) == 7 and args.count == 3
    assert "line one\n  line two" in parser.format_help()
