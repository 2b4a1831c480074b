"""`ringllm bench embed`: embeddings per second, ringllm against sentence-transformers
(and vLLM's CPU build with `--vllm-python`), on the same texts, the engines alternated.

    ringllm                 LLM.embed(texts): one call, the engine batches them
    sentence-transformers   SentenceTransformer(model).encode(texts, batch_size=B)
    vllm                    tools/peers/vllm_embed.py in the peer's interpreter (optional)

The texts: `--num-texts` of `--words` words each, drawn (seeded) from the model's own
vocabulary (its vocab.txt; else random lowercase words). Per engine and round: texts/s and
prompt tokens/s (ringllm's count); and the largest cosine distance between ringllm's
vectors and each peer's. Every engine is loaded before the rounds; a round times only the
embedding call.

`--mixed N` measures instead what embeddings cost generation on one engine (any model
that pools and generates: a decoder with `--pooler-config`): per round, N greedy requests
(`--input-len` random ids, `--output-len` tokens, EOS ignored) alone, the texts' embeddings
alone, then both in one `LLM.generate` call (pooling and generation requests in the same
batches). Reported: the three times, and the mixed time against the sum of the two alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.report import (
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

PEER_SCRIPT = Path(__file__).resolve().parents[1] / "peers" / "vllm_embed.py"
PEER_MARK = "RINGLLM-PEER "


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "embed",
        help="embeddings per second against sentence-transformers (and vLLM)",
        description=__doc__,
        run=run_embed_command,
    )
    parser.add_argument("--model", required=True, help="an embedding model's folder")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--words", type=int, default=24, help="words per text")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers'")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm-python", default=None, help="the vLLM peer's python (../shared/peers/setup.sh)"
    )
    parser.add_argument("--result-json", default=None)
    parser.add_argument(
        "--mixed", type=int, default=0, metavar="N",
        help="instead: N generation requests alone, the embeddings alone, and both together",
    )  # fmt: skip
    parser.add_argument("--input-len", type=int, default=32, help="--mixed: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="--mixed: output tokens")
    parser.add_argument(
        "--pooler-config", default=None, help="--mixed: the model's pooling (a decoder's)"
    )


def make_texts(model: Path, count: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    vocab_file = model / "vocab.txt"
    if vocab_file.is_file():
        vocab = [w for w in vocab_file.read_text().split() if w.isalpha() and w.islower()]
    else:
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        vocab = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(3, 9, 2000)]
    picks = rng.integers(0, len(vocab), size=(count, words))
    return [" ".join(vocab[i] for i in row) for row in picks]


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    from ringllm.pipeline import LLM, SamplingParams

    check_result_json_path(args.result_json)
    model = Path(args.model).expanduser()
    texts = make_texts(model, args.num_texts, args.words, args.seed)
    llm = LLM(str(model), pooler_config=args.pooler_config)
    pooler = llm.llm_engine.front_end.pooler_config
    if pooler is None:
        raise SystemExit("--mixed: the model does not pool; give --pooler-config")
    rng = np.random.default_rng(args.seed)
    vocab = llm.llm_engine.vocab_size
    gen = [
        {"prompt_token_ids": rng.integers(100, vocab - 1, args.input_len).tolist()}
        for _ in range(args.mixed)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    pool = SamplingParams(
        max_tokens=1, pooling_type=pooler.pooling_type, pooling_normalize=pooler.normalize
    )
    result: dict[str, Any] = {"machine_before": machine_info(), "rounds": []}
    llm.generate(gen[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
    try:
        for _ in range(args.rounds):
            row = {}
            for name, prompts, params in (
                ("generation_s", gen, greedy),
                ("embeddings_s", texts, pool),
                ("mixed_s", gen + texts, [greedy] * len(gen) + [pool] * len(texts)),
            ):
                llm.llm_engine.reset_prefix_cache()  # no phase reuses another's prompts
                started = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                row[name] = time.perf_counter() - started
            result["rounds"].append(row)
    finally:
        llm.shutdown()
    result["num_texts"], result["num_generations"] = len(texts), len(gen)
    result["machine_after"] = machine_info()
    return result


def mixed_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("generation requests / texts", f"{result['num_generations']} / {result['num_texts']}")
    ]
    for i, r in enumerate(result["rounds"]):
        alone = r["generation_s"] + r["embeddings_s"]
        rows.append((f"Round {i}", None))
        rows.append(("generation alone (s)", f"{r['generation_s']:.2f}"))
        rows.append(("embeddings alone (s)", f"{r['embeddings_s']:.2f}"))
        rows.append(("both in one call (s)", f"{r['mixed_s']:.2f}"))
        rows.append(("both / the sum alone", f"{r['mixed_s'] / alone:.2f}"))
    return format_table("Embeddings Beside Generation", rows)


def run_embed(args: argparse.Namespace) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from ringllm.pipeline import LLM

    for name in ("num_texts", "words", "rounds", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be >= 1")
    check_result_json_path(args.result_json)
    model = Path(args.model).expanduser()
    texts = make_texts(model, args.num_texts, args.words, args.seed)
    result: dict[str, Any] = {"machine_before": machine_info(), "rounds": []}
    llm = LLM(str(model))
    st = SentenceTransformer(str(model), device="cpu")
    llm.embed(texts[:4], use_tqdm=False)  # warm
    st.encode(texts[:4])
    peer = _Peer(args.vllm_python, model) if args.vllm_python else None
    try:
        for _ in range(args.rounds):
            row: dict[str, Any] = {}
            started = time.perf_counter()
            outs = llm.embed(texts, use_tqdm=False)
            row["ringllm_s"] = time.perf_counter() - started
            ours = np.array([o.outputs.embedding for o in outs])
            num_tokens = sum(len(o.prompt_token_ids) for o in outs)
            started = time.perf_counter()
            theirs = st.encode(texts, batch_size=args.batch_size)
            row["st_s"] = time.perf_counter() - started
            row["st_max_cos_distance"] = _max_distance(ours, theirs)
            if peer is not None:
                row["vllm_s"], vectors = peer.embed(texts)
                row["vllm_max_cos_distance"] = _max_distance(ours, vectors)
            row["num_tokens"] = num_tokens
            result["rounds"].append(row)
    finally:
        llm.shutdown()
        if peer is not None:
            peer.close()
    result["num_texts"] = len(texts)
    result["machine_after"] = machine_info()
    return result


def _max_distance(a: np.ndarray, b: np.ndarray) -> float:
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(1.0 - cos.min())


class _Peer:
    """vLLM in its own interpreter: texts in (a JSON file), (seconds, vectors) out."""

    def __init__(self, python: str, model: Path) -> None:
        self.dir = tempfile.TemporaryDirectory()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        self.proc = subprocess.Popen(
            [python, str(PEER_SCRIPT), str(model)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        if self._answer() != "ready":
            self.close()
            raise RuntimeError("the vLLM peer did not start (its output is above)")

    def _answer(self) -> str:
        """The peer's next marked line (its other output is vLLM's logs)."""
        for line in self.proc.stdout:
            if line.startswith(PEER_MARK):
                return line[len(PEER_MARK) :].strip()
            sys.stderr.write(line)
        return ""

    def embed(self, texts: list[str]) -> tuple[float, np.ndarray]:
        path = Path(self.dir.name) / "texts.json"
        path.write_text(json.dumps(texts))
        self.proc.stdin.write(str(path) + "\n")
        self.proc.stdin.flush()
        seconds = float(self._answer())
        return seconds, np.load(str(path) + ".npy")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.dir.cleanup()


def embed_table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [("texts per round", result["num_texts"])]
    for i, r in enumerate(result["rounds"]):
        n = result["num_texts"]
        rows.append((f"Round {i}", None))
        rows.append(("prompt tokens (ringllm's count)", r["num_tokens"]))
        rows.append(("ringllm texts/s", f"{n / r['ringllm_s']:.1f}"))
        rows.append(("sentence-transformers texts/s", f"{n / r['st_s']:.1f}"))
        rows.append(("ringllm / sentence-transformers", f"{r['st_s'] / r['ringllm_s']:.2f}x"))
        rows.append(("largest cosine distance vs s-t", f"{r['st_max_cos_distance']:.2e}"))
        if "vllm_s" in r:
            rows.append(("vLLM texts/s", f"{n / r['vllm_s']:.1f}"))
            rows.append(("ringllm / vLLM", f"{r['vllm_s'] / r['ringllm_s']:.2f}x"))
            rows.append(("largest cosine distance vs vLLM", f"{r['vllm_max_cos_distance']:.2e}"))
    return format_table("Embedding Benchmark", rows)


def run_embed_command(args: argparse.Namespace) -> int:
    if args.mixed:
        result = run_mixed(args)
        write_report(result, mixed_table(result), args.result_json)
        return 0
    result = run_embed(args)
    write_report(result, embed_table(result), args.result_json)
    sys.stdout.flush()
    return 0
