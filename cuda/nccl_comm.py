"""`NcclCommunicator`: the tensor-parallel collectives on GPUs, NCCL called directly
through `cupy.cuda.nccl` (no torch.distributed). Same interface as the CPU one
(`ringllm.pipeline.models.communicator.Communicator`): sum all-reduce, all-gather, broadcast,
barrier, close; and for pipeline stages point-to-point send / recv (ncclSend / ncclRecv,
NCCL >= 2.7).

Rendezvous. The process that starts the ranks makes a small shared-memory segment
(`create_unique_id_segment`, via `Rendezvous.create("cuda")`) and passes its name to
every rank. Rank 0 calls ncclGetUniqueId and publishes the id there; the other ranks wait
for the flag, read the id, and all call ncclCommInitRank:

    offset 0   uint64  state: 0 = empty, 1 = the id below is complete (release store,
                       written after the bytes, so a reader that sees 1 sees all of them)
    offset 8   128 B   ncclUniqueId

Streams. Each collective is enqueued on torch's current CUDA stream (its raw handle), so it
runs after the kernels that produced the tensor and before those that consume it, and no
host synchronisation is needed; only `barrier` waits on the host. Tensors go to NCCL as
device pointers (`data_ptr()`, no copy) and must be contiguous on this rank's device
(`torch.cuda.set_device(rank)` before `connect`); a non-contiguous input is copied first.

CuPy is optional (extra `gpu`): importing this module works without it, and `connect`
then says what to install.
"""

from __future__ import annotations

import time

import torch

from ringllm.ipc.shm import Segment

try:  # NOTE: optional dependency; the CPU build has no CuPy.
    import cupy
    from cupy.cuda import nccl
except ImportError:  # pragma: no cover - depends on the installation
    cupy = None
    nccl = None

NCCL_UNIQUE_ID_BYTES = 128


def check_rank(rank: int, world_size: int) -> None:
    """The same check as the CPU communicator's (cuda/ does not import pipeline/)."""
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank: must be in [0, {world_size}) for world_size {world_size}, got {rank}"
        )


_STATE_OFFSET, _ID_OFFSET = 0, 8
_ID_WRITTEN = 1
SEGMENT_BYTES = _ID_OFFSET + NCCL_UNIQUE_ID_BYTES
UNIQUE_ID_TIMEOUT_S = 300.0
_POLL_S = 0.001


def create_unique_id_segment() -> Segment:
    """The empty rendezvous segment (owned by the caller, who closes it after start-up)."""
    return Segment.create("nccl-id", SEGMENT_BYTES)


def _require_nccl() -> None:
    if nccl is None:
        raise RuntimeError(
            "tensor parallelism on GPUs needs CuPy with NCCL: pip install 'ringllm[gpu]' "
            "(cupy-cuda12x and nvidia-nccl-cu12), or run on the CPU with --device cpu"
        )


def _nccl_dtypes() -> dict[torch.dtype, int]:
    return {
        torch.float32: nccl.NCCL_FLOAT32,
        torch.float16: nccl.NCCL_FLOAT16,
        # NCCL >= 2.10 knows bfloat16 as ncclBfloat16 = 9; older CuPy lacks the constant.
        torch.bfloat16: getattr(nccl, "NCCL_BFLOAT16", 9),
        torch.float64: nccl.NCCL_FLOAT64,
        torch.int32: nccl.NCCL_INT32,
        torch.int64: nccl.NCCL_INT64,
        torch.int8: nccl.NCCL_INT8,
        torch.uint8: nccl.NCCL_UINT8,
    }


def _cupy_takes_bytes() -> bool:
    # CuPy 14 changed get_unique_id() from a tuple of (signed char) ints to bytes, and
    # NcclCommunicator's commId to match.
    return int(cupy.__version__.split(".")[0]) >= 14


def _unique_id_bytes() -> bytes:
    unique_id = nccl.get_unique_id()
    raw = bytes(unique_id) if isinstance(unique_id, bytes) else bytes(b & 0xFF for b in unique_id)
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise RuntimeError(
            f"ncclGetUniqueId returned {len(raw)} bytes, expected {NCCL_UNIQUE_ID_BYTES}"
        )
    return raw


def publish_unique_id(segment: Segment) -> bytes:
    """Rank 0: make the group's id and publish it in the segment."""
    raw = _unique_id_bytes()
    segment.buf[_ID_OFFSET:SEGMENT_BYTES] = raw
    segment.store_u64(_STATE_OFFSET, _ID_WRITTEN)
    return raw


