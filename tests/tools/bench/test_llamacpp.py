"""`ringllm bench llamacpp` and `ringllm bench membw`: flags, llama-bench's JSON, the report.

Behaviour only, never timings: llama-bench's side is a recorded output (a real
`llama-bench -o json` run on the demo Q4_1 file, llama_bench_sample.json) replayed by a
stand-in script, and ringllm's side runs a random 2-layer model; the checks are on the
parsed figures, the arithmetic of ratios and bandwidth fractions, and the table's rows.
"""

from __future__ import annotations

import argparse
import json
import math
import stat
from pathlib import Path

import pytest

from ringllm.tools.bench import llamacpp, llamacpp_peer
from ringllm.tools.bench.membw import measure_bandwidth

SAMPLE = Path(__file__).with_name("llama_bench_sample.json")


@pytest.fixture(scope="module")
def tiny_model(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def sample_tests() -> list[dict]:
    return json.loads(SAMPLE.read_text())


def parse(argv: list[str], module=llamacpp, command: str = "llamacpp") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ringllm")
    subparsers = parser.add_subparsers(dest="command", required=True)
    bench_subparsers = subparsers.add_parser("bench").add_subparsers(dest="bench_command")
    module.add_parser(bench_subparsers)
    return parser.parse_args(["bench", command, *argv])


def fake_llama_bench(tmp_path: Path, body: str) -> Path:
    """A stand-in llama-bench: a shell script that records its argv, then runs `body`."""
    script = tmp_path / "llama-bench"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


# ---- flags --------------------------------------------------------------------------


def test_flags_repeat_models_and_default_to_both_engines(tmp_path):
    args = parse(["--model", "a.gguf", "--model", "b.gguf", "--rounds", "2", "--threads", "4"])
    assert args.model == ["a.gguf", "b.gguf"]
    assert (args.rounds, args.threads, args.prompt_len, args.output_len) == (2, 4, 32, 128)
    assert args.engines == "llamacpp,ringllm"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rounds", "0"], "rounds: must be >= 1"),
        (["--engines", "vllm"], "engines:"),
        (["--threads", "0"], "threads: must be >= 1"),
        (["--bandwidth-gbps", "0"], "bandwidth_gbps"),
        (["--engines", "llamacpp,ringllm"], "llama_bench: pass --llama-bench"),
        (["--engines", "llamacpp", "--llama-bench", "/no/such/llama-bench"], "is not a file"),
    ],
)
def test_bad_flags_fail_before_any_model_loads(tiny_model, extra, message):
    args = parse(["--model", str(tiny_model), "--engines", "ringllm", *extra])
    with pytest.raises(ValueError, match=message):
        llamacpp.check_args(args)


def test_a_missing_model_is_named(tmp_path):
    args = parse(["--model", str(tmp_path / "nothing.gguf"), "--engines", "ringllm"])
    with pytest.raises(ValueError, match="nothing.gguf does not exist"):
        llamacpp.check_args(args)


# ---- llama-bench ----------------------------------------------------------------------


def test_llama_bench_json_gives_prefill_and_decode(sample_tests):
    parsed = llamacpp_peer.parse_llama_bench(SAMPLE.read_text(), 32, 128)
    (pp,) = [t for t in sample_tests if t["n_gen"] == 0]
    (tg,) = [t for t in sample_tests if t["n_prompt"] == 0]
    assert parsed["prefill_tok_s"] == pp["avg_ts"]
    assert parsed["decode_tok_s"] == tg["avg_ts"]
    assert parsed["threads"] == pp["n_threads"]
    assert parsed["model"]["model_size"] == pp["model_size"]


def test_llama_bench_json_of_other_lengths_is_refused():
    with pytest.raises(ValueError, match="no pp64 and tg128"):
        llamacpp_peer.parse_llama_bench(SAMPLE.read_text(), 64, 128)
    with pytest.raises(ValueError, match="printed no JSON"):
        llamacpp_peer.parse_llama_bench("main: error: failed to load model", 32, 128)


