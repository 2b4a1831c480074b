"""`bench tiers`' printed table: each part's configurations side by side (the result JSON
holds every run; this shows the medians)."""

from __future__ import annotations

from typing import Any

from ringllm.tools.bench.report import format_table, percentile_label
from ringllm.tools.bench.tiers_chat import CHAT_CONFIGS
from ringllm.tools.bench.tiers_preemption import THROUGHPUT_MODES


def tiers_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = []
    if "preemption" in result:
        rows += _preemption_rows(result["preemption"])
    if "throughput" in result:
        rows += _throughput_rows(result["throughput"])
    if "multi_turn" in result:
        rows += _chat_rows(result["multi_turn"])
    return format_table("KV Tiers Benchmark Result", rows)


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def _times(value: float | None) -> Any:
    return "n/a" if value is None else value


def _preemption_rows(part: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for context, entry in part["contexts"].items():
        swap, recompute = entry["swap"], entry["recompute"]
        kv_mb = swap["victim_context_tokens"] * entry["kv_bytes_per_token"] / 1e6
        copy_s = swap["copy_out_s"] + swap["copy_in_s"]
        rows += [
            (f"Preemption at {context} tokens ({kv_mb:.1f} MB of KV)", None),
            ("Time lost per preemption, swap (ms)", _ms(swap["time_lost_s"])),
            ("Time lost per preemption, recompute (ms)", _ms(recompute["time_lost_s"])),
            ("Recompute / swap", _times(entry["recompute_over_swap"])),
            ("Swap: copy out / in (ms)",
             f"{_ms(swap['copy_out_s']):.2f} / {_ms(swap['copy_in_s']):.2f}"),
            ("Swap: copy bandwidth (GB/s)", 2 * kv_mb / 1e3 / copy_s if copy_s else "n/a"),
            ("Decode step, for reference (ms)", _ms(swap["reference_decode_step_s"])),
            ("Victim end to end, swap / recompute (s)",
             f"{swap['victim_e2e_s']:.2f} / {recompute['victim_e2e_s']:.2f}"),
        ]  # fmt: skip
    return rows


def _throughput_rows(part: dict[str, Any]) -> list[tuple[str, Any]]:
    modes = part["modes"]
    rows: list[tuple[str, Any]] = [
        (
            f"Throughput, {part['num_requests']} requests, {part['num_gpu_blocks']} of "
            f"{part['blocks_needed']} blocks",
            None,
        )
    ]
    for mode in THROUGHPUT_MODES:
        m = modes[mode]
        rows += [
            (f"Output tok/s, {mode}", m["output_tok_s"]),
            (
                f"Preemptions / swap-outs, {mode}",
                f"{m['num_preemptions']:.0f} / {m['num_swaps']:.0f}",
            ),
        ]
    rows.append(("Swap / recompute-no-tier (tok/s)", _times(part["swap_over_recompute"])))
    return rows


def _chat_rows(part: dict[str, Any]) -> list[tuple[str, Any]]:
    configs = part["configs"]
    p99 = percentile_label(max(part["percentiles"])) if part["percentiles"] else None
    rows: list[tuple[str, Any]] = [
        (
            f"Multi-turn, {part['num_requests']} turns, "
            f"KV {part['prefix_blocks_over_device']:.1f}x the device",
            None,
        )
    ]
    for name in CHAT_CONFIGS:
        c = configs[name]
        rows += [
            (f"Prefix hit rate, {name} (%)", 100 * c["hit_rate"]),
            (f"Median TTFT, {name} (ms)", c["median_ttft_ms"]),
        ]
        if p99 is not None:
            rows.append((f"{p99.upper()} TTFT, {name} (ms)", c[f"{p99}_ttft_ms"]))
        rows.append((f"Median TTFT speedup over none, {name}", _times(c["ttft_speedup"])))
        if "device_hit_tokens" in c:
            rows.append(
                (
                    f"Hit tokens device / host / disk, {name}",
                    f"{c['device_hit_tokens']:.0f}/{c['host_hit_tokens']:.0f}/"
                    f"{c['disk_hit_tokens']:.0f}",
                )
            )
        else:  # KV groups: a tier's hits are one group's blocks
            rows.append(
                (
                    f"Group blocks hit in host / disk, {name}",
                    f"{c['host_hit_blocks']:.0f}/{c['disk_hit_blocks']:.0f}",
                )
            )
    return rows
