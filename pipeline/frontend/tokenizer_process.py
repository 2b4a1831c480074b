"""`TokenizerProcess`: long texts tokenized in a child process, so the front end's event
loop never waits on the GIL for them.

Why a process: `tokenizers` releases the GIL while `encode_batch` runs, but not while it
turns the result into Python (`.ids`: 0.15 s for 7.5 M tokens) nor while it frees it
(0.6 s: the Rust `Encoding` holds a string and offsets per token). Measured on a 12 MB
prompt (7.5 M tokens), a worker thread still froze the event loop for 0.6 s at a time; the
child process costs the loop nothing but a pipe write and, for a prompt that fits the
context, one int32 array read back. A text past the context comes back as its count only.

    parent (any thread)                       child (python -m ...tokenizer_process FOLDER)
      lock; write REQUEST + UTF-8 text  ─────>  Tokenizer.from_folder(FOLDER).encode(text)
      read REPLY + int32 ids            <─────  ids if count <= most, else the count only

Frames (little endian): REQUEST = text bytes (u64) | most (i64) | add_special_tokens (u8);
REPLY = status (u8) | count (i64) | payload bytes (u64), payload the ids (int32) or, for
status ERROR, the message in UTF-8. One request at a time per process (the lock); the
child ends at EOF on its stdin (so when its parent dies); a child that died is started
again on next use.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
from array import array
from pathlib import Path

# Texts shorter than this are tokenized in the caller's thread: below it the GIL pauses
# of doing so stay under ~15 ms (measured: 13 ms at 256 K characters, 66 ms at 1 M).
OFFLOAD_CHARS = 1 << 18
_REQUEST = struct.Struct("<QqB")
_REPLY = struct.Struct("<BqQ")
IDS, TOO_MANY, ERROR = 0, 1, 2
_READY = b"ready\n"


class TokenizerProcess:
    def __init__(self, folder: str | Path) -> None:
        self.folder = str(folder)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._closed = False

    def encode(
        self, text: str, add_special_tokens: bool, most: int
    ) -> tuple[int, list[int] | None]:
        """(token count, ids), ids None when the count is past `most`. ValueError for what
        the tokenizer refuses; RuntimeError when the child cannot serve (it is restarted
        on the next call)."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"prompt: not valid text ({exc.reason} at {exc.start})") from None
        with self._lock:
            if self._closed:
                raise RuntimeError("the tokenizer process was shut down")
            proc = self._proc if self._proc and self._proc.poll() is None else self._start()
            try:
                _write_all(proc.stdin.fileno(), _REQUEST.pack(len(data), most, add_special_tokens))
                _write_all(proc.stdin.fileno(), data)
                status, count, size = _REPLY.unpack(_read_exact(proc.stdout.fileno(), _REPLY.size))
                payload = _read_exact(proc.stdout.fileno(), size)
            except (OSError, EOFError) as exc:
                self._stop()
                raise RuntimeError(f"the tokenizer process failed ({exc})") from exc
        if status == ERROR:
            raise ValueError(payload.decode("utf-8", "replace"))
        if status == TOO_MANY:
            return count, None
        ids = array("i")
        ids.frombytes(payload)
        return count, ids.tolist()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stop()

    def _start(self) -> subprocess.Popen:
        self._stop()
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringllm.pipeline.frontend.tokenizer_process", self.folder],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            ready = _read_exact(proc.stdout.fileno(), len(_READY))
        except EOFError:
            ready = b""
        if ready != _READY:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the tokenizer process did not start (exit code {proc.returncode})")
        self._proc = proc
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            proc.wait(5)  # EOF on its stdin ends it
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 22))
        if not chunk:
            raise EOFError("the peer closed the pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _serve(folder: str) -> None:
    from ringllm.pipeline.frontend.tokenizer import Tokenizer

    # NOTE: not die_with_parent(): PR_SET_PDEATHSIG fires when the *thread* that started
    # this process exits, and any worker thread of the front end may start it. EOF on
    # stdin ends it instead (the parent alone holds the pipe's other end), and a reply
    # written to a parent that is gone ends it too (EPIPE). Ctrl-C in a terminal reaches
    # the whole process group: the parent decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tokenizer = Tokenizer.from_folder(folder)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    _write_all(stdout, _READY)
    while True:
        try:
            size, most, add_special_tokens = _REQUEST.unpack(_read_exact(stdin, _REQUEST.size))
            text = _read_exact(stdin, size).decode("utf-8")
        except EOFError:
            return
        try:
            ids = tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
        except Exception as exc:  # the Rust side raises plain Exceptions
            message = f"prompt: the tokenizer refused the text ({exc})".encode()
            _write_all(stdout, _REPLY.pack(ERROR, 0, len(message)) + message)
            continue
        if len(ids) > most:
            _write_all(stdout, _REPLY.pack(TOO_MANY, len(ids), 0))
        else:
            payload = array("i", ids).tobytes()
            _write_all(stdout, _REPLY.pack(IDS, len(ids), len(payload)))
            _write_all(stdout, payload)
        del ids  # freed here, where no event loop waits on this GIL


if __name__ == "__main__":
    _serve(sys.argv[1])
