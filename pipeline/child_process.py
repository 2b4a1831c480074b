"""What every child process of the engine does first: die with its parent, and (under a
test switch) refuse pickle once started; how its allocator is set (`tune_malloc`); and what
it does once started (`freeze_heap`).

The engine core process and each tensor-parallel rank are started as fresh interpreters
(`python -m ...`), never by forking or by multiprocessing's spawn of the caller's
`__main__`. `die_with_parent` makes the kernel SIGTERM them when the process that started
them dies, so a `kill -9` of a server never leaves an engine or a rank behind.

`start_child` is how they are started: on one thread that lives as long as this process.
The kernel's parent-death signal follows the *thread* that forked a child, not its
process, so a child started from a thread that ends (a supervisor's restart, a caller's
worker thread running `LLM(...)`) would otherwise be killed when that thread returns.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import gc
import os
import pickle
import queue
import signal
import subprocess
import threading

FORBID_PICKLE_ENV = "RINGLLM_FORBID_PICKLE"
PARENT_PID_ENV = "RINGLLM_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc takes on a 64-bit machine
TRIM_THRESHOLD_BYTES = 256 << 20


_spawn_jobs: queue.SimpleQueue = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def start_child(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen_kwargs)`, forked by this process's spawner thread
    (started on first use, alive until the process exits), so the child's parent-death
    signal fires when this process dies and not before."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_loop, name="ringllm-spawner", daemon=True)
            _spawner.start()
    job: concurrent.futures.Future = concurrent.futures.Future()
    _spawn_jobs.put((job, args, popen_kwargs))
    return job.result()


def _spawn_loop() -> None:
    while True:
        job, args, popen_kwargs = _spawn_jobs.get()
        try:
            job.set_result(subprocess.Popen(args, **popen_kwargs))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            job.set_exception(exc)


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s; reaps it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that calls `die_with_parent`: names this process as its
    parent, so the child can tell whether its parent is already gone."""
    env = dict(os.environ if env is None else env)
    env[PARENT_PID_ENV] = str(os.getpid())
    return env


def die_with_parent() -> None:
    """SIGTERM from the kernel when the parent dies; exit now if it died already.

    "Already" is exact: the parent's pid comes from the starter (`child_env`), since a
    parent pid of 1 proves nothing (the parent may be PID 1 of a container or a PID
    namespace, and an orphan goes to a subreaper, not always to 1). Without it, nothing
    is assumed. NOTE: the kernel signals when the *thread* that started the child ends:
    start children with `start_child`."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the liveness checks still notice an orphan's dead peers
    expected = os.environ.get(PARENT_PID_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        raise SystemExit(0)  # the parent died before the request above took effect


def give_back_free_heap() -> None:
    """Hands the allocator's free pages back to the kernel (glibc's `malloc_trim(0)`), so
    the process's resident size falls to what it holds; nothing where the C library is not
    glibc (its allocator keeps what it keeps). For the moments after which much is freed
    and little is made again soon: a model's load, sleep, a large image decoded (within
    `tune_malloc`'s 256 MB of free heap top, glibc keeps the rest otherwise)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    if not is_glibc():
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def is_glibc() -> bool:
    """Whether this process's C library is glibc (whose malloc `tune_malloc` sets)."""
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        return False


def tune_malloc() -> None:
    """Sets glibc's malloc for a process that makes the same large tensors every step (every
    process that runs a model: `ModelRunner` calls it, in its own process or a caller's).

    By default glibc hands a large block (above a threshold that starts at 128 KB) to the
    kernel on `free` (or trims the heap's free top), so the next step's tensor of that size
    is mapped afresh and every 4 KB page of it faults and is zeroed as it is first written:
    on the demo model with int8 weights, some 19 faults per prefilled token (727,000 over
    1,216 prompts of 32 tokens; 11,000 with these settings), and the prefill rate with
    them 0.97-1.28x what it was (three rounds on a noisy 2-core machine). Blocks up to
    32 MB (a 2,048-row step's largest float32 activation on the demo model is 25 MB) now
    stay in the heap, and up to 256 MB of free heap top is kept for the next step. A
    user's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ (glibc's environment
    settings) are left as they are; another libc's malloc is not touched."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    if not is_glibc():
        return
    mallopt = ctypes.CDLL(None).mallopt
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def freeze_heap() -> None:
    """Moves every object alive now out of the garbage collector's reach (`gc.freeze`).

    Once a process has started (torch, the tokenizer, the model's Python objects: some
    200,000 objects in the engine core), a full collection walks all of them, and the
    objects a step makes trigger one every few seconds: 20 ms stolen from whichever step
    it lands in on the demo model (a stutter in every stream), plus about 1 ms a step in
    the younger generations. Frozen, they are never walked again; what is made later is
    collected as before. Called by the processes the engine owns (the core, each rank,
    the API server), never by a caller's own process."""
    gc.collect()
    gc.freeze()


def forbid_pickle_if_asked(where: str) -> None:
    """Test hook: with RINGLLM_FORBID_PICKLE=1, any later pickling in this process fails."""
    if os.environ.get(FORBID_PICKLE_ENV) != "1":
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"pickle used on {where}'s hot path")

    pickle.dumps = pickle.loads = pickle.dump = pickle.load = refuse  # type: ignore[assignment]
