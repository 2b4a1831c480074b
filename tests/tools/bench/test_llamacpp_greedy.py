"""`ringllm bench llamacpp-greedy`: where two greedy runs part, llama-server's replies read,
and a whole run against a stand-in llama-server (the real one takes ten minutes to build;
its reply shapes here are the ones it gave on the demo and Qwen files, 2026-12-03)."""

from __future__ import annotations

import argparse
import json
import stat
import sys

import pytest

from ringllm.tools.bench import llamacpp_greedy as greedy
from ringllm.tools.bench.llamacpp_greedy import Run, compare, llamacpp_run
from ringllm.tools.make_gguf import make_gguf


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ringllm")
    subparsers = parser.add_subparsers(dest="command", required=True)
    bench_subparsers = subparsers.add_parser("bench").add_subparsers(dest="bench_command")
    greedy.add_parser(bench_subparsers)
    return parser.parse_args(["bench", "llamacpp-greedy", *argv])


def run(picks, gaps, seconds=None) -> Run:
    """A run whose pick at i has log-probability -0.1 and its second -0.1 - gaps[i]."""
    seconds = seconds or [p + 1 for p in picks]
    return Run(
        list(picks),
        [((p, -0.1), (s, -0.1 - g)) for p, s, g in zip(picks, seconds, gaps, strict=True)],
    )


def test_runs_that_never_part_agree_over_the_shorter():
    ours, theirs = run([1, 2, 3], [1, 1, 1]), run([1, 2], [1, 1])
    parting = compare("p", 4, True, ours, theirs, 0.5)
    assert (parting.agreed, parting.compared, parting.verdict) == (2, 2, "agree")
    assert parting.ringllm_gap is None


def test_two_tokens_ranked_apart_by_less_than_the_tie_gap_are_a_near_tie():
    ours = run([1, 7, 3], [1.0, 0.2, 1.0], seconds=[9, 8, 9])  # we: 7, then 8
    theirs = run([1, 8, 3], [1.0, 0.25, 1.0], seconds=[9, 7, 9])  # they: 8, then 7
    parting = compare("p", 4, True, ours, theirs, 0.5)
    assert (parting.agreed, parting.verdict) == (1, "near tie")
    assert (parting.ringllm_pick, parting.llamacpp_pick) == (7, 8)
    assert parting.ringllm_gap == pytest.approx(0.2) and parting.llamacpp_gap == pytest.approx(0.25)
    # the same swap, but the two gaps add up past the tie gap: the numerics drifted
    assert compare("p", 4, True, ours, theirs, 0.4).verdict == "drift"


def test_a_parting_where_the_other_pick_is_not_second_or_unknown_is_a_drift():
    ours = run([1, 7], [1.0, 0.01], seconds=[9, 5])  # our second is neither engine's pick
    theirs = run([1, 8], [1.0, 0.01], seconds=[9, 7])
    assert compare("p", 4, True, ours, theirs, 0.5).verdict == "drift"
    blind = Run([1, 8], [theirs.top2[0], None])  # llama-server gave no probabilities there
    parting = compare("p", 4, True, run([1, 7], [1.0, 0.01], seconds=[9, 8]), blind, 0.5)
    assert parting.verdict == "drift" and parting.llamacpp_gap is None


def entry(token, logprob, *top):
    return {"id": token, "logprob": logprob, "top_logprobs": [
        {"id": t, "logprob": lp} for t, lp in top]}  # fmt: skip


def test_a_token_inside_a_utf8_character_has_no_probabilities_from_llama_server():
    """Qwen on "The three laws of thermodynamics are": ': ①' is 25, 220, then 48312 and
    254 for the character; llama-server's probabilities skip 48312."""
    reply = {
        "tokens": [25, 220, 48312, 254],
        "completion_probabilities": [
            entry(25, -1.469, (25, -1.469), (510, -1.954)),
            entry(220, -1.729, (220, -1.729), (279, -1.929)),
            entry(254, -0.001, (254, -0.001), (112, -7.569)),
        ],
    }
    got = llamacpp_run(reply)
    assert got.picks == [25, 220, 48312, 254]
    assert got.top2[2] is None
    assert got.top2[3] == ((254, -0.001), (112, -7.569))
    assert got.top2[1] == ((220, -1.729), (279, -1.929))


