"""One rank (of a tensor-parallel group, of a pipeline stage) in a process of its own: steps in from the batch ring, the model
and sampler run, rank 0 answers on the result ring.

Started by the multiproc executor (pipeline/executor/multiproc.py) or a host agent as a fresh
interpreter (pipeline/executor/launch.py start_rank):

    python -m ringllm.pipeline.executor.rank_process <rank spec json> <ready fd>

Life of a rank:

    die with the parent (PR_SET_PDEATHSIG); torch threads = cpu_count // tensor_parallel_size
    join the group (gloo on CPU, NCCL on GPU); load only this rank's shards (Worker)
    write "ready <num_blocks>" on the ready pipe (or "error <type>: <message>" and exit 1)
    loop over batch-ring records:
        NEW       remember the request (BatchDecoder)
        STEP      Worker.execute; rank 0 writes the OUTPUT record
        INIT_KV   allocate the KV cache; barrier; rank 0 writes KV_READY
        SLEEP     Worker.sleep(level); barrier; rank 0 writes DONE (WAKE: Worker.wake_up,
                  value: the tags' bits)
        LORA_ADD  Worker.add_lora; barrier; rank 0 writes DONE, with the reason as its
                  blob when the adapter does not fit (LORA_REMOVE: Worker.remove_lora)
        SHUTDOWN  leave

Pipeline stages (pipeline_parallel_size > 1): ranks are a grid, stage x T + tensor-parallel
rank; every rank reads every record, a stage after the first waits for the previous
stage's hidden states, and the last stage's first rank answers. Each rank writes what its
steps cost into its row of the executor's stage-stats table (executor/stage_stats.py).

Every rank runs the same `Worker.execute` on the same batch, so every rank samples, and
samples the same tokens (the logits are bit-identical after the all-gather, the sampler's
generators are seeded alike): each rank's request state stays whole without a second
broadcast of the sampled tokens. Only rank 0's answer is sent.

A failure after start-up: rank 0 writes an ERROR record with the message; every rank exits
non-zero, which the executor sees as a dead worker. A dead engine core: the ring reader
notices its writer is gone (PeerDeadError) and PR_SET_PDEATHSIG ends the rank anyway.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from ringllm.ipc.ring import Ring
from ringllm.ipc.tensor_slab import TensorSlab
from ringllm.pipeline.child_process import (
    die_with_parent,
    forbid_pickle_if_asked,
    freeze_heap,
)
from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.executor import batch_records as br
from ringllm.pipeline.executor.process_groups import (
    Communicator,
    PipelineLink,
    connect,
    stage_addresses,
)
from ringllm.pipeline.executor.stage_stats import StageStatsTable
from ringllm.pipeline.messages import wake_tags
from ringllm.pipeline.worker.model_loader import model_stages
from ringllm.pipeline.worker.worker import Worker

logger = logging.getLogger(__name__)

READ_BATCH_RECORDS = 256
RESULT_FULL_TIMEOUT_S = 60.0
_EMPTY = np.zeros(0, np.int32)


@dataclass(frozen=True)
class RankSpec:
    """What one rank needs to start (travels as JSON on its command line)."""

    engine_args: dict
    rank: int
    rendezvous: str
    batch_ring: str
    result_ring: str
    slab: str = ""  # the engine core's tensor slab (a model that takes images)
    stage_stats: str = ""  # pipeline stages: the table of what each rank's steps cost
    local_rank: int = -1  # its index among its host's ranks (ring reader, GPU); -1: rank
    cuda_device: int = -1  # the GPU it runs on; -1: local_rank (Ray: 0, the one it sees)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        return cls(**json.loads(text))


_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >> 63 else value


def agreed_disk_entries(comm, entries: dict[int, int], num_slots: int, device: str) -> dict:
    """The disk-tier entries every rank's file holds alike (the same hash in the same
    slot, each verified by its own rank): what a restarted TP engine may hit on. A
    collective: every rank calls it."""
    if not num_slots:
        return {}
    table = torch.zeros((num_slots, 3), dtype=torch.int64)  # valid, hash low, hash high
    for block_hash, slot in entries.items():
        table[slot, 0] = 1
        table[slot, 1] = _signed64(block_hash & _MASK64)
        table[slot, 2] = _signed64(block_hash >> 64)
    gathered = comm.all_gather(table.to(device), dim=0).cpu().view(-1, num_slots, 3)
    same = (gathered[:, :, 0] == 1).all(0) & (gathered == gathered[0]).all(2).all(0)
    agreed = {}
    for slot in torch.nonzero(same).flatten().tolist():
        _, low, high = gathered[0, slot].tolist()
        agreed[((high & _MASK64) << 64) | (low & _MASK64)] = slot
    return agreed


def threads_per_rank(tensor_parallel_size: int, requested: int | None) -> int:
    """The CPU's threads shared out between the ranks; an explicit smaller request wins."""
    share = max(1, (os.cpu_count() or 1) // tensor_parallel_size)
    return min(share, requested) if requested else share


class RankProcess:
    def __init__(self, spec: RankSpec) -> None:
        config = EngineConfig.from_kwargs(**spec.engine_args)
        parallel = config.parallel
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        here = tp_size * pp_size // parallel.nnodes  # the ranks on this host
        threads = threads_per_rank(here, config.device.num_threads)
        config = dataclasses.replace(
            config, device=dataclasses.replace(config.device, num_threads=threads)
        )
        self.rank = spec.rank  # in the grid: stage x tp_size + tensor-parallel rank
        stage, tp_rank = divmod(spec.rank, tp_size)
        device = config.device.resolve()
        local_rank = spec.rank if spec.local_rank < 0 else spec.local_rank
        if device == "cuda":
            torch.cuda.set_device(local_rank if spec.cuda_device < 0 else spec.cuda_device)
        tp_addresses, world_address = stage_addresses(spec.rendezvous, pp_size)
        timeout_s = parallel.distributed_timeout_s
        self.comm: Communicator = connect(device, tp_rank, tp_size, tp_addresses[stage], timeout_s)
        self.pipe = None
        stage_info = None
        if pp_size > 1:
            world = connect(device, spec.rank, tp_size * pp_size, world_address, timeout_s)
            self.pipe = PipelineLink(world, stage, pp_size, tp_size)
            stage_info = model_stages(config.model, pp_size, parallel.pipeline_layer_partition)[
                stage
            ]
        self.worker = Worker(config, comm=self.comm, stage=stage_info, pipe=self.pipe)
        self._everyone = self.pipe.world if self.pipe is not None else self.comm
        self.batch_ring = Ring.attach(spec.batch_ring, br.BATCH, blob_bytes_field="blob_bytes")
        self.reader = self.batch_ring.reader(local_rank)
        self.result_ring = None
        self.writer = None
        if spec.rank == (pp_size - 1) * tp_size:  # the last stage's first rank answers
            self.result_ring = Ring.attach(
                spec.result_ring, br.RESULT, blob_bytes_field="blob_bytes"
            )
            self.writer = self.result_ring.writer(full_timeout_s=RESULT_FULL_TIMEOUT_S)
        self.slab = TensorSlab.attach(spec.slab) if spec.slab else None
        self.decoder = br.BatchDecoder(self.slab)
        self.stats = StageStatsTable.attach(spec.stage_stats) if spec.stage_stats else None
        self._ring_wait_s = 0.0

    def serve(self) -> None:
        """Handle records until SHUTDOWN; an exception is reported (rank 0) and re-raised."""
        try:
            while True:
                started = time.perf_counter()
                records, blobs = self.reader.read_with_blobs(READ_BATCH_RECORDS, timeout_s=None)
                self._ring_wait_s += time.perf_counter() - started
                for record, blob in zip(records, blobs, strict=True):
                    if not self._handle(record, _EMPTY if blob is None else blob):
                        return
        except BaseException as exc:
            if self.writer is not None:
                self._report_error(f"tensor-parallel rank {self.rank}: {type(exc).__name__}: {exc}")
            raise

    def _handle(self, record: np.void, blob: np.ndarray) -> bool:
        kind = int(record["kind"])
        if kind == br.KIND_NEW:
            self.decoder.add_new(record, blob)
        elif kind == br.KIND_STEP:
            started = time.perf_counter()
            out = self.worker.execute(self.decoder.finish_step(record, blob))
            if self.stats is not None:  # before the answer: a reader of it sees the step
                self._count_step(time.perf_counter() - started)
            if self.writer is not None:
                self.writer.write_with_blob(*br.encode_output(out))
        elif kind == br.KIND_INIT_KV:
            self.worker.initialize_kv_cache(int(record["value"]))
            self._everyone.barrier()  # every rank of every stage
            if self.writer is not None:
                self.writer.write(br.encode_value(br.KIND_KV_READY))
        elif kind == br.KIND_INIT_TIERS:
            num_host_blocks, num_disk_slots, entries = self.worker.initialize_kv_tiers()
            agreed = agreed_disk_entries(
                self.pipe.world if self.pipe is not None else self.comm,
                entries,
                num_disk_slots,
                self.worker.runner.device,
            )
            if self.writer is not None:
                self.writer.write_with_blob(
                    *br.encode_tiers(num_host_blocks, num_disk_slots, agreed)
                )
        elif kind in (br.KIND_SLEEP, br.KIND_WAKE):
            if kind == br.KIND_SLEEP:
                self.worker.sleep(int(record["value"]))
            else:
                self.worker.wake_up(wake_tags(int(record["value"])))
            self._everyone.barrier()  # every rank of every stage
            if self.writer is not None:
                self.writer.write(br.encode_value(br.KIND_DONE))
        elif kind in (br.KIND_LORA_ADD, br.KIND_LORA_REMOVE):
            refused = ""
            try:
                if kind == br.KIND_LORA_ADD:
                    self.worker.add_lora(*br.decode_lora_add(record, blob))
                else:
                    self.worker.remove_lora(int(record["value"]))
            except ValueError as exc:  # an adapter that does not fit: told, not fatal
                refused = str(exc) or type(exc).__name__
            self._everyone.barrier()  # every rank of every stage
            if self.writer is not None:
                done = br.encode_value(br.KIND_DONE)
                if refused:
                    self.writer.write_with_blob(done, np.frombuffer(refused.encode(), np.uint8))
                else:
                    self.writer.write(done)
        elif kind == br.KIND_SHUTDOWN:
            return False
        else:
            raise ValueError(f"batch ring record kind {kind} is not one the ranks know")
        return True

    def _count_step(self, seconds: float) -> None:
        row = self.stats.rows[self.rank]
        pipe = self.pipe
        row["steps"] += 1
        row["step_s"] += seconds
        row["recv_wait_s"] = pipe.recv_wait_s
        row["send_wait_s"] = pipe.send_wait_s
        row["ring_wait_s"] = self._ring_wait_s
        row["bytes_sent"] = pipe.bytes_sent
        row["bytes_received"] = pipe.bytes_received

    def _report_error(self, message: str) -> None:
        try:
            self.writer.write_with_blob(*br.encode_error(message), timeout_s=1.0)
        except Exception:  # the engine core may be gone too; the exit code still tells
            logger.debug("could not report the error on the result ring", exc_info=True)

    def close(self) -> None:
        self.worker.shutdown()  # its disk KV tier flushed
        for ring in (self.batch_ring, self.result_ring, self.slab, self.stats):
            if ring is not None:
                ring.close()
        self.comm.close()
        if self.pipe is not None:
            self.pipe.close()


def run_rank(spec: RankSpec, ready_fd: int) -> None:
    """Process entry point: start up, say ready (with this rank's KV block count), serve."""
    die_with_parent()  # SIGTERM keeps its default action: a rank owns no segment to unlink
    with os.fdopen(ready_fd, "w") as ready:
        try:
            proc = RankProcess(spec)
            num_blocks = proc.worker.determine_num_blocks()
        except BaseException as exc:
            text = f"error {type(exc).__name__}: {exc}".replace("\n", " ")
            try:
                ready.write(text + "\n")
                ready.flush()
            except BrokenPipeError:  # the executor gave up on the group at another rank's error
                pass
            os._exit(1)  # nothing to unwind, and no traceback: the executor says why
        ready.write(f"ready {num_blocks}\n")
    forbid_pickle_if_asked("a tensor-parallel rank")
    freeze_heap()
    try:
        proc.serve()
    finally:
        proc.close()


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("RINGLLM_LOG_LEVEL", "WARNING"))
    run_rank(RankSpec.from_json(sys.argv[1]), int(sys.argv[2]))