def wait_unique_id(segment: Segment, timeout_s: float = UNIQUE_ID_TIMEOUT_S) -> bytes:
    """Ranks > 0: the id once rank 0 has published it."""
    deadline = time.monotonic() + timeout_s
    while segment.load_u64(_STATE_OFFSET) != _ID_WRITTEN:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank 0 did not publish the NCCL unique id in segment {segment.name!r} "
                f"within {timeout_s:.0f} s; did it start?"
            )
        time.sleep(_POLL_S)
    return bytes(segment.buf[_ID_OFFSET:SEGMENT_BYTES])


def _as_comm_id(raw: bytes):
    if _cupy_takes_bytes():
        return raw
    return tuple(b - 256 if b > 127 else b for b in raw)


class NcclCommunicator:
    """One rank of an NCCL group; make it with `connect`."""

    def __init__(self, rank: int, world_size: int, comm) -> None:
        self.rank = rank
        self.world_size = world_size
        self._comm = comm
        self._dtypes = _nccl_dtypes()

    @classmethod
    def connect(cls, rank: int, world_size: int, segment_name: str) -> NcclCommunicator:
        """Join the group whose unique id travels through shared-memory `segment_name`."""
        _require_nccl()
        check_rank(rank, world_size)
        segment = Segment.attach(segment_name)
        try:
            raw = publish_unique_id(segment) if rank == 0 else wait_unique_id(segment)
        finally:
            segment.close()
        return cls.connect_with_id(rank, world_size, raw)

    @staticmethod
    def make_unique_id() -> bytes:
        """A new group's id (rank 0 makes it; another channel takes it to the others:
        across hosts, the head's TCPStore)."""
        _require_nccl()
        return _unique_id_bytes()

    @classmethod
    def connect_with_id(cls, rank: int, world_size: int, raw: bytes) -> NcclCommunicator:
        _require_nccl()
        check_rank(rank, world_size)
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        # ncclCommInitRank blocks until every rank has called it (on the current device).
        comm = nccl.NcclCommunicator(world_size, _as_comm_id(bytes(raw)), rank)
        return cls(rank, world_size, comm)

    def _dtype(self, x: torch.Tensor) -> int:
        if x.dtype not in self._dtypes:
            raise ValueError(
                f"NCCL collectives take {sorted(str(d) for d in self._dtypes)}, got {x.dtype}"
            )
        if not x.is_cuda:
            raise ValueError(f"NCCL collectives take CUDA tensors, got one on {x.device}")
        return self._dtypes[x.dtype]

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        x = x if x.is_contiguous() else x.contiguous()
        ptr = x.data_ptr()
        self._comm.allReduce(ptr, ptr, x.numel(), self._dtype(x), nccl.NCCL_SUM, self._stream())
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        # NCCL gathers rank-major: out[r] is rank r's tensor; then concatenate along `dim`.
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        if x.numel():
            self._comm.allGather(
                x.data_ptr(), out.data_ptr(), x.numel(), self._dtype(x), self._stream()
            )
        return torch.cat(out.unbind(0), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        check_rank(src, self.world_size)
        if x.numel() == 0:
            return x
        if not x.is_contiguous():
            raise ValueError("broadcast works in place: pass a contiguous tensor")
        self._comm.bcast(x.data_ptr(), x.numel(), self._dtype(x), src, self._stream())
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Point to point (pipeline stages): `x` to rank `dst`, which `recv`s it. Enqueued
        on the current stream: the kernels after it wait until `dst` has posted its recv."""
        check_rank(dst, self.world_size)
        if x.numel():
            x = x if x.is_contiguous() else x.contiguous()
            self._comm.send(x.data_ptr(), x.numel(), self._dtype(x), dst, self._stream())

    def isend(self, x: torch.Tensor, dst: int):
        """`send`, and an event to `wait()` on (the host blocks until the send is done);
        `x` must stay alive until then (the caller keeps it)."""
        if not x.numel():
            return None
        self.send(x, dst)
        done = torch.cuda.Event()
        done.record()
        return _EventWork(done)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Fills `x` (contiguous, same shape and dtype as the send) with what rank `src`
        sends; the kernels enqueued after it see the data."""
        check_rank(src, self.world_size)
        if x.numel():
            if not x.is_contiguous():
                raise ValueError("recv works in place: pass a contiguous tensor")
            self._comm.recv(x.data_ptr(), x.numel(), self._dtype(x), src, self._stream())
        return x

    def barrier(self) -> None:
        """Every rank has reached this point (and its queued work before it has run)."""
        token = torch.ones(1, dtype=torch.float32, device="cuda")
        self.all_reduce(token)
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()


class _EventWork:
    """What `isend` returns: `wait()` blocks the host until the send has completed."""

    def __init__(self, event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()
