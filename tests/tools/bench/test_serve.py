"""`ringllm bench serve` against a real `ringllm serve` process, over HTTP and over IPC.

One server (tiny random llama, engine core in its own process, so it has an IPC
instance name) serves every test of this module. Behaviour only, never timings: the
checks are counts, exact output lengths (ignore_eos), keys, and consistency between the
numbers; the maths is checked on hand-made results with hand-computed answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ringllm.tools.bench import commands as bench
from ringllm.tools.bench.plots import concurrency_steps, output_tokens_per_s
from ringllm.tools.bench.report import parse_percentiles
from ringllm.tools.bench.serve import (
    arrival_offsets_s,
    metric_values_ms,
    serve_result,
    serve_table,
)
from ringllm.tools.bench.serve_backends import Clock, HttpBackend, RequestFailed, RequestResult

MAX_MODEL_LEN = 256
API_KEY = "bench-key-93a1"
STARTUP_TIMEOUT_S = 120
CLI_TIMEOUT_S = 120
URL_LINE = re.compile(r"listening on (http://[\d.]+:\d+)")
INSTANCE_LINE = re.compile(r"engine IPC instance (\S+)")
METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p50", "p90", "p99")
PER_REQUEST_LISTS = ("input_lens", "output_lens", "ttfts", "itls", "errors")


class Served:
    def __init__(self, url: str, instance: str, model_path: Path) -> None:
        self.url, self.instance, self.model_path = url, instance, model_path

    @property
    def http(self) -> list[str]:
        # The API names the model by its folder's name, never its path (a path is not the
        # client's business), so the bench is told where the vocabulary is.
        return ["--base-url", self.url, "--api-key", API_KEY, "--tokenizer", str(self.model_path)]


@pytest.fixture(scope="module")
def served(model_factory, tmp_path_factory):
    """`ringllm serve` (the same code via `python -m`) on a free port; stopped with SIGTERM."""
    model_path = model_factory("llama")
    log_path = tmp_path_factory.mktemp("bench_serve") / "server.log"
    command = [
        sys.executable, "-m", "ringllm.server.cli", str(model_path), "--port", "0",
        "--engine-process", "--api-key", API_KEY, "--dtype", "float32", f"--max-model-len={MAX_MODEL_LEN}",
        "--max-num-seqs", "16", "--num-gpu-blocks-override", "512",
    ]  # fmt: skip
    yield from serve_until_done(command, model_path, log_path)


def serve_until_done(command: list[str], model_path, log_path: Path):
    """A fixture's body: `command` (a `ringllm serve`) started, its `Served` yielded, then
    SIGTERM and a clean exit asserted (its log's tail when it is not)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        url, instance = _wait_for_lines(proc, log_path)
        yield Served(url, instance, model_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            returncode = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert returncode == 0, log_path.read_text(errors="replace")[-3000:]


def _wait_for_lines(proc: subprocess.Popen, log_path: Path) -> tuple[str, str]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        text = log_path.read_text(errors="replace")
        url, instance = URL_LINE.search(text), INSTANCE_LINE.search(text)
        if url and instance:
            return url.group(1), instance.group(1)
        time.sleep(0.1)
    raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')}")


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringllm")
    bench.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "serve", "--disable-tqdm", *argv])
    return args.func(args)


def load_workload(num_prompts: int) -> list[str]:
    """Random prompts of 8..24 tokens, outputs of 2..6 tokens (range ratio 0.5)."""
    return [
        "--num-prompts", str(num_prompts), "--input-len", "16", "--output-len", "4",
        "--range-ratio", "0.5", "--ignore-eos", "--metric-percentiles", "50,90,99",
    ]  # fmt: skip


def check_complete_result(result: dict, num_prompts: int) -> None:
    assert result["completed"] == num_prompts and result["failed"] == 0
    assert result["errors"] == [""] * num_prompts
    for key in PER_REQUEST_LISTS:
        assert len(result[key]) == num_prompts, key
    for metric in METRICS:
        for stat in STATS:
            assert f"{stat}_{metric}_ms" in result, f"{stat}_{metric}_ms"
    # ignore_eos: exactly the asked-for length, counted by the engine (usage / token ids)
    assert result["output_lens"] == result["expected_output_lens"]
    assert len(set(result["output_lens"])) > 1, "range ratio 0.5 should vary the lengths"
    assert all(8 <= n <= 24 for n in result["input_lens"])
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])
    duration = result["duration"]
    assert math.isclose(result["request_throughput"], num_prompts / duration)
    assert math.isclose(result["output_throughput"], result["total_output_tokens"] / duration)
    total = result["total_input_tokens"] + result["total_output_tokens"]
    assert math.isclose(result["total_token_throughput"], total / duration)
    for ttft, e2el, itls, n_out in zip(
        result["ttfts"], result["e2els"], result["itls"], result["output_lens"], strict=True
    ):
        assert 0 < ttft <= e2el
        assert 1 <= len(itls) + 1 <= n_out  # one chunk per step, or fewer when merged
        assert ttft + sum(itls) <= e2el + 1e-9


