"""`bench pp`'s printed table: each configuration's medians, then its stages (the result
JSON holds every run and every counter)."""

from __future__ import annotations

from typing import Any

from ringllm.tools.bench.report import format_table


def pp_table(result: dict[str, Any]) -> str:
    workload = result["config"]["workload"]
    baseline = result["baseline"]
    rows: list[tuple[str, Any]] = [
        ("Prompts x input -> output tokens",
         f"{workload['num_prompts']} x {workload['input_len']} -> {workload['output_len']}"),
        ("Timed rounds (TTFT requests each)",
         f"{workload['num_iters']} ({workload['ttft_requests']})"),
    ]  # fmt: skip
    for name, summary in result["configs"].items():
        rows += _config_rows(name, summary, baseline)
    table = format_table("Pipeline Parallel Benchmark Result", rows)
    if any(summary["stages"] for summary in result["configs"].values()):
        table += f"\nbubble = {result['bubble_definition']} (the share of the run not computing)"
    return table


def _config_rows(name: str, summary: dict[str, Any], baseline: str) -> list[tuple[str, Any]]:
    partition = ",".join(str(n) for n in summary["layer_partition"])
    rows: list[tuple[str, Any]] = [
        (f"{name} ({summary['pipeline_parallel_size']} stage(s): {partition} layers)", None),
        ("Output token throughput (tok/s)", summary["output_tok_s"]),
        ("Median TTFT, one request (ms)", summary["median_ttft_ms"]),
        ("Median engine TTFT (ms)", summary["median_engine_ttft_ms"]),
    ]
    if name != baseline:
        rows += [
            (f"Throughput over {baseline}", summary["speedup_over_baseline"]),
            (f"TTFT over {baseline}", summary["ttft_over_baseline"]),
        ]
    for stage in summary["stages"]:
        k = stage["stage"]
        rows += [
            (f"Stage {k} layers [{stage['start_layer']}, {stage['end_layer']}): steps/run",
             stage["steps_per_run"]),
            (f"Stage {k} ms/step (compute)",
             f"{stage['step_ms']:.2f} ({stage['compute_ms_per_step']:.2f})"),
            (f"Stage {k} wait recv / send / ring (ms/step)",
             f"{stage['recv_wait_ms_per_step']:.2f} / {stage['send_wait_ms_per_step']:.2f} / "
             f"{stage['ring_wait_ms_per_step']:.2f}"),
            (f"Stage {k} sent per step (KiB)", stage["sent_kib_per_step"]),
            (f"Stage {k} bubble (%)",
             "n/a" if stage["bubble"] is None else 100 * stage["bubble"]),
        ]  # fmt: skip
    return rows
