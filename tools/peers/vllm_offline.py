"""vLLM's CPU build on the offline workload of `ringllm bench throughput`, in any dtype.

Run with the vLLM venv's python (../shared/peers/setup.sh makes it), not ringllm's:

    ~/.cache/ringllm-peers/vllm/bin/python tools/peers/vllm_offline.py MODEL --dtype float32

`--batch` requests of `--input-len` random token ids (seeded) generate `--output-len`
tokens each, greedy, EOS ignored, in one `LLM.generate` call after a short warm-up: the
shape of ../shared/peers/offline.py (which runs bf16 only), with the dtype a flag because
on a CPU without bf16 arithmetic a peer's best dtype is float32. Prints output tokens/s.
"""

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="vLLM's own spelling: auto, fp8..."
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (args.batch, args.input_len), generator=gen).tolist()
    llm = LLM(
        model=args.model, dtype=args.dtype, max_model_len=1024, kv_cache_dtype=args.kv_cache_dtype
    )
    warm = SamplingParams(max_tokens=2)
    llm.generate([{"prompt_token_ids": ids[0][:8]}], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": row} for row in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(
        f"vllm {args.dtype} (KV {args.kv_cache_dtype}): "
        f"{args.batch * args.output_len / seconds:.1f} output tok/s "
        f"(batch {args.batch}, in {args.input_len}, out {args.output_len})"
    )


if __name__ == "__main__":
    main()
