"""`ringllm serve --headless`: a host that runs worker ranks only, for the engine core on the
head (pipeline/executor/host_agent.py does the work; this is the process's entry, as
engine_core_proc.py is the engine core's)."""

from __future__ import annotations

import signal

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.executor.host_agent import NodeAgent


def run_headless(config: EngineConfig) -> int:
    """`ringllm serve --headless`: this host's ranks for the head's engines, until SIGTERM /
    SIGINT; returns the exit code."""
    agent = NodeAgent(config.parallel)

    def on_signal(signum, frame):
        agent.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(
        f"ringllm serve --headless: host {config.parallel.node_rank} of {config.parallel.nnodes}, "
        f"head at {config.parallel.master_addr}:{config.parallel.master_port}",
        flush=True,
    )
    agent.run()
    return 0
