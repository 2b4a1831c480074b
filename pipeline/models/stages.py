"""Pipeline stages: which decoder layers one pipeline-parallel rank holds, and what it hands on.

Pipeline parallelism splits a model's L decoder layers into P contiguous stages; stage k
builds and runs only layers [start_layer, end_layer) (and the KV cache of those layers):

    stage 0                      stage 1                      stage P-1
    embed (+ vision tower)       layers [s1, e1)              layers [s, L)
    layers [0, e0)      ------>  ...               ------>    final norm, LM head
         IntermediateTensors(hidden, residual): [T, H] each, in the model dtype

What crosses a stage boundary is the decoder's running state between two layers. The
layers fuse the residual add into the next RMSNorm (ops.rms_norm(x, w, eps, residual)
returns norm(x + residual) and x + residual), so a layer ends with its MLP output
`hidden` and the residual stream *before* that output was added: the pair the next
layer's input norm takes. Handing over both (not their sum) lets the next stage run
exactly the operations the whole model would, so a chain of stages computes the same
bits as one model. The cost per step is 2 x T x H x dtype bytes (T: the step's tokens,
H: hidden size), e.g. 2 x 512 x 4096 x 2 = 8 MiB for a 512-token step of a bf16 7B model.

The even split is vLLM's (`vllm.distributed.utils.get_pp_indices`): L // P layers each,
and the L % P remaining layers one each to the stages before the last, counting back
from the second-to-last (the last stage holds the final norm and LM head; with P > 2 and
fewer leftovers than P - 1, the first stage, which holds the embedding, gets none too):
4 layers over 3 stages are 1, 2, 1; 5 are 2, 2, 1. An explicit split is a comma-separated
list of layer counts, one per stage (vLLM's VLLM_PP_LAYER_PARTITION), e.g. "10,12,10".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageInfo:
    """One pipeline stage: rank `rank` of `size`, decoder layers [start_layer, end_layer)."""

    rank: int
    size: int
    start_layer: int
    end_layer: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"pipeline stage: rank {self.rank} is not in [0, {self.size}) "
                f"(pipeline_parallel_size {self.size})"
            )
        if not 0 <= self.start_layer < self.end_layer:
            raise ValueError(
                f"pipeline stage {self.rank}: layers [{self.start_layer}, {self.end_layer}) "
                "hold no layer (a stage needs start_layer >= 0 and at least one layer)"
            )

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    @classmethod
    def whole(cls, num_layers: int) -> StageInfo:
        """The one stage of a model that is not split (pipeline_parallel_size 1)."""
        return cls(0, 1, 0, num_layers)


@dataclass
class IntermediateTensors:
    """What a stage that is not the last hands to the next: the decoder state between two
    layers, [T, H] each in the model dtype (see the module docstring for why two)."""

    hidden: torch.Tensor  # the last layer's MLP output (not yet added to the residual)
    residual: torch.Tensor  # the residual stream before `hidden` is added

    @property
    def nbytes(self) -> int:
        """Bytes sent to the next stage: 2 x T x H x dtype size."""
        return self.hidden.nbytes + self.residual.nbytes


def layer_partition(
    num_layers: int, pp_size: int, partition: str | None = None
) -> list[tuple[int, int]]:
    """[(start_layer, end_layer)] of each of `pp_size` stages over `num_layers` layers:
    even as vLLM splits them, or `partition`'s comma-separated layer counts."""
    if num_layers < 1:
        raise ValueError(f"num_hidden_layers: the model has {num_layers} layers; it needs >= 1")
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size: must be >= 1 stage, got {pp_size}")
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size: {pp_size} stages is more than the model's "
            f"{num_layers} layers (each stage needs at least one layer)"
        )
    if partition is None:
        counts = _even_counts(num_layers, pp_size)
    else:
        counts = _parse_counts(partition, num_layers, pp_size)
    ends = [sum(counts[: k + 1]) for k in range(pp_size)]
    return [(end - count, end) for count, end in zip(counts, ends, strict=True)]


def pipeline_stages(num_layers: int, pp_size: int, partition: str | None = None) -> list[StageInfo]:
    """Every stage's StageInfo (rank k is element k), from `layer_partition`."""
    bounds = layer_partition(num_layers, pp_size, partition)
    return [StageInfo(k, pp_size, start, end) for k, (start, end) in enumerate(bounds)]


def _even_counts(num_layers: int, pp_size: int) -> list[int]:
    counts = [num_layers // pp_size] * pp_size
    for k in range(num_layers % pp_size):  # second-to-last stage first, then backwards
        counts[pp_size - 2 - k] += 1
    return counts


def _parse_counts(partition: str, num_layers: int, pp_size: int) -> list[int]:
    what = f"pipeline_layer_partition {partition!r}"
    try:
        counts = [int(part) for part in partition.split(",")]
    except ValueError:
        raise ValueError(
            f"{what}: not a comma-separated list of layer counts (integers, e.g. '10,10,12')"
        ) from None
    if len(counts) != pp_size:
        raise ValueError(
            f"{what}: {len(counts)} entries for pipeline_parallel_size {pp_size} "
            "(one layer count per stage)"
        )
    empty = [k for k, count in enumerate(counts) if count < 1]
    if empty:
        raise ValueError(
            f"{what}: stage {empty[0]} gets {counts[empty[0]]} layers; each needs >= 1"
        )
    if sum(counts) != num_layers:
        raise ValueError(f"{what}: adds up to {sum(counts)} layers, the model has {num_layers}")
    return counts
