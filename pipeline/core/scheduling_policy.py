"""Which waiting request is admitted next and which running request is preempted.

The queues themselves are kept in the policy's order (`Request.sort_key`: FCFS by
arrival, priority by (priority, arrival)); this module picks within them.

Fair share (FCFS policy). A user request can hold many sequences: its n children, or the
prompts of one HTTP request, all under one `group_id`. Left to arrival order, a request
with n = 256 and a long max_tokens would fill every sequence slot (or the KV pool) and keep
a later 4-token request waiting until its sequences end. So sequences are shared out
max-min fairly between groups:

- admission takes, among the first waiting requests (FAIR_SCAN of them), the first whose
  group holds the fewest running sequences (arrival order among equals; `next_waiting`);
- when a waiting request's group holds no running sequence while the slots or the KV pool
  are full, one sequence of the group holding the most is preempted for it at the start of
  the step (`fair_share_victim`; a group holding one sequence is never preempted for this);
- the KV-short victim is also taken from the group holding the most running sequences,
  not blindly the latest request (`pick_victim`).

So a new small request runs within a step or two whatever one other request holds, and
a group of many sequences keeps all slots no other group asks for. The priority policy
keeps strict priority order (no fair share): its victim is the last running request.
"""

from __future__ import annotations

import collections
from collections.abc import Container, Sequence

from ringllm.pipeline.core.request import Request

FAIR_SCAN = 256  # waiting requests looked at for the fairest next admission


def next_waiting(
    waiting: Sequence[Request], running_per_group: collections.Counter[str], fair: bool
) -> int:
    """The index in `waiting` to admit next: policy order, or (fair share) the first of the
    first FAIR_SCAN whose group holds the fewest running sequences."""
    if not fair:
        return 0
    best, fewest = 0, None
    for index, request in enumerate(waiting[:FAIR_SCAN]):
        held = running_per_group[request.group_id]
        if fewest is None or held < fewest:
            best, fewest = index, held
            if held == 0:
                break
    return best


def pick_victim(
    candidates: Sequence[Request],
    running_per_group: collections.Counter[str],
    fair: bool,
    in_flight: Container[str],
) -> Request | None:
    """The request to preempt among `candidates` (running requests in policy order, not yet
    scheduled this step): the last; with fair share, the last of the group that holds the
    most running sequences. Never one in flight (None: every candidate is)."""
    candidates = [r for r in candidates if r.request_id not in in_flight]
    if not candidates:
        return None
    if not fair:
        return candidates[-1]
    most = max(running_per_group[r.group_id] for r in candidates)
    return next(r for r in reversed(candidates) if running_per_group[r.group_id] == most)


def fair_share_victim(
    running: Sequence[Request],
    running_per_group: collections.Counter[str],
    in_flight: Container[str],
) -> Request | None:
    """The sequence a starved group's request takes the place of: the last running one of
    the group holding the most sequences, if it holds at least two and one is not in
    flight (None: no preemption for fair share this step)."""
    if not running_per_group:
        return None
    group, held = running_per_group.most_common(1)[0]
    if held < 2:
        return None
    return next(
        (r for r in reversed(running) if r.group_id == group and r.request_id not in in_flight),
        None,
    )
