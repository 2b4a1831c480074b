"""The tokenizer process: the same ids as the in-process tokenizer, the count only past the
limit, clear errors, a child that died is started again, and none is left after close."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import tok_fixtures as tf

from ringllm.pipeline.frontend.tokenizer import Tokenizer
from ringllm.pipeline.frontend.tokenizer_process import OFFLOAD_CHARS, TokenizerProcess

_PIECE = " ".join(tf.CORPUS) + " Zürich 龍飛鳳舞 🦄 "
LONG = _PIECE * (OFFLOAD_CHARS // len(_PIECE) + 1)  # just past the offload size


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    tok = tf.byte_fallback_bpe()
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    return tf.write_hf_folder(tmp_path_factory.mktemp("llama"), tok, config)


@pytest.fixture
def process(llama_dir):
    proc = TokenizerProcess(llama_dir)
    yield proc
    proc.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_same_ids_as_the_tokenizer_and_count_only_past_the_limit(process, llama_dir):
    assert len(LONG) > OFFLOAD_CHARS
    tokenizer = Tokenizer.from_folder(llama_dir)
    for add_special in (True, False):
        expected = tokenizer.encode(LONG, add_special_tokens=add_special)
        assert process.encode(LONG, add_special, len(expected)) == (len(expected), expected)
        assert process.encode(LONG, add_special, len(expected) - 1) == (len(expected), None)
    assert process.encode("a", True, 10) == (2, tokenizer.encode("a"))


def test_text_that_is_not_text_is_a_value_error(process):
    with pytest.raises(ValueError, match="not valid text"):
        process.encode("a\ud800b", True, 100)
    assert process.encode("ok", False, 100)[0] > 0  # and it still serves


def test_a_dead_child_is_started_again(process):
    process.encode("warm", True, 100)
    first = process._proc.pid
    os.kill(first, signal.SIGKILL)
    process._proc.wait()
    assert process.encode("again", True, 100)[1] is not None
    second = process._proc.pid
    assert second != first
    # one that dies mid-request fails that request only
    killer = threading.Timer(0.2, os.kill, (second, signal.SIGKILL))
    killer.start()
    with pytest.raises(RuntimeError, match="tokenizer process failed"):
        process.encode(LONG * 16, True, 10)  # ~1 s of work
    killer.join()
    assert process.encode("and again", True, 100)[1] is not None


def test_it_ends_when_its_parent_does(llama_dir, tmp_path):
    script = (
        "import sys; from ringllm.pipeline.frontend.tokenizer_process import TokenizerProcess\n"
        f"p = TokenizerProcess({str(llama_dir)!r}); p.encode('x', True, 9)\n"
        "print(p._proc.pid, flush=True); import os; os._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_threads_share_it_and_close_leaves_nothing(llama_dir):
    proc = TokenizerProcess(llama_dir)
    results: list = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(proc.encode(LONG[i:], True, 10**9)))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(ids is not None and len(ids) == n for n, ids in results)
    pid = proc._proc.pid
    proc.close()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    with pytest.raises(RuntimeError, match="shut down"):
        proc.encode("x", True, 10)
