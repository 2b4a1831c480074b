"""`ringllm bench llamacpp-greedy`: the greedy tokens of ringllm and llama-server on one GGUF
file, side by side, and where they part.

    ringllm bench llamacpp-greedy --llama-server ~/peers/llama.cpp/bin/llama-server \\
        --model qwen2.5-coder-1.5b-q4_k_m.gguf [--model ...] [--prompt TEXT ...] \\
        [--max-tokens 64] [--chat]

Each prompt (`--chat`: a user message in the file's chat template) is tokenized once, by
ringllm from the GGUF's own tokenizer, and the same token ids go to both engines, so only
the models are compared (llama-server's /tokenize of the text is asked too: a prompt the
two tokenize differently is reported). Both decode greedily, up to --max-tokens tokens or
an end-of-generation token (compared like any other: EOS is not ignored, since
llama-server's ignore_eos bans those tokens where ringllm's, as vLLM's, only goes past
them), with the top two log-probabilities of every position.

For each prompt: the tokens that agree before the first that differs (all of them: no
parting), and at the parting each engine's gap, the log-probability of its pick less that
of its second choice. Both quantize their activations, each its own way, so a parting where
the two engines rank the same two tokens in opposite order, and the difference of those
two log-probabilities moved by less than --tie-gap (0.5 nats: the two gaps added) from one
engine to the other, is a near tie; any other parting is a drift, the numerics differing
more than rounding explains. After a parting the texts follow different tokens, so nothing
after it is compared.

NOTE: llama-server gives no log-probabilities for a token that ends inside a UTF-8
character (its probabilities come with the text, which waits for the character's last
byte): its picks are read from `tokens`, and its gap at a parting on such a token is unknown.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ringllm.tools.bench.commands import add_command
from ringllm.tools.bench.flags import check_at_least
from ringllm.tools.bench.llamacpp_peer import check_server_files, llama_server
from ringllm.tools.bench.report import (
    add_report_args,
    check_result_json_path,
    format_table,
    machine_info,
    write_report,
)

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
)
REQUEST_TIMEOUT_S = 600.0
MAX_ERROR_CHARS = 300
TOP = 2  # log-probabilities kept per position: the pick and the second choice

# (token id, log-probability) of a position's pick, then of its second choice
Top2 = tuple[tuple[int, float], tuple[int, float]]


@dataclass
class Run:
    """One engine's greedy tokens, with each position's top two where it gave them."""

    picks: list[int]
    top2: list[Top2 | None]


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        bench_subparsers,
        "llamacpp-greedy",
        help="greedy tokens: ringllm against llama-server on the same GGUF files, and where "
        "they part",
        description=__doc__,
        run=run_command,
    )
    parser.add_argument("--llama-server", required=True, metavar="PATH", help="its binary")
    parser.add_argument(
        "--model", action="append", required=True, metavar="FILE", help="a GGUF file (repeat)"
    )
    parser.add_argument(
        "--prompt", action="append", metavar="TEXT", help="a prompt (repeat; default: four)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--chat", action="store_true", help="each prompt a user message in the chat template"
    )
    parser.add_argument("--tie-gap", type=float, default=0.5, metavar="NATS")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    add_report_args(parser)


@dataclass
class Parting:
    """One prompt's comparison (see the module doc)."""

    prompt: str
    prompt_tokens: int
    same_tokenization: bool
    agreed: int  # tokens equal before the first that differs
    compared: int  # tokens each engine decoded
    verdict: str  # "agree", "near tie" or "drift"
    ringllm_pick: int | None = None  # at the parting
    llamacpp_pick: int | None = None
    ringllm_gap: float | None = None
    llamacpp_gap: float | None = None  # None: llama-server gave no log-probabilities there


def compare(
    prompt: str, prompt_tokens: int, same_tokenization: bool, ours: Run, theirs: Run,
    tie_gap: float,
) -> Parting:  # fmt: skip
    """The parting of two greedy runs over the same prompt (see the module doc)."""
    compared = min(len(ours.picks), len(theirs.picks))
    base = dict(
        prompt=prompt, prompt_tokens=prompt_tokens, same_tokenization=same_tokenization,
        compared=compared,
    )  # fmt: skip
    for i in range(compared):
        our_pick, their_pick = ours.picks[i], theirs.picks[i]
        if our_pick == their_pick:
            continue
        our_gap, our_swap = _gap_to(ours.top2[i], their_pick)
        their_gap, their_swap = _gap_to(theirs.top2[i], our_pick)
        tie = our_swap and their_swap and our_gap + their_gap < tie_gap
        return Parting(
            **base, agreed=i, verdict="near tie" if tie else "drift", ringllm_pick=our_pick,
            llamacpp_pick=their_pick, ringllm_gap=our_gap, llamacpp_gap=their_gap,
        )  # fmt: skip
    return Parting(**base, agreed=compared, verdict="agree")


def _gap_to(top2: Top2 | None, other_pick: int) -> tuple[float | None, bool]:
    """An engine's gap at a position, and whether its second choice is the other's pick."""
    if top2 is None:
        return None, False
    (_, lp), (second, lp2) = top2
    return lp - lp2, second == other_pick


def _post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:MAX_ERROR_CHARS]
        raise RuntimeError(f"llama-server {path}: HTTP {exc.code}: {detail}") from None


