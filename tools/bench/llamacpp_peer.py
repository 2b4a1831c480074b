"""llama.cpp's binaries as ringllm's peers: `llama-bench` run and read, `llama-server` served.

    run_llama_bench(path, "model.gguf", threads=2, prompt_len=32, output_len=128)
        -> {"prefill_tok_s", "decode_tok_s", "threads", "build", "model"}
    with llama_server(path, "model.gguf", threads=2, parallel=16) as base_url:
        ...  # `bench serve --base-url base_url`: llama-server speaks the OpenAI API

llama-bench runs `-m FILE -t T -p P -n N -r 1 -o json`: one pp test (a P-token prompt,
n_gen 0) and one tg test (N tokens generated from an empty context, n_prompt 0), each
with its `avg_ts` in tok/s; `bench llamacpp` repeats it once per round.

llama-server takes one context of `-c` tokens and splits it over its `-np` slots (one
slot per concurrent request), so a slot of `slot_tokens` means `-c parallel * slot_tokens`
(the default, 1024, is the vLLM peer's --max-model-len). It binds 127.0.0.1 on a free
port, writes its log to `log_path` (or a temporary file), and is ready when GET /health
answers 200; a server that exits first, or is not ready in `startup_timeout_s`, is an
error quoting its log's tail. On leaving, SIGTERM, then SIGKILL after `stop_timeout_s`.
What it needs from the client (`serve_backends.HttpBackend` does all of it):
`/v1/completions` with `"stream": true`, a prompt of token ids, `ignore_eos`, and the
`usage` of its last chunk; the datasets need the model's tokenizer (`--tokenizer`: an HF
folder of the same vocabulary, until ringllm's reads the GGUF's own).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LLAMA_BENCH_TIMEOUT_S = 1800.0
MAX_ERROR_CHARS = 200
DEFAULT_SLOT_TOKENS = 1024
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 2000


# ---- llama-bench ----------------------------------------------------------------------


def llama_bench_command(
    path: str, model: str, threads: int, prompt_len: int, output_len: int
) -> list[str]:
    return [
        str(path), "-m", str(model), "-t", str(threads),
        "-p", str(prompt_len), "-n", str(output_len), "-r", "1", "-o", "json",
    ]  # fmt: skip


def parse_llama_bench(text: str, prompt_len: int, output_len: int) -> dict[str, Any]:
    """llama-bench's `-o json` (a list of tests) -> prefill / decode tok/s and its build."""
    try:
        tests = json.loads(text)
    except ValueError as exc:
        raise ValueError(
            f"llama-bench printed no JSON ({exc}): {text[:MAX_ERROR_CHARS]!r}"
        ) from None
    prefill = [t for t in tests if t.get("n_prompt") == prompt_len and not t.get("n_gen")]
    decode = [t for t in tests if t.get("n_gen") == output_len and not t.get("n_prompt")]
    if not prefill or not decode:
        raise ValueError(
            f"llama-bench JSON has no pp{prompt_len} and tg{output_len} tests: "
            f"{[(t.get('n_prompt'), t.get('n_gen')) for t in tests]}"
        )
    first = tests[0]
    return {
        "prefill_tok_s": float(prefill[0]["avg_ts"]),
        "decode_tok_s": float(decode[0]["avg_ts"]),
        "threads": first.get("n_threads"),
        "build": {k: first.get(k) for k in ("build_commit", "build_number", "cpu_info")},
        "model": {k: first.get(k) for k in ("model_type", "model_size", "model_n_params")},
    }


def run_llama_bench(
    path: str, model: str, threads: int, prompt_len: int, output_len: int
) -> dict[str, Any]:
    """One llama-bench run of `model`; its figures, or an error with its last words."""
    if Path(model).is_dir():
        raise ValueError(f"{model} is a folder: llama.cpp runs GGUF files")
    command = llama_bench_command(path, model, threads, prompt_len, output_len)
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=LLAMA_BENCH_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        raise RuntimeError(f"llama-bench exited {done.returncode}: {' | '.join(tail)}")
    return parse_llama_bench(done.stdout, prompt_len, output_len)


# ---- llama-server ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_server_files(llama_server: str, models: list[str]) -> None:
    """A llama-server bench's files, before anything starts: the binary and GGUF models."""
    if not Path(llama_server).is_file():
        raise ValueError(f"llama_server: {llama_server} is not a file (llamacpp.sh builds it)")
    for model in models:
        if not Path(model).is_file() or not model.endswith(".gguf"):
            raise ValueError(f"model: {model} is not a .gguf file")


def llama_server_command(
    path: str, model: str, *, threads: int, parallel: int, slot_tokens: int, port: int
) -> list[str]:
    return [
        str(path), "-m", str(model), "-t", str(threads), "-np", str(parallel),
        "-c", str(parallel * slot_tokens), "--host", "127.0.0.1", "--port", str(port),
        "--no-webui",
    ]  # fmt: skip


def _log_tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"llama-server exited {proc.returncode} before it was ready:\n{_log_tail(log_path)}"
            )
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet, or 503 while the model loads
        time.sleep(0.25)
    raise RuntimeError(f"llama-server was not ready after {timeout_s:g} s:\n{_log_tail(log_path)}")


@contextlib.contextmanager
def llama_server(
    path: str,
    model: str,
    *,
    threads: int,
    parallel: int,
    slot_tokens: int = DEFAULT_SLOT_TOKENS,
    log_path: str | Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> Iterator[str]:
    """Runs llama-server for the `with` block; yields its base URL (see the module doc)."""
    for name, value in (("threads", threads), ("parallel", parallel), ("slot_tokens", slot_tokens)):
        if value < 1:
            raise ValueError(f"llama_server {name}: must be >= 1, got {value}")
    if not Path(path).is_file():
        raise ValueError(
            f"llama_server: {path} is not a file (../shared/peers/llamacpp.sh builds it)"
        )
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    if log_path is None:
        fd, log_path = tempfile.mkstemp(suffix=".llama-server.log")
        os.close(fd)
    log = Path(log_path)
    command = llama_server_command(
        path, model, threads=threads, parallel=parallel, slot_tokens=slot_tokens, port=port
    )
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, base_url, log, startup_timeout_s)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
