"""`MultiprocExecutor`: the engine core's side of tensor parallelism. It stands where the in-process
`Worker` stands (`execute`, `determine_num_blocks`, `initialize_kv_cache`) and drives N rank
processes over two rings:

    engine core ── batch ring (broadcast, 1 writer -> N readers) ──> rank 0 .. rank N-1
         ^                NEW* STEP | INIT_KV | SHUTDOWN                  |  all run
         |                                                                |  Worker.execute
         └──────────── result ring (SPSC) <── rank 0: OUTPUT | NUM... ────┘  (gloo / NCCL)

Start-up: make the rendezvous and both rings, start the ranks (fresh interpreters, see
pipeline/executor/rank_process.py), then read each rank's ready pipe: "ready <num_blocks>" or
"error ...". The KV pool is the smallest count any rank can hold, so every rank agrees.

Liveness: every wait (ready pipes, a full batch ring, the result ring) wakes at least
every `POLL_S` and checks every rank's process. A dead rank, or one that reports an error,
ends the executor: the other ranks are stopped, the rings and the rendezvous removed, and
this and every later call raise `EngineDeadError` naming the rank, its pid and how it
ended. Nothing hangs on a dead rank. Another host lost (remote_hosts.py: its link closed or
silent) is `HostLostError`, named before any rank here that its loss broke: the cause.

Batches in flight (pipeline stages): `submit` writes a step's records and returns; `collect`
takes the oldest submitted step's answer (the last stage answers in the order the steps
were sent). The engine core keeps up to `max_concurrent_batches` (the number of stages)
submitted at once, so each stage works on a different batch; `execute` is the two at once.

Shutdown: SHUTDOWN on the batch ring, a short wait, then SIGKILL for any rank still there;
the rings are unlinked and the rendezvous removed. It also runs at interpreter exit if the
owner never called it, and the ranks die with this process in any case (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import time
import weakref

import numpy as np

from ringllm.ipc.errors import IpcError
from ringllm.ipc.ring import Ring
from ringllm.ipc.tensor_slab import TensorSlab, TensorSlabFullError
from ringllm.pipeline.config import EngineConfig, config_to_dict
from ringllm.pipeline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ringllm.pipeline.errors import EngineDeadError, HostLostError
from ringllm.pipeline.executor import batch_records as br
from ringllm.pipeline.executor.launch import (
    POLL_S,
    START_TIMEOUT_S,
    pipe_lines,
    start_rank,
    wait_ready,
)
from ringllm.pipeline.executor.placement import NodeLayout
from ringllm.pipeline.executor.process_groups import Rendezvous
from ringllm.pipeline.executor.rank_process import RankSpec, threads_per_rank
from ringllm.pipeline.executor.remote_hosts import RemoteNodes
from ringllm.pipeline.executor.stage_stats import StageStatsTable
from ringllm.pipeline.messages import wake_bits
from ringllm.pipeline.models.hf_config import load_arch_config
from ringllm.pipeline.models.registry import model_class
from ringllm.pipeline.worker.model_loader import (
    model_stages,
    resolve_max_model_len,
    resolve_model_path,
)
from ringllm.pipeline.worker.worker import WorkerInfo, encoder_only, image_fields, layer_windows

logger = logging.getLogger(__name__)

BATCH_RING_CAPACITY = 1024
RESULT_RING_CAPACITY = 4096
SHUTDOWN_WAIT_S = 5.0
ERROR_SETTLE_S = 2.0
HOST_SETTLE_S = 0.5  # a rank's error, and the other host's link that closed with it
# a step's new images' pixel values (freed after the step; touched only as used)
TP_MM_SLAB_BYTES = 256 << 20


def model_info(config: EngineConfig) -> WorkerInfo:
    """What the engine core needs of the model, read from its config (no weight loaded)."""
    path = resolve_model_path(config.model.model)
    arch = load_arch_config(path)
    arch = model_class(arch.architecture).adapt_config(arch)
    max_model_len = resolve_max_model_len(config.model.max_model_len, arch)
    return WorkerInfo(
        path,
        max_model_len,
        arch.vocab_size,
        arch.eos_token_ids,
        *image_fields(arch),
        layer_windows=layer_windows(arch),
        encoder_only=encoder_only(arch),
    )


class _Ranks:
    """The processes, rings and rendezvous of one executor; torn down once, from any path."""

    def __init__(
        self, rendezvous: Rendezvous, batch_ring: Ring, result_ring: Ring, slab=None, stats=None
    ) -> None:
        self.rendezvous = rendezvous
        self.batch_ring = batch_ring
        self.result_ring = result_ring
        self.slab = slab  # images' pixel values on their way to the ranks
        self.stats = stats  # pipeline stages: what each rank's steps cost
        self.remote = None  # the other hosts (remote_hosts.py), with nnodes > 1
        self.cleanups: list = []  # run last in teardown (the Ray executor's)
        self.writer = batch_ring.writer()
        self.procs: list[subprocess.Popen] = []
        self.closed = False

    def teardown(self, graceful: bool) -> None:
        if self.closed:
            return
        self.closed = True
        # With a rank gone the others cannot finish a step: nothing to wait for.
        graceful = graceful and all(p.poll() is None for p in self.procs)
        if graceful:
            try:
                self.writer.write(br.encode_shutdown(), timeout_s=1.0)
            except IpcError:
                pass
        if self.remote is not None:  # their agents stop their ranks
            self.remote.close(br.encode_shutdown() if graceful else None)
        deadline = time.monotonic() + (SHUTDOWN_WAIT_S if graceful else 0.0)
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ring in (self.batch_ring, self.result_ring, self.slab, self.stats):
            if ring is not None:
                ring.close()
        self.rendezvous.close()
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - the rest is still cleaned up
                logger.exception("executor clean-up failed")


def _remote_nodes(layout: NodeLayout, parallel, info: WorkerInfo):
    """The other hosts' side (None with one host); what several hosts cannot do yet is
    refused here, before anything starts."""
    if layout.nnodes == 1:
        return None
    if layout.node_rank != 0:
        raise ValueError(
            f"node_rank: {layout.node_rank} runs no engine core; start that host with "
            "`ringllm serve --headless` (only node rank 0, the head, serves)"
        )
    if info.num_image_tokens:
        raise ValueError(
            "nnodes: a model that takes images cannot span hosts yet (the pixel values "
            "travel in this host's shared memory)"
        )
    return RemoteNodes(layout, parallel)


def _check_devices(device: str, parallel) -> None:
    """On GPUs rank r (stage x T + tensor-parallel rank) runs on cuda:r: refuse a grid the
    visible devices cannot hold."""
    if device != "cuda":
        return
    import torch

    pp, tp = parallel.pipeline_parallel_size, parallel.tensor_parallel_size
    ranks = pp * tp // parallel.nnodes  # this host's
    visible = torch.cuda.device_count()
    if visible < ranks:
        grid = f"{pp} pipeline stages x {tp} tensor-parallel ranks" if pp > 1 else f"{tp}"
        if parallel.nnodes > 1:
            grid += f" over {parallel.nnodes} hosts: {ranks} of them here, so"
        raise ValueError(
            f"tensor_parallel_size: {grid} ranks need {ranks} CUDA devices (one each), "
            f"{visible} visible; lower it or expose more devices (CUDA_VISIBLE_DEVICES)"
        )


def _check_pipeline(config: EngineConfig, device: str) -> None:
    """Pipeline stages: a partition that fits the model (model_stages raises a ValueError
    naming the problem); on GPUs one device per rank (`_check_devices`), on the CPU no more
    ranks than four per core (a CPU machine runs them all at once; past that it only
    thrashes)."""
    parallel = config.parallel
    pp = parallel.pipeline_parallel_size
    if pp == 1:
        return
    model_stages(config.model, pp, parallel.pipeline_layer_partition)
    if device == "cuda":
        return
    ranks = pp * parallel.tensor_parallel_size * parallel.data_parallel_size
    cores = os.cpu_count() or 1
    if ranks > 4 * cores:
        raise ValueError(
            f"pipeline_parallel_size: {pp} stages x {parallel.tensor_parallel_size} tensor-"
            f"parallel x {parallel.data_parallel_size} data-parallel = {ranks} worker "
            f"processes on {cores} CPU cores; at most {4 * cores} (4 a core) make sense"
        )


def _make_ranks(
    device: str, tp_size: int, images: bool = False, num_stages: int = 1, remote=None
) -> _Ranks:
    """The rendezvous (`remote`: the other hosts' store), both rings (the batch ring read by
    this host's ranks only), (`images`) the tensor slab and (pipeline stages) the
    stage-stats table; what was made is removed again if a later part fails."""
    made: list = []
    local = tp_size if remote is None else remote.layout.local_count
    try:
        made.append(Rendezvous.create(device, num_stages) if remote is None else remote)
        made.append(
            Ring.create(
                "tp-batch", br.BATCH, BATCH_RING_CAPACITY, local, blob_bytes_field="blob_bytes"
            )
        )
        made.append(
            Ring.create(
                "tp-result", br.RESULT, RESULT_RING_CAPACITY, 1, blob_bytes_field="blob_bytes"
            )
        )
        made.append(TensorSlab.create(TP_MM_SLAB_BYTES, kind="tp-mm") if images else None)
        made.append(StageStatsTable.create(tp_size) if num_stages > 1 else None)
        return _Ranks(*made)
    except BaseException:
        for thing in reversed(made):
            if thing is not None:
                thing.close()
        raise


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parallel = config.parallel
        # ranks in a grid: stage x tensor_parallel_size + tensor-parallel rank
        self.tp_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        device = config.device.resolve()
        _check_devices(device, parallel)
        _check_pipeline(config, device)
        self._info = model_info(config)
        self._dead: str | None = None
        self._host_lost = False  # _dead says which host
        pp = parallel.pipeline_parallel_size
        self.layout, remote = self._place()
        self._ranks = _make_ranks(device, self.tp_size, self._info.num_image_tokens > 0, pp, remote)
        self._finalizer = weakref.finalize(self, self._ranks.teardown, False)
        self.encoder = br.BatchEncoder(self._ranks.slab)
        # the steps submitted and not collected: their request ids and their images' tags
        self._in_flight: collections.deque[tuple[list[str], list[int]]] = collections.deque()
        self.max_concurrent_batches = pp
        self.writer = self._ranks.writer
        try:
            self.reader = self._ranks.result_ring.reader(0)
            if remote is not None:
                remote.start(config_to_dict(self.config))
                self._ranks.remote = remote
            num_blocks = self._start_ranks()
            if remote is not None:
                remote.run(None if self.layout.answers_here else self._ranks.result_ring.writer())
        except BaseException:
            self._ranks.teardown(graceful=False)
            self._finalizer.detach()
            raise
        self._num_blocks = min(num_blocks)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._ranks.procs]

    # ---- start-up --------------------------------------------------------------------

    def _place(self):
        """Which host runs which rank (NodeLayout), and the other hosts' side (None: one
        host); the Ray executor places them by a placement group instead."""
        layout = NodeLayout.of(self.config.parallel)
        return layout, _remote_nodes(layout, self.config.parallel, self._info)

    def _start_ranks(self) -> list[int]:
        ranks = self._ranks
        engine_args = config_to_dict(self.config)
        env = dict(os.environ)
        here = self.layout.local_count  # this host's ranks share its cores
        env["OMP_NUM_THREADS"] = str(threads_per_rank(here, self.config.device.num_threads))
        pipes = []
        try:
            for local, rank in enumerate(self.layout.local_ranks):
                spec = RankSpec(
                    engine_args,
                    rank,
                    ranks.rendezvous.address,
                    ranks.batch_ring.name,
                    ranks.result_ring.name,
                    ranks.slab.name if ranks.slab is not None else "",
                    ranks.stats.name if ranks.stats is not None else "",
                    local,
                )
                pipes.append(self._spawn(spec, env))
            return self._wait_ready(pipes)
        finally:
            for pipe in pipes:
                pipe.close()

    def _spawn(self, spec: RankSpec, env: dict[str, str]):
        """Start one rank (a fresh interpreter); returns the read end of its ready pipe."""
        proc, pipe = start_rank(spec, env)
        self._ranks.procs.append(proc)
        return pipe

    def _wait_ready(self, pipes: list) -> list[int]:
        """Each rank's KV block count (each other host's: the least of its ranks'), once all
        are ready (executor/launch.py); a rank's liveness is checked on a poll that read no
        ready line."""
        remote = self._ranks.remote

        def expired(missing: list[int]) -> str:
            hosts = remote.missing() if remote is not None else []
            return (
                f"tensor-parallel ranks {missing} (of this host) and hosts {hosts} did "
                f"not start within {START_TIMEOUT_S:.0f} s"
            )

        local = wait_ready(
            pipe_lines(pipes),
            len(pipes),
            expired,
            before=remote.poll_start if remote is not None else lambda: None,
            after=lambda read_any: None if read_any else self._check_ranks(),
            others_ready=lambda: remote is None or remote.ready_blocks() is not None,
        )
        return local + (remote.ready_blocks() if remote is not None else [])

    # ---- the Executor surface (pipeline/executor/interface.py) ----------------------------

    def info(self) -> WorkerInfo:
        return self._info

    def determine_num_blocks(self) -> int:
        return self._num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._send(br.encode_init_kv(num_blocks), None)
        record, _ = self._take_result()
        if int(record["kind"]) != br.KIND_KV_READY:
            raise self._die(
                f"rank 0 answered KV-cache set-up with record kind {int(record['kind'])}"
            )

    def initialize_kv_tiers(self) -> tuple[int, int, dict[int, int]]:
        """Every rank makes its host (and disk) tier; the disk entries are those every
        rank's file verified alike (rank_process.agreed_disk_entries)."""
        self._send(br.encode_init_tiers(), None)
        record, blob = self._take_result()
        if int(record["kind"]) != br.KIND_TIERS:
            raise self._die(
                f"rank 0 answered KV-tier set-up with record kind {int(record['kind'])}"
            )
        return br.decode_tiers(record, blob)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect()

    def submit(self, sched: SchedulerOutput) -> None:
        """Sends a step to the ranks without waiting for its answer (`collect`)."""
        try:
            messages = self.encoder.encode(sched)
        except TensorSlabFullError:
            self.encoder.free_images(self.encoder.take_step_images())
            raise  # this step's requests are taken back and run fewer at a time
        self._in_flight.append((list(sched.num_scheduled_tokens), self.encoder.take_step_images()))
        for record, blob in messages:
            self._send(record, blob)

    def collect(self) -> ModelRunnerOutput:
        """The answer to the oldest step submitted and not yet collected."""
        if not self._in_flight:
            raise RuntimeError("collect: no step is in flight")
        record, blob = self._take_result()
        req_ids, image_tags = self._in_flight.popleft()
        self.encoder.free_images(image_tags)  # every rank copied them out reading its NEW
        if int(record["kind"]) != br.KIND_OUTPUT:
            raise self._die(f"rank 0 answered a step with record kind {int(record['kind'])}")
        return br.decode_output(record, blob, req_ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def stage_stats(self) -> list[dict[str, float]]:
        """Each rank's step costs (executor/stage_stats.py); [] without pipeline stages."""
        stats = self._ranks.stats
        return stats.snapshot() if stats is not None and not self._ranks.closed else []

    def sleep(self, level: int) -> None:
        self._command(br.encode_command(br.KIND_SLEEP, level), what="sleep")

    def wake_up(self, tags=None) -> None:
        self._command(br.encode_command(br.KIND_WAKE, wake_bits(tags)), what="wake-up")

    def add_lora(self, lora_id: int, path: str, name: str = "") -> None:
        """Every rank reads its shard of the adapter; ValueError (the ranks' reason, the
        same on each: they read the same files) when it does not fit."""
        self._command(*br.encode_lora_add(lora_id, path, name), what="lora load")

    def remove_lora(self, lora_id: int) -> bool:
        self._command(br.encode_command(br.KIND_LORA_REMOVE, lora_id), what="lora unload")
        return True

    def _command(self, record: np.ndarray, blob: np.ndarray | None = None, what: str = "") -> None:
        self._send(record, blob)
        answer, blob = self._take_result()
        if int(answer["kind"]) != br.KIND_DONE:
            raise self._die(f"rank 0 answered a {what} with record kind {int(answer['kind'])}")
        if blob is not None and np.asarray(blob).size:  # refused (a LoRA adapter's reason)
            raise ValueError(bytes(np.asarray(blob)).decode(errors="replace"))

    def check_alive(self) -> None:
        """EngineDeadError if a rank or another host is gone: the engine core asks while it
        is idle, so a loss is noticed (and /health says so) before the next request."""
        self._check_usable()
        self._check_ranks()

    def shutdown(self) -> None:
        self._ranks.teardown(graceful=self._dead is None)
        self._finalizer.detach()

    # ---- rings and liveness ------------------------------------------------------------

    def _send(self, record: np.ndarray, blob: np.ndarray | None) -> None:
        self._check_usable()
        try:
            if blob is None or blob.size == 0:
                self.writer.write(record)
            else:
                self.writer.write_with_blob(record, blob)
            if self._ranks.remote is not None:
                self._ranks.remote.send(record, blob)
        except (IpcError, ConnectionError) as exc:
            self._check_ranks()
            raise self._die(f"sending the step failed: {exc}") from exc

    def _take_result(self) -> tuple[np.void, np.ndarray]:
        self._check_usable()
        while True:
            try:
                records, blobs = self.reader.read_with_blobs(1, timeout_s=POLL_S)
            except IpcError as exc:
                self._check_ranks()
                raise self._die(f"the result ring failed: {exc}") from exc
            if len(records):
                break
            self._check_ranks()
        record, blob = records[0], blobs[0]
        blob = np.zeros(0, np.uint8) if blob is None else blob
        if int(record["kind"]) == br.KIND_ERROR:
            raise self._rank_error(blob.tobytes().decode(errors="replace"))
        return record, blob

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise (HostLostError if self._host_lost else EngineDeadError)(self._dead)

    def _check_ranks(self) -> None:
        """Raise EngineDeadError if any rank has exited, or another host is gone (first:
        a rank here that exits on the collective a lost host broke is not the cause)."""
        self._check_hosts()
        report = self._exited_ranks()
        if report:
            raise self._die(f"tensor-parallel worker {report}", pid=self._first_exited_pid())

    def _check_hosts(self) -> None:
        remote = self._ranks.remote
        gone = remote.check() if remote is not None else None
        if gone:
            raise self._die(f"a worker host is gone: {gone}", lost=remote.lost)

    def _exited_ranks(self) -> str:
        """'rank 1 (pid 7) died (killed by SIGKILL); ...', ranks killed by a signal first
        (the cause; the others usually exit on the broken collective it leaves)."""
        exited = [(rank, p, p.poll()) for rank, p in enumerate(self._ranks.procs)]
        exited = sorted((e for e in exited if e[2] is not None), key=lambda e: e[2] >= 0)
        return "; ".join(
            f"rank {rank} (pid {proc.pid}) died ({_how_it_ended(code)})"
            for rank, proc, code in exited
        )

    def _first_exited_pid(self) -> int:
        return next((p.pid for p in self._ranks.procs if p.poll() is not None), 0)

    def _rank_error(self, message: str) -> EngineDeadError:
        """Rank 0 reported an exception. Every rank is going down with it (a broken
        collective ends the others); give them a moment so a rank's death is named as the cause."""
        remote = self._ranks.remote
        settled = time.monotonic() + HOST_SETTLE_S
        while remote is not None and remote.check() is None and time.monotonic() < settled:
            time.sleep(POLL_S / 2)  # a host's end races the error it caused here
        try:
            self._check_hosts()  # a collective broken by a lost host: the host is the cause
        except HostLostError as exc:
            return exc
        deadline = time.monotonic() + ERROR_SETTLE_S
        for proc in self._ranks.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        report = self._exited_ranks()
        return self._die(f"tensor-parallel worker {report}: {message}" if report else message)

    def _die(self, reason: str, pid: int = 0, lost: str | None = None) -> EngineDeadError:
        """Stop every rank and remove the rings; the error to raise now and on every later
        call (`lost`: another host is gone, HostLostError with that text)."""
        self._dead = (
            lost or f"{reason}; the engine cannot continue without all its ranks: restart it"
        )
        self._host_lost = lost is not None
        logger.error("%s", f"{reason}: {lost}" if lost else self._dead)
        self._ranks.teardown(graceful=False)
        self._finalizer.detach()
        if lost is not None:
            return HostLostError(lost, peer="worker host")
        return EngineDeadError(self._dead, peer="tensor-parallel worker", pid=pid)


def _how_it_ended(exit_code: int) -> str:
    if exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    return f"exit code {exit_code}"