def test_http_run_gives_a_complete_result_json(served, tmp_path, capsys):
    out = tmp_path / "http.json"
    argv = [*served.http, "--max-concurrency", "3", "--result-json", str(out)]
    assert run_cli(argv + load_workload(8)) == 0
    result = json.loads(out.read_text())
    check_complete_result(result, 8)
    # --model defaulted to the first of /v1/models: the folder's name
    assert result["model_id"] == served.model_path.name
    assert result["backend"] == "http" and result["max_concurrency"] == 3
    assert 1 <= result["peak_concurrency"] <= 3
    printed = capsys.readouterr().out
    assert re.search(r"Successful requests:\s+8\n", printed)
    assert re.search(r"Failed requests:\s+0\n", printed)
    assert "P99 TTFT (ms)" in printed


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_chat_apis_count_tokens_from_usage(served, tmp_path, endpoint):
    """The chat endpoint and the Responses and Messages APIs (their own stream events)."""
    out = tmp_path / "chat.json"
    argv = [*served.http, "--endpoint", endpoint]
    assert run_cli(argv + ["--result-json", str(out)] + load_workload(3)) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 3, result.get("errors")
    assert result["output_lens"] == result["expected_output_lens"]
    assert all(itls for itls in result["itls"])  # a chunk per streamed delta, timed


