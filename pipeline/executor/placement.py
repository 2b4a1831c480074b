"""Worker ranks on several hosts: which host runs which rank, and how the hosts meet.

Placement. The P x T grid's global ranks (stage x T + tensor-parallel rank) are shared out
in order, `ranks_per_node = P x T / nnodes` to a host: host n runs global ranks
[n x ranks_per_node, (n + 1) x ranks_per_node) (with Ray, as many in order as its
placement group put on each host, the head's first). So a tensor-parallel group stays inside one
host whenever T divides ranks_per_node (TP's all-reduces, one per layer, never cross the
network), and pipeline stages are what spans hosts (one send of the hidden states per
stage boundary per step). With T larger than ranks_per_node a TP group spans hosts: allowed
(it is what a host with too few devices needs), and much slower.

Rendezvous. The head (node rank 0) hosts a torch.distributed TCPStore on
`master_addr:master_port`; every rank of every host joins its groups through it (a
PrefixStore per group), with gloo bound to the address of its host that routes to the head
(`local_address`). The batch records reach the other hosts over one TCP connection per
host (pipeline/executor/host_link.py), never through the store.

Ports to open between the hosts: master_port (the store), the head's relay port (chosen by
the OS, published in the store) and gloo's ports (chosen by the OS on each host), all TCP.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ringllm.pipeline.config import ParallelConfig


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int
    node_rank: int
    world_size: int  # P x T ranks over all hosts
    answer_rank: int  # the last stage's first rank: it answers every step
    sizes: tuple[int, ...] = ()  # ranks per host, in host order (empty: an even share)

    @classmethod
    def of(cls, parallel: ParallelConfig, node_rank: int | None = None) -> NodeLayout:
        world = parallel.pipeline_parallel_size * parallel.tensor_parallel_size
        return cls(
            parallel.nnodes,
            parallel.node_rank if node_rank is None else node_rank,
            world,
            (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size,
        )

    def with_sizes(self, sizes: list[int], node_rank: int = 0) -> NodeLayout:
        """The layout of ranks placed unevenly (Ray's placement group): `sizes[n]` ranks
        on host n, in order."""
        if sum(sizes) != self.world_size or min(sizes) < 1:
            raise ValueError(f"placement: {sizes} ranks per host for {self.world_size} ranks")
        return NodeLayout(len(sizes), node_rank, self.world_size, self.answer_rank, tuple(sizes))

    def _sizes(self) -> tuple[int, ...]:
        return self.sizes or (self.world_size // self.nnodes,) * self.nnodes

    @property
    def local_count(self) -> int:
        return self._sizes()[self.node_rank]

    def node_of(self, rank: int) -> int:
        end = 0
        for node, size in enumerate(self._sizes()):
            end += size
            if rank < end:
                return node
        raise ValueError(f"rank {rank} is not one of the {self.world_size}")

    @property
    def local_ranks(self) -> list[int]:
        first = sum(self._sizes()[: self.node_rank])
        return list(range(first, first + self.local_count))

    def for_node(self, node_rank: int) -> NodeLayout:
        return NodeLayout(self.nnodes, node_rank, self.world_size, self.answer_rank, self.sizes)

    @property
    def answers_here(self) -> bool:
        return self.node_of(self.answer_rank) == self.node_rank


def store_address(parallel: ParallelConfig) -> str:
    """The rendezvous address ranks on several hosts are given: tcp://HOST:PORT."""
    return f"tcp://{parallel.master_addr}:{parallel.master_port}"


def parse_store_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a tcp:// rendezvous address; None for anything else (a FileStore)."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host, int(port)


def local_address(master_addr: str) -> str:
    """This host's address on the route to `master_addr` (what gloo binds, so that the
    other hosts reach it): the source address the kernel picks, found without sending
    anything (a UDP socket's connect only looks the route up)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))
        except OSError as exc:
            raise ValueError(
                f"master_addr: no route from this host to {master_addr!r} ({exc})"
            ) from None
        return probe.getsockname()[0]
