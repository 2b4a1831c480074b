"""Tensor-parallel communication: the collectives the ranks of one model call, and how the
ranks of a group find each other.

`Communicator` (pipeline/models/communicator.py) is the interface model code uses: a sum
all-reduce of partial outputs, an all-gather of vocab-parallel logits, a broadcast and a
barrier. Two implementations:

    GlooCommunicator   (here)                 CPU: torch.distributed's gloo over loopback TCP
    NcclCommunicator   (cuda/nccl_comm.py)    GPU: NCCL through cupy.cuda.nccl

`Rendezvous` is where they meet. The parent of the ranks (the multiproc executor) makes it before
starting them and passes its `address` on their command line; it removes it on close:

    gloo: a FileStore file in a private temporary folder (mode 0700)
    nccl: a shared-memory segment that rank 0 fills with the NCCL unique id

Invariants:
- Every rank calls the same collectives in the same order, with tensors of the same shape
  and dtype (they all run the same Worker.execute over the same batch). That is why an
  empty tensor may skip the collective: it is empty on every rank.
- The result is bit-identical on every rank (gloo and NCCL reduce once and hand the same
  bytes to all), so the ranks' logits, and so their sampled tokens, agree.
- Gloo binds 127.0.0.1 only on one host; across hosts (pipeline/executor/placement.py) it binds
  the host's address on the route to the head, and groups meet in the head's TCPStore.
- No process-wide default group: each communicator owns its own process-group object.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time

import torch

from ringllm.pipeline.models.communicator import Communicator, check_rank

LOOPBACK_HOST = "127.0.0.1"
# A collective waits this long for its slowest peer. A dead peer is noticed sooner: its
# sockets close and the collective fails at once; this bounds only a peer that hangs.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0


class GlooCommunicator:
    """One rank of a gloo group. `store_path`: the group's FileStore file (one host: gloo
    over loopback), or tcp://HOST:PORT#GROUP (several hosts: the head's TCPStore, the group's
    keys under GROUP, gloo bound to this host's address on the route to HOST)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store_path: str,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
    ) -> None:
        import torch.distributed as dist

        check_rank(rank, world_size)
        self.rank = rank
        self.world_size = world_size
        self._store, hostname = _open_store(store_path, world_size, timeout_s)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        # Blocks until every rank has joined (or the timeout passes).
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, options)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        x = x if x.is_contiguous() else x.contiguous()
        self._group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        if x.numel():
            self._group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        check_rank(src, self.world_size)
        if x.numel():
            self._group.broadcast(x, src).wait()
        return x

    def barrier(self) -> None:
        self._group.barrier().wait()

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point to point (pipeline stages): `x` to rank `dst`, which `recv`s it."""
        work = self.isend(x, dst)
        if work is not None:
            work.wait()

    def isend(self, x: torch.Tensor, dst: int):
        """`send` without waiting: the work to `wait()` on (None: nothing to send); `x`
        must stay untouched until then. Sends to one peer arrive in the order made."""
        if not x.numel():
            return None
        return self._group.send([_wire(x)], dst, 0)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fills `x` with what rank `src` `send`s (same shape and dtype); returns it."""
        if x.numel():
            self._group.recv([_wire(x)], src, 0).wait()
        return x

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
        self._store = None


def _open_store(address: str, world_size: int, timeout_s: float):
    """The group's store and the address gloo binds (see GlooCommunicator)."""
    import torch.distributed as dist

    from ringllm.pipeline.executor.placement import local_address, parse_store_address

    tcp = parse_store_address(address.partition("#")[0])
    if tcp is None:
        return dist.FileStore(address, world_size), LOOPBACK_HOST
    host, port = tcp
    store = dist.TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )
    group = address.partition("#")[2] or "group"
    return dist.PrefixStore(f"ringllm/{group}/", store), local_address(host)


