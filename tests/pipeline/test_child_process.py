"""die_with_parent: exact about whether the parent is gone (a parent pid of 1 is a
container's init, not a proof of death); freeze_heap and tune_malloc, the engine's
processes' collector and allocator settings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringllm.pipeline.child_process import PARENT_PID_ENV, child_env, is_glibc

CHILD = (
    "from ringllm.pipeline.child_process import die_with_parent; die_with_parent(); print('alive')"
)


def run_child(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_child_of_a_live_parent_lives():
    assert child_env()[PARENT_PID_ENV] == str(os.getpid())
    assert run_child(child_env()) == "alive"


def test_a_child_whose_recorded_parent_is_not_its_parent_exits_at_once():
    # what a child sees when its starter died before PR_SET_PDEATHSIG took effect
    env = child_env()
    env[PARENT_PID_ENV] = str(os.getpid() + 1_000_000)
    assert run_child(env) == ""


def test_without_a_recorded_parent_nothing_is_assumed():
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    assert run_child(env) == "alive"


FREEZE = """
import gc, weakref
from ringllm.pipeline.child_process import freeze_heap
class Node: pass
def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)
before = cycle()                      # garbage already: freeze_heap collects it first
freeze_heap()
assert before() is None
frozen = gc.get_freeze_count()
assert frozen > 1000, frozen          # the interpreter's and the imports' objects
after = cycle()
assert gc.collect() >= 2 and after() is None  # what is made later is still collected
assert gc.get_freeze_count() == frozen
print('ok')
"""


def test_freeze_heap_leaves_start_up_objects_out_and_collects_later_ones():
    done = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


REUSE = """
import ctypes, resource
from ringllm.pipeline.child_process import tune_malloc
tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 24 << 20                       # a step's activations: each under the 32 MB threshold
for step in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        libc.memset(block, 1, size)   # every page written, as a kernel's output is
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    for block in blocks:
        libc.free(block)
print(faults)                         # the third step's
"""


def _third_step_faults(env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", REUSE], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


@pytest.mark.skipif(not is_glibc(), reason="tune_malloc sets glibc's malloc only")
def test_tune_malloc_keeps_a_steps_large_blocks_and_a_users_setting():
    pages = 3 * (24 << 20) // os.sysconf("SC_PAGE_SIZE")
    # tuned: the blocks freed by one step are the next step's, their pages already there
    # (glibc's default returns the 72 MB freed at the heap's top, and they fault again)
    assert _third_step_faults({}) < pages // 100
    # the user's own glibc setting wins: here every block mapped afresh, every page faulted
    assert _third_step_faults({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}) >= pages // 2
