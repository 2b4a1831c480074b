"""`RayExecutor` (`--distributed-executor-backend ray`): the worker ranks as Ray actors in a
placement group, one bundle per rank, on the Ray cluster RAY_ADDRESS names (`ray start
--head` on one host, `ray start --address HEAD:PORT` on the others), or on a local Ray
instance started here when none is named.

Everything after placement is the multiproc executor's (pipeline/executor/multiproc.py): the same
batch ring on the head's host, the same records, the same liveness rules. What Ray changes:

    placement   one bundle per rank ({"CPU": --num-threads or 1}, or {"GPU": 1, "CPU": 1}
                on GPUs), strategy PACK; the ranks are numbered host by host, the head's
                (the engine core's host) first, so a host's ranks are contiguous and TP
                groups stay inside a host as far as the bundles allow
    ranks       `_RankActor`s, each a RankProcess (rank_process.py) in its actor's
                process; their `serve` call is what liveness watches (`_ActorProc`)
    other hosts a `_RelayActor` on each (no CPU of its own, pinned to the host) holds that
                host's rings and relays the records to and from the head over a NodeLink,
                as the headless agent does (node_agent.HostRelay)
    rendezvous  the head's TCPStore on its Ray node address, on a port the OS gives

Teardown kills the actors, removes the placement group, and stops the local Ray instance
if this executor started it. Ray is optional (`pip install ringllm[ray]`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import threading

from ringllm.pipeline.config import EngineConfig, config_to_dict
from ringllm.pipeline.executor.host_agent import HostRelay
from ringllm.pipeline.executor.host_link import HELLO, READY, NodeLink
from ringllm.pipeline.executor.launch import POLL_S, START_TIMEOUT_S, wait_ready
from ringllm.pipeline.executor.multiproc import MultiprocExecutor
from ringllm.pipeline.executor.placement import NodeLayout
from ringllm.pipeline.executor.rank_process import RankSpec
from ringllm.pipeline.executor.remote_hosts import RemoteNodes

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
PLACEMENT_STRATEGY = "PACK"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend: ray is not installed: pip install 'ringllm[ray]'"
        ) from None
    return ray


class _RankActor:
    """One rank in a Ray actor's process (made a Ray actor class at run time)."""

    def start(self, spec_json: str) -> tuple[str, int]:
        """("ready <num_blocks>" or "error <type>: <message>", this process's pid)."""
        from ringllm.pipeline.executor.rank_process import RankProcess

        try:
            self.proc = RankProcess(RankSpec.from_json(spec_json))
            return f"ready {self.proc.worker.determine_num_blocks()}", os.getpid()
        except BaseException as exc:  # noqa: BLE001 - told to the executor, as a ready pipe
            return f"error {type(exc).__name__}: {exc}".replace("\n", " "), os.getpid()

    def serve(self) -> None:
        try:
            self.proc.serve()
        finally:
            self.proc.close()


class _RelayActor:
    """A host's rings and its relay to the head (no rank of its own)."""

    def __init__(self, layout_fields: dict) -> None:
        self.relay = HostRelay(NodeLayout(**layout_fields))

    def rings(self) -> tuple[str, str]:
        relay = self.relay
        return relay.batch_ring.name, relay.result_ring.name if relay.result_ring else ""

    def run(self, relay_address: str, token: str) -> None:
        host, _, port = relay_address.rpartition(":")
        link = NodeLink.dial(host, int(port), "the head", timeout_s=10.0)
        try:
            link.send(HELLO, f"{self.relay.layout.node_rank} {token}".encode())
            link.send(READY, b"ready 0")  # the relay is up; the ranks say their own
            self.relay.relay(link, threading.Event())
        finally:
            self.relay.close_rings()
            link.close(bye=True)


class _ActorProc:
    """A rank actor where the executor expects a process: poll / wait / kill / pid."""

    def __init__(self, ray, actor, pid: int, serve_ref) -> None:
        self._ray = ray
        self.actor = actor
        self.pid = pid
        self._ref = serve_ref
        self._code: int | None = None

    def poll(self) -> int | None:
        if self._code is None:
            ready, _ = self._ray.wait([self._ref], timeout=0)
            if ready:
                try:
                    self._ray.get(ready[0])
                    self._code = 0
                except self._ray.exceptions.RayActorError:
                    self._code = -9  # its process died
                except Exception:  # noqa: BLE001 - the rank raised: it ended with an error
                    self._code = 1
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = self._ray.wait([self._ref], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"rank actor {self.pid}", timeout)
        return self.poll()

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)