def test_the_second_choice_is_the_best_other_token_even_when_the_pick_is_not_first():
    got = llamacpp_run(
        {"tokens": [5], "completion_probabilities": [entry(5, -2.0, (9, -1.0), (5, -2.0))]}
    )
    assert got.top2 == [((5, -2.0), (9, -1.0))]


def test_a_reply_without_probabilities_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no tokens or no top-2 log-probabilities"):
        llamacpp_run({"tokens": [1, 2], "content": "ab"})


FAKE_SERVER = """#!{python}
import http.server, json, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open({log!r}, "a") as log:
            log.write(json.dumps({{"path": self.path, "body": body}}) + "\\n")
        reply = json.load(open({replies!r}))[self.path]
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_whole_run_sends_ringllms_ids_and_reports_the_parting(model_factory, tmp_path):
    """ringllm's side runs a tiny GGUF; the stand-in llama-server answers with ringllm's own
    first pick and then a token ringllm did not pick, so the parting is at 1."""
    from ringllm.pipeline import LLM

    folder = model_factory("llama", rope_scaling="none")  # a GGUF carries no rope scaling
    model = str(make_gguf(folder, tmp_path / "tiny.gguf", "q8_0"))
    prompt = "hello world"
    with LLM(model) as llm:
        ids = llm.get_tokenizer().encode(prompt, add_special_tokens=True)
        (ours,) = greedy.ringllm_greedy(llm, [ids], 4)
    other = next(t for t in range(50, 60) if t != ours.picks[1])
    replies = {
        "/tokenize": {"tokens": ids},
        "/completion": {
            "tokens": [ours.picks[0], other],
            "completion_probabilities": [
                entry(ours.picks[0], -0.5, (ours.picks[0], -0.5), (3, -1.5)),
                entry(other, -0.1, (other, -0.1), (4, -9.0)),
            ],
        },
    }
    (tmp_path / "replies.json").write_text(json.dumps(replies))
    log = tmp_path / "requests.jsonl"
    script = tmp_path / "llama-server"
    script.write_text(
        FAKE_SERVER.format(
            python=sys.executable, log=str(log), replies=str(tmp_path / "replies.json")
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "r.json"
    args = parse(
        ["--llama-server", str(script), "--model", model, "--prompt", prompt, "--max-tokens", "4",
         "--result-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    (parting,) = json.loads(out.read_text())["models"]["tiny.gguf"]
    assert parting["same_tokenization"] and parting["prompt_tokens"] == len(ids)
    assert (parting["agreed"], parting["compared"], parting["verdict"]) == (1, 2, "drift")
    assert parting["llamacpp_pick"] == other and parting["llamacpp_gap"] == pytest.approx(8.9)
    requests = [json.loads(line) for line in log.read_text().splitlines()]
    completion = next(r["body"] for r in requests if r["path"] == "/completion")
    assert completion["prompt"] == ids and completion["n_predict"] == 4
    assert completion["temperature"] == 0.0 and completion["n_probs"] == 2
    assert "ignore_eos" not in completion  # llama-server's bans end-of-generation tokens


def test_bad_flags_are_refused_before_anything_runs(tmp_path):
    args = parse(["--llama-server", str(tmp_path / "none"), "--model", "x.gguf"])
    with pytest.raises(ValueError, match="llama_server: .* is not a file"):
        args.func(args)
    args = parse(["--llama-server", sys.executable, "--model", "x.gguf", "--max-tokens", "0"])
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        args.func(args)
