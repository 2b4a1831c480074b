"""The `ringllm bench` package: one module per benchmark and what they share.

    commands.py   the registry: `add_command` (how a bench adds `ringllm bench NAME`) and
                  the list of bench modules `ringllm bench` wires
    datasets/     the requests every bench sends, chosen by name (`--dataset`)
    report.py     the writer: percentiles, the printed table, the result JSON
    plots.py      `bench serve --plot`'s PNGs
    throughput.py, latency.py, serve.py, spec.py, step.py, mm.py, tiers.py, pp.py,
    hosts.py, ipc.py, kernels.py, lifecycle.py
                  one bench each; a bench's own helpers sit beside it
                  (serve_backends, pp_stages, pp_table, tiers_chat, tiers_preemption,
                  tiers_table, tier_probes)

Nothing is imported here, so `ringllm.tools.bench.datasets` loads without the benches.
"""
