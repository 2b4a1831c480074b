"""`ringllm bench tiers` on a tiny random llama: every part runs, its result is complete and
consistent (the configurations all there, one preemption per scenario run, swaps only in
swap mode, hits only with a tier behind the device, each turn's hit its previous prompt),
the disk tier's folder is gone after, and bad flags fail first. The step attribution is
checked on hand-made steps. Behaviour only, never timings."""

from __future__ import annotations

import argparse
import io
import json
import math
from contextlib import redirect_stdout

import pytest

from ringllm.tools.bench import commands as bench
from ringllm.tools.bench.datasets.multi_turn import multi_turn_prompt_len
from ringllm.tools.bench.tiers_preemption import StepRecord, attribute_steps

BLOCK = 16
NUM_ITERS = 2
CONTEXTS = (40, 64)  # one mid-block (preempted after some decode steps), one block-aligned
CHAT = {"conversations": 4, "turns": 3, "prefix_len": 48, "user_len": 16, "output_len": 4}


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringllm")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "tiers", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def tiny_model(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """The whole benchmark once, every part; (result, printed table, disk parent folder)."""
    folder = tmp_path_factory.mktemp("bench_tiers")
    disk_parent = folder / "disk"
    disk_parent.mkdir()
    out = folder / "tiers.json"
    argv = [
        "--model", str(tiny_model), "--dtype", "float32", "--block-size", str(BLOCK),
        "--num-iters", str(NUM_ITERS), "--contexts", ",".join(map(str, CONTEXTS)),
        "--decode-steps", "3", "--throughput-requests", "6", "--throughput-input-len", "32",
        "--throughput-output-len", "96", "--multi-turn-conversations", str(CHAT["conversations"]),
        "--multi-turn-turns", str(CHAT["turns"]),
        "--multi-turn-prefix-len", str(CHAT["prefix_len"]),
        "--multi-turn-user-len", str(CHAT["user_len"]),
        "--multi-turn-output-len", str(CHAT["output_len"]),
        # a host tier of 0.01 GiB holds the whole chat; 10 blocks in front of the disk do not
        "--swap-space", "0.01", "--disk-swap-space", "0.00008", "--kv-offload-max-gib", "0.01",
        "--kv-offload-dir", str(disk_parent), "--result-json", str(out),
    ]  # fmt: skip
    printed = io.StringIO()
    with redirect_stdout(printed):
        assert run_cli(argv) == 0
    return json.loads(out.read_text()), printed.getvalue(), disk_parent


def test_preemption_runs_preempt_once_and_swap_only_in_swap_mode(run):
    result, table, _ = run
    part = result["preemption"]["contexts"]
    assert sorted(part) == sorted(str(c) for c in CONTEXTS)
    for context, entry in part.items():
        blocks = -(-int(context) // BLOCK)
        assert entry["num_gpu_blocks"] == 2 * blocks  # the two prompts, nothing more
        for mode in ("swap", "recompute"):
            runs = entry[mode]["runs"]
            assert len(runs) == NUM_ITERS
            for r in runs:
                assert r["num_preemptions"] == 1
                assert r["num_swaps"] == (1 if mode == "swap" else 0)
                assert r["resume_steps"] == 1  # a swap-in, or one prefill (the budget fits it)
                # preempted when both cross the block boundary after the prompt
                assert r["victim_context_tokens"] == blocks * BLOCK + 1
                assert math.isfinite(r["time_lost_s"])
                assert math.isclose(
                    r["time_lost_s"], r["preempt_step_excess_s"] + r["resume_excess_s"]
                )
                assert r["reference_decode_step_s"] > 0
                assert 0 < r["victim_e2e_s"] <= r["elapsed_s"]
                if mode == "swap":
                    assert r["copy_out_s"] > 0 and r["copy_in_s"] > 0
                else:
                    assert r["copy_out_s"] == r["copy_in_s"] == 0
        assert entry["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers x k,v x heads x dim x f32
    assert f"Preemption at {CONTEXTS[0]} tokens" in table


def test_throughput_preempts_in_every_mode_and_swaps_in_swap_mode(run):
    result, table, _ = run
    part = result["throughput"]
    per_request = -(-(32 + 96) // BLOCK)
    assert part["blocks_needed"] == 6 * per_request
    assert part["num_gpu_blocks"] == 2 * 6 * per_request // 5  # 40% of what they need
    assert set(part["modes"]) == {"swap", "recompute", "recompute-no-tier"}
    for mode, summary in part["modes"].items():
        assert len(summary["runs"]) == NUM_ITERS
        for r in summary["runs"]:
            assert r["output_tokens"] == 6 * 96  # EOS ignored: every token made
            assert r["num_preemptions"] > 0
            assert r["num_recomputes"] == r["num_preemptions"] - r["num_swaps"]
            if mode == "swap":
                assert r["num_swaps"] > 0 and r["blocks_to_host"] > 0
            else:
                assert r["num_swaps"] == 0
            if mode == "recompute-no-tier":
                assert r["copy_calls"] == 0
            assert math.isclose(r["output_tok_s"], r["output_tokens"] / r["elapsed_s"])
    assert "Output tok/s, recompute-no-tier" in table


def test_multi_turn_hits_only_with_a_tier_and_each_turn_finds_its_history(run):
    result, table, disk_parent = run
    part = result["multi_turn"]
    n, turns = CHAT["conversations"], CHAT["turns"]
    shape = (CHAT["prefix_len"], CHAT["user_len"], CHAT["output_len"])
    assert part["num_requests"] == n * turns
    assert part["prompt_lens"] == [multi_turn_prompt_len(*shape, t) for t in range(turns)]
    assert part["prefix_blocks_over_device"] > 1  # the conversations outgrow the device
    configs = part["configs"]
    assert set(configs) == {"none", "host", "host+disk"}
    for name, summary in configs.items():
        for r in summary["runs"]:
            assert len(r["ttfts_ms"]) == n * turns and all(t > 0 for t in r["ttfts_ms"])
            assert len(r["median_ttft_ms_by_turn"]) == turns
            assert r["prompt_tokens"] == n * sum(part["prompt_lens"])
            assert r["cached_tokens"] == sum(r["cached_tokens_per_request"])
            hits = r["device_hit_tokens"] + r["host_hit_tokens"] + r["disk_hit_tokens"]
            assert hits == r["cached_tokens"], name  # the core's counts match the outputs'
            assert r["cached_tokens_per_request"][:n] == [0] * n  # first turns: nothing
            if name == "none":
                assert r["host_hit_tokens"] == r["disk_hit_tokens"] == 0
            if name == "host":
                # the host tier holds everything: each turn finds its previous prompt's blocks
                for i, cached in enumerate(r["cached_tokens_per_request"][n:]):
                    previous = part["prompt_lens"][i // n]
                    assert cached == previous // BLOCK * BLOCK
                assert r["disk_hit_tokens"] == 0
            if name == "host+disk":
                assert r["disk_hit_tokens"] > 0 and r["blocks_to_disk"] > 0
    rates = {name: configs[name]["hit_rate"] for name in configs}
    assert rates["none"] < rates["host"] and rates["none"] < rates["host+disk"]
    assert configs["none"]["ttft_speedup"] == 1.0
    assert "Prefix hit rate, host+disk (%)" in table
    assert list(disk_parent.iterdir()) == []  # the disk tier's temporary folder is gone


def test_result_says_what_produced_it(run):
    result, _, _ = run
    assert result["parts"] == ["preemption", "throughput", "multi-turn"]
    assert result["config"]["workload"]["num_iters"] == NUM_ITERS
    assert result["config"]["engine"]["cache"]["block_size"] == BLOCK
    assert result["machine_before"]["cpu_isa"] and result["machine_after"]["cpu_count"]


def _steps(rows):
    return [StepRecord(*row) for row in rows]


def test_attribution_of_a_swap_on_hand_made_steps():
    # (seconds, victim status, victim tokens, preemptions, swaps, copy seconds)
    steps = _steps([
        (1.0, "RUNNING", 1, 0, 0, 0.0),  # both prefill
        (0.2, "RUNNING", 2, 0, 0, 0.0),
        (0.35, "SWAPPED", 2, 1, 1, 0.05),  # A decodes, B swapped out
        (0.1, "SWAPPED", 2, 0, 0, 0.0),  # A alone ...
        (0.1, "SWAPPED", 2, 0, 0, 0.0),
        (0.12, "SWAPPED", 2, 0, 0, 0.0),  # ... A finishes
        (0.3, "RUNNING", 3, 0, 0, 0.04),  # B swapped in, decodes
        (0.2, "RUNNING", 4, 0, 0, 0.0),  # B alone
        (0.2, None, 5, 0, 0, 0.0),
    ])  # fmt: skip
    got = attribute_steps(steps)
    assert math.isclose(got["preempt_step_excess_s"], 0.35 - 0.1)
    assert math.isclose(got["resume_excess_s"], 0.3 - 0.2)
    assert math.isclose(got["time_lost_s"], 0.25 + 0.1)
    assert got["resume_steps"] == 1 and got["num_swaps"] == 1
    assert math.isclose(got["copy_out_s"], 0.05) and math.isclose(got["copy_in_s"], 0.04)
    assert got["victim_tokens_at_preemption"] == 2


def test_attribution_of_a_chunked_recompute_counts_every_prefill_step():
    steps = _steps([
        (1.0, "RUNNING", 1, 0, 0, 0.0),
        (0.1, "PREEMPTED", 1, 1, 0, 0.0),
        (0.1, "PREEMPTED", 1, 0, 0, 0.0),
        (0.1, "PREEMPTED", 1, 0, 0, 0.0),
        (0.6, "RUNNING", 1, 0, 0, 0.0),  # first chunk of the recompute: no token yet
        (0.5, "RUNNING", 2, 0, 0, 0.0),  # last chunk, and the token
        (0.1, "RUNNING", 3, 0, 0, 0.0),
        (0.1, None, 4, 0, 0, 0.0),
    ])  # fmt: skip
    got = attribute_steps(steps)
    assert got["resume_steps"] == 2
    assert math.isclose(got["resume_excess_s"], 0.6 + 0.5 - 0.1)
    assert math.isclose(got["preempt_step_excess_s"], 0.0, abs_tol=1e-12)


def test_attribution_refuses_a_run_that_did_not_preempt_once():
    rows = [(0.1, "RUNNING", 1, 0, 0, 0.0), (0.1, None, 2, 0, 0, 0.0)]
    with pytest.raises(RuntimeError, match="exactly 1 preemption, the engine made 0"):
        attribute_steps(_steps(rows))


def test_multi_turn_needs_the_prefix_cache(tiny_model):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        run_cli(["--model", str(tiny_model), "--parts", "multi-turn", "--no-enable-prefix-caching"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--parts", "preemption,speed"), "parts"),
        (("--contexts", "500,x"), "contexts"),
        (("--contexts", "0"), "contexts"),
        (("--num-iters", "0"), "num_iters"),
        (("--decode-steps", "0"), "decode_steps"),
        (("--swap-space", "0"), "swap_space"),
        (("--kv-offload-max-gib", "0"), "kv_offload_max_gib"),
        (("--kv-offload-dir", "/nonexistent/folder"), "kv_offload_dir"),
        (("--max-concurrency", "5", "--multi-turn-conversations", "4"), "max_concurrency"),
        (("--multi-turn-gpu-blocks", "0"), "multi_turn_gpu_blocks"),
        (("--tensor-parallel-size", "2"), "tensor_parallel_size"),
    ],
)
def test_bad_flags_fail_before_an_engine_is_built(flags, message):
    with pytest.raises(ValueError, match=message):
        run_cli(["--model", "/nonexistent", *flags])
