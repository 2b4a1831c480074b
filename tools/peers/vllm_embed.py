"""vLLM's CPU build embedding texts, for `ringllm bench embed` (its peer side).

Run with the vLLM venv's python (../shared/peers/setup.sh makes it), not ringllm's:

    ~/.cache/ringllm-peers/vllm/bin/python tools/peers/vllm_embed.py MODEL

Loads MODEL as a pooling model in float32, prints `RINGLLM-PEER ready`, then for each line
on stdin (a JSON file of texts) embeds the texts in one `LLM.embed` call, writes the vectors
beside the file (`.npy`) and prints `RINGLLM-PEER <seconds the call took>`. Ends at EOF.
"""

import json
import os
import sys
import time

import numpy as np

MARK = "RINGLLM-PEER"  # vLLM logs to stdout too: the answers carry this mark


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    try:
        llm = LLM(model=sys.argv[1], runner="pooling", dtype="float32")
    except TypeError:  # an older vLLM: the task spelling
        llm = LLM(model=sys.argv[1], task="embed", dtype="float32")
    llm.embed(["warm up"], use_tqdm=False)
    print(MARK, "ready", flush=True)
    for line in sys.stdin:
        path = line.strip()
        texts = json.loads(open(path).read())
        start = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        seconds = time.perf_counter() - start
        np.save(path + ".npy", np.array([o.outputs.embedding for o in outs], np.float32))
        print(MARK, seconds, flush=True)


if __name__ == "__main__":
    main()