def run_cli_process(argv: list[str], tmp_path: Path) -> tuple[dict, str]:
    """The `ringllm` console script in a child process (the IPC client's shared memory,
    and multiprocessing's resource tracker with it, then live and die there)."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "ringllm.tools.cli", "bench", "serve", "--disable-tqdm"]
    command += ["--result-json", str(out), *argv]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_ipc_run_round_robin(served, tmp_path):
    instances = f"{served.instance},{served.instance}"  # two clients, round-robin
    argv = ["--ipc", instances, "--request-rate", "200"]
    result, printed = run_cli_process(argv + ["--burstiness", "0.5"] + load_workload(6), tmp_path)
    check_complete_result(result, 6)
    assert result["backend"] == "ipc" and result["request_rate"] == 200
    assert result["model_id"] == str(served.model_path)
    assert re.search(r"Successful requests:\s+6\n", printed)


def test_plots_are_written(served, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib (the bench extra) is not installed")
    plots = tmp_path / "plots"
    assert run_cli([*served.http, "--plot", str(plots)] + load_workload(3)) == 0
    printed = capsys.readouterr().out
    for name in ("latency_cdf.png", "output_throughput.png", "concurrency.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"plot: {plots / name}\n" in printed


def test_plot_without_matplotlib_is_a_clear_error_before_the_run(monkeypatch):
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    with pytest.raises(ValueError, match="--plot needs matplotlib.*pip install"):
        run_cli(["--base-url", "http://127.0.0.1:9", "--plot", "plots"])


def test_wrong_model_name_fails_every_request_with_its_error(served, tmp_path, capsys):
    out = tmp_path / "wrong.json"
    argv = [*served.http, "--model", "no-such-model"]
    argv += ["--tokenizer", str(served.model_path), "--result-json", str(out)]
    assert run_cli(argv + load_workload(3)) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 0 and result["failed"] == 3
    assert all(e.startswith("HTTP 404:") and "no-such-model" in e for e in result["errors"])
    assert result["total_output_tokens"] == 0
    assert "3 x HTTP 404:" in capsys.readouterr().out


def test_api_key_is_sent_and_a_wrong_one_is_reported(served, tmp_path):
    workload = load_workload(2)
    with pytest.raises(ValueError, match="answered 401"):  # model discovery, before any load
        run_cli(["--base-url", served.url, "--api-key", "wrong"] + workload)
    out = tmp_path / "unauthorized.json"
    argv = ["--base-url", served.url, "--model", "m", "--tokenizer", str(served.model_path)]
    assert run_cli(argv + ["--result-json", str(out)] + workload) == 0
    result = json.loads(out.read_text())
    assert result["failed"] == 2 and all(e.startswith("HTTP 401:") for e in result["errors"])


@pytest.mark.parametrize("transport", ["http", "ipc"])
def test_prompts_over_the_context_are_counted_as_failed(served, transport, tmp_path):
    """Prompts of 216..264 tokens (outputs 3..5) against max_model_len 256. A prompt of
    256 or more can never run: failed, with the engine's message naming the limit. A
    request that fits whole runs to its exact length. One in between (the prompt fits,
    prompt + max_tokens does not) either fails the same way (vLLM's HTTP policy) or runs
    with its output capped to what is left of the context: never anything else."""
    target = served.http if transport == "http" else ["--ipc", served.instance]
    workload = ["--num-prompts", "12", "--input-len", "240", "--range-ratio", "0.1"]
    workload += ["--output-len", "4", "--ignore-eos", "--seed", "3"]
    result, printed = run_cli_process(target + workload, tmp_path)
    lists = ("input_lens", "expected_output_lens", "output_lens", "errors")
    rows = list(zip(*(result[k] for k in lists), strict=True))
    assert any(n_in >= MAX_MODEL_LEN for n_in, *_ in rows), "seed 3 should give one too long"
    assert any(n_in + n_asked <= MAX_MODEL_LEN for n_in, n_asked, *_ in rows)
    for n_in, n_asked, n_out, error in rows:
        if error:
            assert str(MAX_MODEL_LEN) in error and n_out == 0, error
            assert n_in + n_asked > MAX_MODEL_LEN, error
            assert error.startswith("HTTP 400:") if transport == "http" else True
        else:
            assert n_in < MAX_MODEL_LEN and n_out == min(n_asked, MAX_MODEL_LEN - n_in)
    num_failed = sum(1 for *_, error in rows if error)
    assert (result["completed"], result["failed"]) == (12 - num_failed, num_failed)
    assert result["total_output_tokens"] == sum(result["output_lens"])
    shown = sum(int(n) for n in re.findall(r"^  (\d+) x ", printed, flags=re.MULTILINE))
    assert shown == num_failed  # every failure shown, grouped by message


class FakeStream:
    """An aiohttp response body: `async for line in response.content`."""

    def __init__(self, lines: list[bytes]) -> None:
        self.content = self._lines(lines)

    @staticmethod
    async def _lines(lines: list[bytes]):
        for line in lines:
            yield line


def sse(payload: dict | str) -> list[bytes]:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return [b"data: " + data.encode() + b"\n", b"\n"]


def parse_stream(lines: list[bytes], chat: bool = False) -> RequestResult:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    args = argparse.Namespace(
        base_url="http://unused", endpoint=endpoint, model="m", tokenizer=None, api_key=None,
        temperature=0.0, ignore_eos=False, request_timeout=1.0,
    )  # fmt: skip
    backend, result = HttpBackend(args), RequestResult(7, 3)

    async def go():
        try:
            await backend._read_stream(FakeStream(lines), result, Clock())
        except RequestFailed as exc:
            result.error = str(exc)

    asyncio.run(go())
    return result


def completion_chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": None}


def test_sse_chunks_without_usage_are_counted():
    lines = [b": keep-alive comment\n"]
    for text in ("a", "b", ""):  # an empty-text chunk is still a token (held-back bytes)
        lines += sse(completion_chunk(text))
    result = parse_stream(lines + sse("[DONE]"))
    assert result.success and result.output_len == 3 and len(result.chunk_times_s) == 3
    assert result.prompt_len == 7  # the dataset's, with no usage to correct it


def test_sse_usage_overrides_the_chunk_count():
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
    lines = sse(completion_chunk("ab")) + sse(completion_chunk("c", "length")) + sse(usage)
    result = parse_stream(lines + sse("[DONE]"))
    assert result.success and (result.output_len, result.prompt_len) == (4, 9)
    assert len(result.chunk_times_s) == 2  # the empty-choices usage chunk is no token


def test_sse_chat_role_chunk_is_no_token():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    result = parse_stream(sse(role) + sse(token) + sse("[DONE]"), chat=True)
    assert result.success and result.output_len == 1


def test_sse_error_event_and_cut_stream_are_failures():
    error = {"error": {"message": "engine is dead", "type": "server_error"}}
    result = parse_stream(sse(completion_chunk("a")) + sse(error) + sse("[DONE]"))
    assert result.error == "error in stream: engine is dead"
    result = parse_stream(sse(completion_chunk("a")))
    assert "ended without [DONE] after 1 chunks" in result.error


# ---- arrivals --------------------------------------------------------------------------


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrivals_have_the_mean_rate_and_gamma_variance(burstiness):
    rate = 20.0
    gaps_s = np.diff(arrival_offsets_s(40001, rate, burstiness, seed=7))
    # Gamma(k, 1/(rate k)): mean 1/rate whatever k; squared CV = 1/k. With 40000 draws the
    # sample mean is within ~1% (k=0.25: 2 sigma) and the CV^2 within ~10%: 5% and 25% bounds.
    assert gaps_s.mean() == pytest.approx(1 / rate, rel=0.05)
    cv2 = gaps_s.var() / gaps_s.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.25)


def test_arrivals_infinite_rate_and_bad_values():
    assert not arrival_offsets_s(5, math.inf, 1.0, seed=0).any()
    offsets = arrival_offsets_s(5, 3.0, 1.0, seed=0)
    assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    np.testing.assert_array_equal(offsets, arrival_offsets_s(5, 3.0, 1.0, seed=0))
    with pytest.raises(ValueError, match="request_rate"):
        arrival_offsets_s(5, 0.0, 1.0, seed=0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets_s(5, 1.0, -1.0, seed=0)


def test_bad_flags_fail_before_connecting():
    # the URL is never contacted: the flags are checked first
    base = ["--base-url", "http://127.0.0.1:9", "--num-prompts", "2"]
    with pytest.raises(ValueError, match="max_concurrency"):
        run_cli(base + ["--max-concurrency", "0"])
    with pytest.raises(ValueError, match="percentile_metrics"):
        run_cli(base + ["--percentile-metrics", "ttft,latency"])
    with pytest.raises(ValueError, match="metric_percentiles"):
        run_cli(base + ["--metric-percentiles", "0"])


# ---- metrics on known data ---------------------------------------------------------------


def known_results() -> list[RequestResult]:
    def made(start, chunks, end, tokens, error=""):
        r = RequestResult(10, tokens, start_s=start, end_s=end, output_len=tokens, error=error)
        r.chunk_times_s, r.chunk_tokens = list(chunks), [1] * len(chunks)
        return r

    return [
        made(0.0, [0.1, 0.3, 0.6], 0.6, 3),  # ttft 100, itl 200 300, tpot 250, e2el 600
        made(0.5, [], 1.1, 0, error="HTTP 400: too long"),  # failed: in no latency metric
        made(1.0, [1.2, 1.3], 1.4, 2),  # ttft 200, itl 100, tpot (400-200)/1 = 200, e2el 400
        made(2.0, [2.05], 2.05, 1),  # ttft 50, no tpot (one token), e2el 50
    ]


def test_metrics_on_known_data():
    results = known_results()
    result = serve_result(results, 2.0, parse_percentiles("50,90"), METRICS)
    assert (result["completed"], result["failed"]) == (3, 1)
    assert result["total_input_tokens"] == 30 and result["total_output_tokens"] == 6
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(3.0)
    assert result["total_token_throughput"] == pytest.approx(18.0)
    expected = {
        # ttft [50, 100, 200]: p90 by linear interpolation at rank 1.8 = 100 + 0.8 * 100
        "ttft": dict(mean=350 / 3, median=100, p50=100, p90=180, std=np.std([50, 100, 200])),
        "tpot": dict(mean=225, median=225, p90=245, std=25),  # [200, 250]
        "itl": dict(mean=200, median=200, p90=280, std=np.std([100, 200, 300])),
        "e2el": dict(mean=350, median=400, p90=560, std=np.std([50, 400, 600])),
    }
    for metric, stats in expected.items():
        for stat, value in stats.items():
            assert result[f"{stat}_{metric}_ms"] == pytest.approx(value), (stat, metric)
    assert result["peak_concurrency"] == 2  # [0, .6) and [.5, 1.1) overlap; [1, 1.4) too
    assert result["errors"] == ["", "HTTP 400: too long", "", ""]
    assert result["itls"][0] == pytest.approx([0.2, 0.3])


def test_table_counts_every_failure_even_past_the_messages_shown():
    results = [RequestResult(5, 2, error=f"HTTP 400: bad {i % 7}") for i in range(20)]
    result = serve_result(results, 1.0, [50.0], ["e2el"])
    result["max_concurrency"] = 4
    table = serve_table(result, ["e2el"])
    assert re.search(r"Failed requests:\s+20\n", table)
    counts = [int(n) for n in re.findall(r"^  (\d+) x ", table, flags=re.MULTILINE)]
    assert counts == [3, 3, 3, 3, 3, 5] and "(2 other messages" in table


def test_table_shows_failures_with_their_message():
    result = serve_result(known_results(), 2.0, [99.0], ["ttft", "e2el"])
    result["max_concurrency"] = None
    table = serve_table(result, ["ttft", "e2el"])
    assert re.search(r"Failed requests:\s+1\n", table)
    assert "1 x HTTP 400: too long" in table
    assert "P99 TTFT (ms)" in table and "TPOT" not in table


def test_plot_series_add_up():
    results = known_results()
    starts_s, tokens_per_s = output_tokens_per_s(results, 2.05, num_bins=5)
    width_s = starts_s[1] - starts_s[0]
    assert (tokens_per_s * width_s).sum() == pytest.approx(6.0)  # the successful tokens
    times_s, in_flight = concurrency_steps(results)
    assert in_flight.max() == 2 and in_flight[-1] == 0
    assert np.all(np.diff(times_s) >= 0)
    assert metric_values_ms(results)["ttft"] == pytest.approx([100, 200, 50])