def _wire(x: torch.Tensor) -> torch.Tensor:
    """`x` as gloo moves it: 16-bit floats as their int16 bits (the same bytes)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.view(torch.int16)
    return x


class PipelineLink:
    """One rank's links to the other pipeline stages, over a group of all P x T ranks
    (global rank = stage x T + tensor-parallel rank; gloo on the CPU, NCCL on GPUs): the
    previous stage's rank of the same tensor-parallel rank sends it hidden states, and it
    sends its own to the next stage's. On a GPU both are enqueued on the current stream, so
    the wait counters then measure the host's waits only (the device's are not visible).

    A send does not wait: the stage goes on to its next batch while the tensors travel,
    and waits for them only before its next send (one step's tensors in the air at most).
    The sampled tokens never travel here: the last stage's first rank returns them to the
    engine core, which hands them to the earlier stages with each request's next step.

    It counts what a stage costs the pipeline (`PipelineLink.stats`, read by bench pp):
    seconds waiting for the previous stage, seconds waiting for the next stage to take a
    send, and bytes sent and received."""

    def __init__(self, world: Communicator, stage: int, num_stages: int, tp_size: int) -> None:
        self.world = world
        self.stage = stage
        self.num_stages = num_stages
        self.tp_rank = world.rank % tp_size
        self.tp_size = tp_size
        self._sending: list[tuple[object, torch.Tensor]] = []  # works and their tensors
        self.recv_wait_s = 0.0
        self.send_wait_s = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0

    def recv_prev(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        self.world.recv(x, (self.stage - 1) * self.tp_size + self.tp_rank)
        self.recv_wait_s += time.perf_counter() - started
        self.bytes_received += x.nbytes
        return x

    def send_next(self, tensors: list[torch.Tensor]) -> None:
        """`tensors`, in order, to the next stage's rank; returns once they are on their way."""
        self.flush()
        dst = (self.stage + 1) * self.tp_size + self.tp_rank
        for x in tensors:
            x = x.contiguous()
            work = self.world.isend(x, dst)
            if work is not None:
                self._sending.append((work, x))
            self.bytes_sent += x.nbytes

    def flush(self) -> None:
        """Waits until the next stage has taken every send made so far."""
        if not self._sending:
            return
        started = time.perf_counter()
        for work, _ in self._sending:
            work.wait()
        self._sending = []
        self.send_wait_s += time.perf_counter() - started

    def close(self) -> None:
        self._sending = []
        self.world.close()


def stage_addresses(address: str, num_stages: int) -> tuple[list[str], str]:
    """The rendezvous addresses of each stage's tensor-parallel group and of the whole grid,
    from `Rendezvous.address`: with one stage, `address` itself for both; gloo, FileStore
    files beside it; NCCL, its comma-separated id segments (the stages', then the grid's)."""
    if num_stages == 1:
        return [address], address
    if address.startswith("tcp://"):  # several hosts: groups in the head's TCPStore
        return [f"{address}#tp{stage}" for stage in range(num_stages)], f"{address}#world"
    if "/" not in address:  # NCCL id segments (a gloo store is a path)
        names = address.split(",")
        if len(names) != num_stages + 1:
            raise ValueError(
                f"rendezvous: {len(names)} NCCL id segments for {num_stages} stages "
                f"(one per stage and one for all)"
            )
        return names[:-1], names[-1]
    return [f"{address}.tp{stage}" for stage in range(num_stages)], f"{address}.world"


class Rendezvous:
    """The meeting point of the ranks' groups; made (and removed) by the process that
    starts the ranks. Gloo: one private folder whose FileStore files serve every group.
    NCCL: one id segment per group (each stage's tensor-parallel group, and with pipeline
    stages one more for all the ranks), their names joined by commas."""

    def __init__(self, device: str, address: str, owned) -> None:
        self.device = device
        self.address = address
        self._owned = owned  # the temporary folder, or the id segments

    @classmethod
    def create(cls, device: str, num_stages: int = 1) -> Rendezvous:
        if device == "cuda":
            from ringllm.cuda.nccl_comm import create_unique_id_segment

            segments = []
            try:
                for _ in range(num_stages + 1 if num_stages > 1 else 1):
                    segments.append(create_unique_id_segment())
            except BaseException:
                for segment in segments:
                    segment.close()
                raise
            return cls(device, ",".join(s.name for s in segments), segments)
        folder = tempfile.mkdtemp(prefix="ringllm-tp-")  # mode 0700: ours only
        return cls(device, os.path.join(folder, "store"), folder)

    def close(self) -> None:
        owned, self._owned = self._owned, None
        if owned is None:
            return
        if isinstance(owned, str):
            shutil.rmtree(owned, ignore_errors=True)
        else:
            for segment in owned:
                segment.close()


def connect(
    device: str,
    rank: int,
    world_size: int,
    address: str,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> Communicator:
    """Join the group at `address` (from `Rendezvous.create(device).address`) as `rank`."""
    if device == "cuda":
        from ringllm.cuda.nccl_comm import NcclCommunicator

        if address.startswith("tcp://"):  # the group's unique id travels through the store
            store, _ = _open_store(address, world_size, timeout_s)
            if rank == 0:
                store.set("nccl_unique_id", NcclCommunicator.make_unique_id())
            return NcclCommunicator.connect_with_id(rank, world_size, store.get("nccl_unique_id"))
        return NcclCommunicator.connect(rank, world_size, address)
    return GlooCommunicator(rank, world_size, address, timeout_s)


__all__ = [
    "Communicator",
    "GlooCommunicator",
    "PipelineLink",
    "Rendezvous",
    "check_rank",
    "connect",
    "stage_addresses",
]