def test_llama_bench_runs_with_the_engines_flags(tmp_path, sample_tests):
    script = fake_llama_bench(tmp_path, f"cat {SAMPLE}")
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    parsed = llamacpp_peer.run_llama_bench(str(script), str(model), 3, 32, 128)
    assert (tmp_path / "argv").read_text().split() == [
        "-m", str(model), "-t", "3", "-p", "32", "-n", "128", "-r", "1", "-o", "json",
    ]  # fmt: skip
    assert parsed["decode_tok_s"] == sample_tests[1]["avg_ts"]


def test_a_failing_llama_bench_shows_its_last_words(tmp_path):
    script = fake_llama_bench(tmp_path, "echo 'error: unknown model architecture' >&2; exit 1")
    with pytest.raises(RuntimeError, match="exited 1: error: unknown model architecture"):
        llamacpp_peer.run_llama_bench(str(script), str(tmp_path / "x.gguf"), 2, 32, 128)
    with pytest.raises(ValueError, match="llama.cpp runs GGUF files"):
        llamacpp_peer.run_llama_bench(str(script), str(tmp_path), 2, 32, 128)


# ---- weights, ratios, the table ----------------------------------------------------------


def test_bytes_per_token_leave_out_an_untied_embedding(tiny_model):
    import torch
    from safetensors.torch import load_file

    tensors = {}
    for file in Path(tiny_model).glob("*.safetensors"):
        tensors.update(load_file(file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embedding = tensors["model.embed_tokens.weight"]
    counted = llamacpp.weight_bytes(str(tiny_model))
    assert counted["weight_bytes"] == total
    untied = "lm_head.weight" in tensors
    expected = total - embedding.numel() * embedding.element_size() if untied else total
    assert counted["bytes_per_token"] == expected
    assert torch.is_tensor(embedding)


def test_gguf_bytes_are_its_tensors_bytes(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    shapes = {"token_embd.weight": (16, 8), "blk.0.attn_q.weight": (8, 8), "output.weight": (16, 8)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    counted = llamacpp.weight_bytes(str(path))
    assert counted == {"weight_bytes": 4 * (128 + 64 + 128), "bytes_per_token": 4 * (64 + 128)}


def synthetic_entry() -> dict:
    entry = {
        "model": "/m/x.gguf",
        "weight_bytes": 2_000_000_000,
        "bytes_per_token": 1_000_000_000,
        "llamacpp": {"rounds": [{"prefill_tok_s": 100.0, "decode_tok_s": 10.0}] * 2},
        "ringllm": {
            "rounds": [
                {"prefill_tok_s": 250.0, "decode_tok_s": 8.0},
                {"prefill_tok_s": 300.0, "decode_tok_s": 12.0},
            ]
        },
    }
    entry["ratios"] = llamacpp.round_ratios(entry)
    llamacpp.add_bandwidth_fractions(entry, read_gbps=40.0)
    return entry


def test_ratios_are_per_round_and_fractions_use_the_bytes_per_token():
    entry = synthetic_entry()
    assert entry["ratios"] == {"prefill": [2.5, 3.0], "decode": [0.8, 1.2]}
    fractions = [r["decode_bandwidth_fraction"] for r in entry["ringllm"]["rounds"]]
    assert fractions == pytest.approx([8 / 40, 12 / 40])  # 1 GB a token
    assert entry["llamacpp"]["rounds"][0]["decode_gbps"] == pytest.approx(10.0)


def test_the_table_shows_ranges_not_the_best():
    result = {
        "workload": {"rounds": 2, "threads": 2, "prompt_len": 32, "output_len": 128},
        "bandwidth": {"read_gbps": 40.0},
        "models": [synthetic_entry()],
    }
    result["models"][0]["ringllm"]["error"] = "RuntimeError: late"
    table = llamacpp.llamacpp_table(result)
    assert "ringllm prefill (tok/s, min-max):" in table and "250.0-300.0" in table
    assert "llama.cpp decode (tok/s, min-max):" in table
    assert "Decode ringllm / llama.cpp, per round:" in table and "0.80/1.20" in table
    assert "ringllm decode, % of read bandwidth:" in table and "20.0-30.0" in table
    assert "x.gguf, ringllm: RuntimeError: late" in table
    assert llamacpp.value_range([]) == "-" and llamacpp.value_range([3.0, 3.04]) == "3.0"


# ---- whole runs ---------------------------------------------------------------------


def test_side_by_side_on_a_tiny_model(tiny_model, tmp_path, monkeypatch, capsys):
    """ringllm's side really runs; llama.cpp's is the recorded sample (a folder is no
    GGUF for the real one), so the ratios are checked against the numbers it reported."""
    sample = llamacpp_peer.parse_llama_bench(SAMPLE.read_text(), 32, 128)
    calls = []

    def recorded(path, model, threads, prompt_len, output_len):
        calls.append((model, threads, prompt_len, output_len))
        return {**sample, "prefill_tok_s": 100.0, "decode_tok_s": 50.0}

    monkeypatch.setattr(llamacpp, "run_llama_bench", recorded)
    out = tmp_path / "r.json"
    argv = ["--model", str(tiny_model), "--llama-bench", str(SAMPLE), "--rounds", "2",
            "--prompt-len", "8", "--output-len", "16", "--dtype", "float32",
            "--bandwidth-gbps", "10", "--noisy-retries", "0", "--result-json", str(out)]  # fmt: skip
    args = parse(argv)
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    (entry,) = result["models"]
    assert calls == [(str(tiny_model), 2, 8, 16)] * 2
    ours = entry["ringllm"]["rounds"]
    assert len(ours) == 2 and "error" not in entry["ringllm"]
    assert all(r["prefill_tok_s"] > 0 and r["whole_request_s"] > 0 for r in ours)
    assert entry["ratios"]["decode"] == pytest.approx([r["decode_tok_s"] / 50.0 for r in ours])
    assert entry["ratios"]["prefill"] == pytest.approx([r["prefill_tok_s"] / 100.0 for r in ours])
    for r in ours:
        expected = entry["bytes_per_token"] * r["decode_tok_s"] / 10e9
        assert math.isclose(r["decode_bandwidth_fraction"], expected)
    assert entry["ringllm"]["config"]["num_threads"] == 2
    assert all(0.0 <= r["others_cpu_share"] <= 1.0 for r in ours + entry["llamacpp"]["rounds"])
    assert "Side-by-side" in capsys.readouterr().out


def test_a_model_ringllm_cannot_load_is_an_error_in_its_column(tmp_path, monkeypatch):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf at all")
    monkeypatch.setattr(llamacpp, "weight_bytes", lambda model: {"bytes_per_token": 1})
    args = parse(["--model", str(broken), "--engines", "ringllm", "--bandwidth-gbps", "10"])
    entry = llamacpp.run_one_model(args, str(broken), ["ringllm"])
    assert entry["ringllm"]["rounds"] == [] and entry["ringllm"]["error"]
    assert entry["ratios"] == {}


def test_membw_measures_both_passes():
    measured = measure_bandwidth(1, buffer_bytes=8 << 20, repeats=2)
    assert measured["threads"] == 1 and measured["buffer_bytes"] == 8 << 20
    assert measured["read_gbps"] == max(measured["read_passes_gbps"]) > 0
    assert measured["copy_gbps"] == max(measured["copy_passes_gbps"]) > 0


# ---- llama-server -------------------------------------------------------------------

FAKE_SERVER = """#!{python}
import http.server, sys
argv = sys.argv[1:]
open({argv_file!r}, "w").write(" ".join(argv))
port = int(argv[argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_llama_server_is_started_awaited_and_stopped(tmp_path):
    import sys
    import urllib.request

    script = tmp_path / "llama-server"
    script.write_text(FAKE_SERVER.format(python=sys.executable, argv_file=str(tmp_path / "argv")))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with llamacpp_peer.llama_server(str(script), "m.gguf", threads=2, parallel=16) as base_url:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
            assert response.status == 200
        argv = (tmp_path / "argv").read_text().split()
    assert argv[:8] == ["-m", "m.gguf", "-t", "2", "-np", "16", "-c", str(16 * 1024)]
    with pytest.raises(OSError):  # stopped: nothing listens there any more
        urllib.request.urlopen(base_url + "/health", timeout=5)


def test_a_llama_server_that_dies_shows_its_log(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="exited 1 before it was ready:\nerror: failed to load"):
        with llamacpp_peer.llama_server(str(script), "m.gguf", threads=2, parallel=4):
            pass
    with pytest.raises(ValueError, match="parallel: must be >= 1"):
        with llamacpp_peer.llama_server(str(script), "m.gguf", threads=2, parallel=0):
            pass


def test_a_round_with_busy_neighbours_is_rerun(monkeypatch, sample_tests):
    sample = llamacpp_peer.parse_llama_bench(SAMPLE.read_text(), 32, 128)
    shares = iter([0.5, 0.3, 0.05, 0.9, 0.4, 0.7])
    monkeypatch.setattr(llamacpp, "run_llama_bench", lambda *a: dict(sample))
    monkeypatch.setattr(
        llamacpp,
        "measure_with_neighbours",
        lambda work: {**work(), "others_cpu_share": next(shares)},
    )
    args = parse(["--model", "m.gguf", "--noisy-retries", "2"])
    side = {"rounds": []}
    llamacpp.run_side_round(args, "m.gguf", side, "llamacpp", None)
    assert [r["others_cpu_share"] for r in side["noisy_rounds"]] == [0.5, 0.3]
    assert [r["others_cpu_share"] for r in side["rounds"]] == [0.05]
    llamacpp.run_side_round(args, "m.gguf", side, "llamacpp", None)  # three noisy: the quietest
    assert [r["others_cpu_share"] for r in side["rounds"]] == [0.05, 0.4]
    assert len(side["noisy_rounds"]) == 5
    assert side["gguf"]["model_size"] == sample_tests[0]["model_size"]


# ---- llamacpp-serve -----------------------------------------------------------------


def parse_serve(argv: list[str]) -> argparse.Namespace:
    from ringllm.tools.bench import llamacpp_serve

    return parse(argv, llamacpp_serve, "llamacpp-serve")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rounds", "0"], "rounds: must be >= 1"),
        (["--max-concurrency", "0"], "max_concurrency: must be >= 1"),
        (["--llama-server", "/no/such/llama-server"], "is not a file"),
        (["--model", "/no/such.gguf"], "is not a .gguf file"),
    ],
)
def test_serve_side_by_side_refuses_bad_flags(tmp_path, extra, message):
    from ringllm.tools.bench import llamacpp_serve

    server, model = tmp_path / "llama-server", tmp_path / "m.gguf"
    server.write_text("")
    model.write_bytes(b"GGUF")
    args = parse_serve(["--llama-server", str(server), "--model", str(model), *extra])
    with pytest.raises(ValueError, match=message):
        llamacpp_serve.check_args(args)


def test_serve_side_by_side_table_shows_ranges_and_ratios():
    from ringllm.tools.bench import llamacpp_serve

    def side(rate, ttft):
        return {"output_throughput": rate, "median_ttft_ms": ttft, "median_tpot_ms": 50.0}

    rounds = [
        {"llamacpp": side(30.0, 9000.0), "ringllm": side(60.0, 3000.0), "ratio": 2.0},
        {"llamacpp": side(25.0, 11000.0), "ringllm": side(55.0, 2500.0), "ratio": 2.2},
    ]
    config = {"rounds": 2, "num_prompts": 64, "max_concurrency": 16, "input_len": 64,
              "output_len": 32}  # fmt: skip
    text = llamacpp_serve.table(
        {"config": config, "models": [{"model": "m.gguf", "rounds": rounds}]}
    )
    assert "llamacpp output tok/s:" in text and "25.0-30.0" in text
    assert "ringllm median TTFT (ms):" in text and "2500.0-3000.0" in text
    assert text.rstrip().splitlines()[-2].endswith("2.00-2.20")
