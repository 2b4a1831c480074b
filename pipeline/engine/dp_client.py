"""Data parallelism: N engine cores, each a process with its own rings and workers, and a
coordinator that sends each new request to the least-loaded one.

    front end ── DPCoreClient ──┬── RingCoreClient ── engine core 0 (instance segment 0)
                                ├── RingCoreClient ── engine core 1
                                └── ...

Load of core i = running + waiting as the core last published them in its instance
segment (updated every step) + requests this front end sent it that have not produced any
output yet. A request in the second group may already be in the first (waiting): counted
twice for a moment, which errs towards the other cores; never counting one that is still
in flight to the core is what a burst of submissions would get wrong (they would all go to
the core whose published load is lowest). A reader thread per core feeds one queue, so
`get_outputs` waits on all cores at once. A core's death is a `RankDeadError` naming it: a
supervising front end (frontend/supervisor.py) then starts that core alone again
(`restart_rank`, then `RankRestart.put_in_service`) and replays only the sequences it held,
while the others keep theirs (their outputs wait in this client's queue meanwhile).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.engine.ring_client import RingCoreClient, shut_down_dead
from ringllm.pipeline.errors import EngineDeadError
from ringllm.pipeline.messages import ControlReply, CoreOutputs, EngineCoreRequest
from ringllm.pipeline.stats import PrefixCacheStats, SchedulerStats


class RankDeadError(EngineDeadError):
    """One data-parallel core died (`rank`); the others are alive."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message, peer=f"data-parallel engine core {rank}")
        self.rank = rank