class RayExecutor(MultiprocExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self._ray = ray = _import_ray()
        self._started_ray = False
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            self._started_ray = address is None
        self._pg = None
        self._relays: list = []
        try:
            super().__init__(config)
        except BaseException:
            self._release()
            raise

    # ---- placement ---------------------------------------------------------------------

    def _place(self):
        from ray.util.placement_group import placement_group, placement_group_table

        ray, config = self._ray, self.config
        world = self.tp_size
        cpus = config.device.num_threads or 1
        bundle = {"GPU": 1, "CPU": 1} if config.device.resolve() == "cuda" else {"CPU": cpus}
        self._bundle_cpus = bundle["CPU"]
        self._pg = placement_group(
            [dict(bundle) for _ in range(world)], strategy=PLACEMENT_STRATEGY
        )
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(
                f"distributed_executor_backend ray: the cluster cannot hold {world} bundles "
                f"of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s (it has "
                f"{ray.cluster_resources()}); lower the sizes or add hosts"
            )
        node_of_bundle = placement_group_table(self._pg)["bundles_to_node_id"]
        head = ray.get_runtime_context().get_node_id()
        if head not in node_of_bundle.values():
            raise ValueError(
                "distributed_executor_backend ray: no rank was placed on the engine core's "
                "host; start the engine on a host with room for a rank"
            )
        nodes = [head] + sorted(set(node_of_bundle.values()) - {head})
        self._bundle_of = sorted(range(world), key=lambda b: (nodes.index(node_of_bundle[b]), b))
        self._node_ids = nodes
        sizes = [sum(1 for n in node_of_bundle.values() if n == node) for node in nodes]
        layout = NodeLayout.of(config.parallel).with_sizes(sizes)
        remote = None
        if len(nodes) > 1:
            if self._info.num_image_tokens:
                raise ValueError(
                    "a model that takes images cannot span hosts yet (the pixel values "
                    "travel in this host's shared memory)"
                )
            parallel = dataclasses.replace(
                config.parallel,
                master_addr=ray.util.get_node_ip_address(),
                master_port=_free_port(),
            )
            self.config = dataclasses.replace(config, parallel=parallel)
            remote = RemoteNodes(layout, parallel)
        logger.info("Ray placed %d rank(s) on %d host(s): %s per host", world, len(nodes), sizes)
        return layout, remote

    # ---- start-up ----------------------------------------------------------------------

    def _start_ranks(self) -> list[int]:
        from ray.util.scheduling_strategies import (
            NodeAffinitySchedulingStrategy,
            PlacementGroupSchedulingStrategy,
        )

        ray, ranks, layout = self._ray, self._ranks, self.layout
        rings = {0: (ranks.batch_ring.name, ranks.result_ring.name)}
        relay_class = ray.remote(num_cpus=0)(_RelayActor)
        for node in range(1, layout.nnodes):
            here = layout.for_node(node)
            relay = relay_class.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_ids[node], soft=False)
            ).remote(dataclasses.asdict(here))
            rings[node] = ray.get(relay.rings.remote())
            self._relays.append(
                (relay, relay.run.remote(ranks.remote.relay_address, ranks.remote.token))
            )
        engine_args = config_to_dict(self.config)
        engine_args["num_threads"] = self._bundle_cpus
        rank_class = ray.remote(_RankActor)
        actors, starts = [], []
        for rank in range(layout.world_size):
            node = layout.node_of(rank)
            local = rank - layout.for_node(node).local_ranks[0]
            batch, result = rings[node]
            spec = RankSpec(
                engine_args,
                rank,
                ranks.rendezvous.address,
                batch,
                result,
                ranks.slab.name if node == 0 and ranks.slab is not None else "",
                ranks.stats.name if node == 0 and ranks.stats is not None else "",
                local,
                cuda_device=0,  # Ray shows each GPU actor its one device
            )
            actor = rank_class.options(
                num_cpus=self._bundle_cpus,
                num_gpus=1 if self.config.device.resolve() == "cuda" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=self._bundle_of[rank]
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(self._bundle_cpus)}},
            ).remote()
            actors.append(actor)
            starts.append(actor.start.remote(spec.to_json()))
        self._ranks.cleanups.append(self._release)
        return self._wait_started(actors, starts)

    def _wait_started(self, actors, starts) -> list[int]:
        """The rank actors' KV block counts once each said ready (executor/launch.py), and the
        other hosts' relays dialled in; the actors then serve."""
        ray, remote = self._ray, self._ranks.remote
        results: dict[int, tuple[str, int]] = {}  # index: (ready line, the actor's pid)

        def poll(waiting: list[int]) -> dict[int, str]:
            pending = [starts[index] for index in waiting]
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                index = starts.index(ref)
                try:
                    results[index] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise RuntimeError(
                        f"rank {index}'s Ray actor died while starting: {exc}"
                    ) from None
            return {starts.index(ref): results[starts.index(ref)][0] for ref in done}

        def expired(missing: list[int]) -> str:
            if missing:
                return f"rank actors did not start within {START_TIMEOUT_S:.0f} s"
            return f"hosts {remote.missing()}' relays did not connect"

        blocks = wait_ready(
            poll,
            len(starts),
            expired,
            before=remote.poll_start if remote is not None else lambda: None,
            others_ready=lambda: remote is None or remote.ready_blocks() is not None,
        )
        for actor, (_, pid) in zip(actors, (results[i] for i in range(len(starts))), strict=True):
            self._ranks.procs.append(_ActorProc(ray, actor, pid, actor.serve.remote()))
        return blocks

    # ---- the end -------------------------------------------------------------------------

    def _release(self) -> None:
        """Relays and placement group gone; the local Ray instance stopped if ours."""
        ray = self._ray
        for relay, _ in self._relays:
            try:
                ray.kill(relay, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._relays = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                logger.debug("removing the placement group failed", exc_info=True)
            self._pg = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            self._started_ray = False


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