def llamacpp_greedy(base_url: str, token_ids: list[int], max_tokens: int) -> Run:
    """llama-server's /completion of `token_ids`: greedy (temperature 0)."""
    reply = _post(
        base_url,
        "/completion",
        {
            "prompt": token_ids, "n_predict": max_tokens, "temperature": 0.0,
            "n_probs": TOP, "cache_prompt": False, "return_tokens": True,
        },
    )  # fmt: skip
    return llamacpp_run(reply)


def llamacpp_run(reply: dict[str, Any]) -> Run:
    """A /completion reply's picks (`tokens`) and top two (`completion_probabilities`)."""
    positions = reply.get("completion_probabilities")
    if not positions or len(positions[0].get("top_logprobs", ())) < TOP or "tokens" not in reply:
        raise RuntimeError(
            f"llama-server's /completion gave no tokens or no top-{TOP} log-probabilities (its "
            f"reply has {sorted(reply)}); is it older than the one ../shared/peers/llamacpp.sh "
            "builds?"
        )
    picks = reply["tokens"]
    # one entry per piece of text: a token inside a UTF-8 character has none (module doc)
    entries = iter(positions)
    entry = next(entries, None)
    top2: list[Top2 | None] = []
    for pick in picks:
        if entry is None or entry["id"] != pick:
            top2.append(None)
            continue
        second = next(t for t in entry["top_logprobs"] if t["id"] != pick)
        top2.append(((pick, entry["logprob"]), (second["id"], second["logprob"])))
        entry = next(entries, None)
    return Run(picks, top2)


def llamacpp_tokenize(base_url: str, text: str, chat: bool) -> list[int]:
    """llama-server's ids for `text`: a chat prompt's template wrote its own BOS."""
    body = {"content": text, "add_special": not chat, "parse_special": True}
    return _post(base_url, "/tokenize", body)["tokens"]


def ringllm_greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[Run]:
    from ringllm.pipeline import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    runs = []
    for out in outputs:
        completion = out.outputs[0]
        top2: list[Top2 | None] = []
        for token, position in zip(completion.token_ids, completion.logprobs, strict=True):
            ranked = sorted(position.items(), key=lambda item: -item[1].logprob)
            second = next((tid, lp.logprob) for tid, lp in ranked if tid != token)
            top2.append(((token, position[token].logprob), second))
        runs.append(Run(list(completion.token_ids), top2))
    return runs


def prompt_ids(llm, text: str, chat: bool) -> tuple[list[int], str]:
    """The prompt's token ids by ringllm, and the text they render (for /tokenize)."""
    if chat:
        processed = llm.llm_engine.front_end.chat_prompt([{"role": "user", "content": text}])
        ids = processed.token_ids
        # the template's text, special tokens written out (llama-server parses them back)
        return ids, llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    return llm.get_tokenizer().encode(text, add_special_tokens=True), text


def run_model(args: argparse.Namespace, model: str, workdir: Path) -> list[Parting]:
    from ringllm.pipeline import LLM

    llm = LLM(model)
    try:
        prompts = [prompt_ids(llm, text, args.chat) for text in args.prompt]
        ours = ringllm_greedy(llm, [ids for ids, _ in prompts], args.max_tokens)
    finally:
        llm.shutdown()
    log = workdir / (Path(model).stem + ".llama-server.log")
    with llama_server(
        args.llama_server, model, threads=args.threads, parallel=1, log_path=log
    ) as base_url:
        partings = []
        for text, (ids, rendered), run in zip(args.prompt, prompts, ours, strict=True):
            same = llamacpp_tokenize(base_url, rendered, args.chat) == ids
            theirs = llamacpp_greedy(base_url, ids, args.max_tokens)
            partings.append(compare(text, len(ids), same, run, theirs, args.tie_gap))
    return partings


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "max_tokens": args.max_tokens,
        "chat": args.chat,
        "tie_gap": args.tie_gap,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="ringllm-greedy-") as workdir:
        for model in args.model:
            partings = run_model(args, model, Path(workdir))
            result["models"][Path(model).name] = [asdict(p) for p in partings]
    return result


def _gap(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(result: dict[str, Any]) -> str:
    rows: list[tuple[str, Any]] = [
        ("Tokens decoded", result["max_tokens"]),
        ("Prompts as chat messages", "yes" if result["chat"] else "no"),
    ]
    for model, partings in result["models"].items():
        rows.append((model, None))
        for p in partings:
            where = f"{p['agreed']}/{p['compared']} {p['verdict']}"
            if p["verdict"] != "agree":
                where += f" ({_gap(p['ringllm_gap'])}/{_gap(p['llamacpp_gap'])})"
            if not p["same_tokenization"]:
                where += ", tokenized apart"
            rows.append((p["prompt"][:34], where))
    rows.append(("(gaps at a parting: ringllm / llama.cpp, nats)", ""))
    return format_table("llama.cpp greedy agreement", rows)


def check_args(args: argparse.Namespace) -> None:
    check_at_least(args, [("max_tokens", "token", 1), ("threads", "thread", 1)])
    if not args.tie_gap > 0:
        raise ValueError(f"tie_gap: must be > 0 nats, got {args.tie_gap}")
    check_server_files(args.llama_server, args.model)
    check_result_json_path(args.result_json)


def run_command(args: argparse.Namespace) -> int:
    args.prompt = args.prompt or list(DEFAULT_PROMPTS)
    check_args(args)
    result = run(args)
    write_report(result, table(result), args.result_json)
    return 0