class DPCoreClient:
    def __init__(
        self, clients: list[RingCoreClient], core_config: EngineConfig | None = None
    ) -> None:
        """`core_config`: what each core was started with (to start one again)."""
        self.clients = clients
        self.core_config = core_config
        first = clients[0].info
        self.info = dataclasses.replace(
            first,
            num_blocks=min(c.info.num_blocks for c in clients),
            max_request_tokens=min(c.info.max_request_tokens for c in clients),
        )
        self._owner: dict[str, int] = {}
        self._unseen = [0] * len(clients)  # sent, no output yet (the ids: self._silent)
        self._silent: set[str] = set()
        self.num_routed = [0] * len(clients)
        self._queue: queue.Queue = queue.Queue()
        self._stats: list[SchedulerStats | None] = [None] * len(clients)
        self._stopping = threading.Event()
        self._tickets = itertools.count(1)
        self._replies: dict[int, list] = {}  # ticket -> [cores yet to answer, error, level]
        self._readers = [self._start_reader(i) for i in range(len(clients))]

    @property
    def instance_name(self) -> str:
        return ",".join(c.instance_name for c in self.clients)

    @classmethod
    def start(cls, config: EngineConfig) -> DPCoreClient:
        size = config.parallel.data_parallel_size
        threads = config.device.num_threads or max(1, (os.cpu_count() or 1) // size)
        core_config = dataclasses.replace(
            config,
            parallel=dataclasses.replace(config.parallel, data_parallel_size=1),
            device=dataclasses.replace(config.device, num_threads=threads),
        )
        clients: list[RingCoreClient] = []
        try:
            for index in range(size):
                clients.append(RingCoreClient.start(config_of_rank(core_config, index)))
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        return cls(clients, core_config)

    def _start_reader(self, index: int) -> threading.Thread:
        reader = threading.Thread(
            target=self._read, args=(index, self.clients[index]),
            name=f"ringllm-dp-reader-{index}", daemon=True,
        )  # fmt: skip
        reader.start()
        return reader

    @property
    def can_restart(self) -> bool:
        """Whether this client started every core process (so it may start them again)."""
        return all(c.can_restart for c in self.clients)

    def restart(self, config: EngineConfig, standby=None) -> DPCoreClient:
        """Every core cleaned up (this group is dead) and a new group started for `config`
        (no standby: a spare is kept for a single core only)."""
        if standby is not None:
            standby.close()
        shut_down_dead(self, "the dead data-parallel engine cores")
        return DPCoreClient.start(config)

    def restart_rank(self, rank: int) -> RankRestart:
        """Dead core `rank` cleaned up and a new one started with its config; it serves
        once `RankRestart.put_in_service` runs (on the thread that uses this client)."""
        shut_down_dead(self.clients[rank], f"dead data-parallel engine core {rank}")
        fresh = RingCoreClient.start(config_of_rank(self.core_config, rank))
        return RankRestart(self, rank, fresh)

    def _replace_rank(self, index: int, fresh: RingCoreClient) -> set[str]:
        """Core `index` (dead, shut down) replaced by `fresh`; returns the ids of the
        sequences the dead one held (to replay: they are nobody's now)."""
        orphans = {rid for rid, owner in self._owner.items() if owner == index}
        for rid in orphans:
            del self._owner[rid]
            self._silent.discard(rid)
        self._unseen[index] = 0
        self._stats[index] = None
        self.clients[index] = fresh
        self._readers[index] = self._start_reader(index)
        return orphans

    # ---- routing -------------------------------------------------------------------

    def least_loaded(self) -> int:
        loads = []
        for i, client in enumerate(self.clients):
            running, waiting = client.instance.load()
            loads.append(running + waiting + self._unseen[i])
        return loads.index(min(loads))

    def add_request(self, request: EngineCoreRequest) -> None:
        index = self.least_loaded()
        # Booked before it is sent: its first output may be read (on a reader thread)
        # before this thread runs again.
        self._owner[request.request_id] = index
        self._unseen[index] += 1
        self._silent.add(request.request_id)
        try:
            self.clients[index].add_request(request)
        except BaseException:
            self._owner.pop(request.request_id, None)
            self._heard(request.request_id, index)
            raise
        self.num_routed[index] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._by_core(request_ids, forget=True).items():
            self.clients[index].abort_requests(ids)

    def pause_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._by_core(request_ids).items():
            self.clients[index].pause_requests(ids)

    def resume_requests(self, request_ids: list[str]) -> None:
        for index, ids in self._by_core(request_ids).items():
            self.clients[index].resume_requests(ids)

    def _by_core(self, request_ids: list[str], forget: bool = False) -> dict[int, list[str]]:
        """The ids each core owns (unknown ones left out); `forget`: no longer routed there
        (an abort: the core has heard the last of them)."""
        by_core: dict[int, list[str]] = {}
        for rid in request_ids:
            index = self._owner.pop(rid, None) if forget else self._owner.get(rid)
            if index is not None:
                by_core.setdefault(index, []).append(rid)
                if forget:
                    self._heard(rid, index)
        return by_core

    def flush_aborts(self) -> None:
        for client in self.clients:
            client.flush_aborts()

    def reset_prefix_cache(self) -> None:
        for client in self.clients:
            client.reset_prefix_cache()

    def control(self, command: str, arg: int = 0, text: str = "") -> int:
        """The command to every core; one reply once all have answered (the first error)."""
        ticket = next(self._tickets)
        self._replies[ticket] = [len(self.clients), None, 0]  # booked before any answer
        for client in self.clients:
            client.control(command, arg, ticket=ticket, text=text)
        return ticket

    def _merge_replies(self, replies: list[ControlReply]) -> list[ControlReply]:
        done = []
        for reply in replies:
            state = self._replies.get(reply.ticket)
            if state is None:
                continue
            state[0] -= 1
            state[1] = state[1] or reply.error
            state[2] = max(state[2], reply.sleep_level)
            if state[0] == 0:
                del self._replies[reply.ticket]
                done.append(ControlReply(reply.ticket, state[2], state[1]))
        return done

    # ---- outputs -------------------------------------------------------------------

    def _read(self, index: int, client: RingCoreClient) -> None:
        while not self._stopping.is_set():
            try:
                batch = client.get_outputs(timeout_s=0.1)
            except BaseException as exc:
                if not self._stopping.is_set():
                    self._queue.put(
                        RankDeadError(f"data-parallel engine core {index}: {exc}", index)
                    )
                return
            if batch is not None:
                self._queue.put((index, batch))

    def get_outputs(self, timeout_s: float) -> CoreOutputs | None:
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item if isinstance(item, EngineDeadError) else EngineDeadError(str(item))
        index, batch = item
        if batch.stats is not None:
            self._stats[index] = batch.stats
        for out in batch.outputs:
            self._heard(out.request_id, index)
            if out.finished:
                self._owner.pop(out.request_id, None)
        replies = self._merge_replies(batch.replies) if batch.replies else []
        return CoreOutputs(batch.outputs, self._merged_stats(batch.stats), replies)

    def _heard(self, request_id: str, index: int) -> None:
        """The core has the request (an output came, or it was aborted): its published load
        counts it from now on."""
        if request_id in self._silent:
            self._silent.discard(request_id)
            self._unseen[index] -= 1

    def _merged_stats(self, latest: SchedulerStats | None) -> SchedulerStats:
        """Gauges summed over the cores; prefix-cache and speculative-decoding counts are
        this batch's own delta."""
        known = [s for s in self._stats if s is not None]
        return SchedulerStats(
            num_running=sum(s.num_running for s in known),
            num_waiting=sum(s.num_waiting for s in known),
            kv_cache_usage=sum(s.kv_cache_usage for s in known) / max(len(known), 1),
            prefix_cache=latest.prefix_cache if latest is not None else PrefixCacheStats(),
            num_preemptions_total=sum(s.num_preemptions_total for s in known),
            spec_decoding=latest.spec_decoding if latest is not None else None,
            kv_tiers=latest.kv_tiers if latest is not None else None,  # that core's own
        )

    def check_alive(self) -> None:
        for index, client in enumerate(self.clients):
            try:
                client.check_alive()
            except EngineDeadError as exc:
                raise RankDeadError(f"data-parallel engine core {index}: {exc}", index) from exc

    def shutdown(self) -> None:
        self._stopping.set()
        for reader in self._readers:
            reader.join(timeout=2)
        for client in self.clients:
            client.shutdown()


class RankRestart:
    """A data-parallel core started again in place of a dead one, not yet serving."""

    def __init__(self, group: DPCoreClient, rank: int, fresh: RingCoreClient) -> None:
        self.group = group
        self.rank = rank
        self.fresh = fresh

    @property
    def startup_s(self) -> dict[str, float]:
        return self.fresh.startup_s

    def put_in_service(self) -> set[str]:
        """The new core takes the dead one's place; returns the ids of the sequences the
        dead one held (to replay into the group)."""
        return self.group._replace_rank(self.rank, self.fresh)

    def abandon(self) -> None:
        """Nobody is left to use it: it stops."""
        self.fresh.shutdown()


def config_of_rank(core_config: EngineConfig, index: int) -> EngineConfig:
    """Core `index`'s config: a disk KV tier of its own (a subfolder: one engine per file)."""
    directory = core_config.cache.kv_offload_dir
    if directory is None:
        return core_config
    cache = dataclasses.replace(
        core_config.cache, kv_offload_dir=os.path.join(directory, f"dp{index}")
    )
    return dataclasses.replace(core_config, cache=cache)


def start_core_client(config: EngineConfig) -> RingCoreClient | DPCoreClient:
    """The engine core process(es) for `config`: one, or one per data-parallel rank."""
    if config.parallel.data_parallel_size > 1:
        return DPCoreClient.start(config)
    return RingCoreClient.start(config)
