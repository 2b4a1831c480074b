"""die_with_parent: exact about whether the parent is gone (a parent pid of 1 is a
container's init, not a proof of death)."""

from __future__ import annotations

import os
import subprocess
import sys

from ringllm.pipeline.child_process import PARENT_PID_ENV, child_env

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
