"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral, the Llama decoder with its MLP
replaced, on the sparse layers, by a router and E experts (gated MLPs):

    h [T, H] -> router logits [T, E] -> softmax (float32) -> top k experts per token
             (-> their weights renormalized to sum 1: Mixtral always, Qwen3-MoE where
             config.json's `norm_topk_prob` says)
             -> out[t] = sum over t's k experts e of  weight[t, e] * down_e(act(gate_up_e(h[t])))

as transformers' Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock compute it.

The experts run grouped (`MoeWeights.forward`): the T * k (token, expert) pairs are sorted
by expert once, the rows of h gathered in that order once, each expert multiplies its
contiguous run of rows (one product per expert that has rows: no Python per token), the
results are scaled by their routing weights and added into their tokens' rows by one
`index_add_`. Every expert's matrices are ordinary weights (models/linear.py), so the
layouts the dense layers get (16-bit panels, int8, GGUF blocks) apply to experts as well.
On the CPU ops with float32 activations and experts in the C kernels' layouts, the whole
sparse MLP is one C call (`cpu_kernels.moe_forward`: the router, the top k, the grouping by
a counting sort, every expert's products, the weighted sum; its record written once per
layer by `ExpertsRecord`), which a decode step's plan (models/decode_plan.py) calls too;
elsewhere (bfloat16 activations, plain matrices, a GPU) the same steps in torch and a
loop over the experts that have rows -- but on CudaOps (`fused_moe_experts`), with dense
experts of h's dtype, everything after the routing is cuda/moe.cu's four kernels
(`CudaOps.moe_experts`) on the experts stacked once (`StackedExperts`).

Tensor parallelism shards every expert as a dense MLP is sharded (gate and up by rows,
down by columns: each rank holds a slice of every expert's intermediate), the router is
whole on every rank, and the sum is reduced over the ranks after the MLP, as the dense one.

Names in the checkpoints (per expert, as the published checkpoints store them):

    Qwen3-MoE  mlp.gate.weight [E, H]; mlp.experts.{e}.{gate,up,down}_proj.weight;
               layers listed in `mlp_only_layers`, or not a multiple of
               `decoder_sparse_step`, keep a dense MLP of `intermediate_size`
    Mixtral    block_sparse_moe.gate.weight; block_sparse_moe.experts.{e}.w1 (gate),
               w3 (up), w2 (down); every layer sparse
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ringllm.pipeline.models.decode_plan import kernel_set_index, matrix_words
from ringllm.pipeline.models.gguf_weights import MOE_NAMES, expert_names
from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.linear import linear
from ringllm.pipeline.models.llama import LlamaForCausalLM
from ringllm.pipeline.models.quant_weights import cat_rows
from ringllm.pipeline.models.registry import register
from ringllm.pipeline.models.weights import Shard, WeightSource
from ringllm.pipeline.ops.torch_ref import experts_loop


@dataclasses.dataclass
class MoeWeights:
    """One sparse layer's router and experts (this rank's shard of each expert)."""

    router: torch.Tensor  # [E, H], whole on every rank
    gate_up: list  # E weights [2 * I / tp, H]: gate rows, then up rows
    down: list  # E weights [H, I / tp]
    top_k: int
    renormalize: bool  # the top k weights divided by their sum
    record: ExpertsRecord | None = None  # the C MLP's, written on the first forward
    stacked: StackedExperts | None = None  # CudaOps.moe_experts', made on the first forward

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def prepack(self, pack) -> None:
        self.gate_up = [pack(w) for w in self.gate_up]
        self.down = [pack(w) for w in self.down]

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in h's dtype, experts [T, k] int64) of every token."""
        logits = F.linear(h, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), experts

    def forward(self, ops, h: torch.Tensor) -> torch.Tensor:
        """The layer's MLP output [T, H] for normed h [T, H] (before the TP reduction)."""
        if h.shape[0] == 0:
            return torch.zeros_like(h)
        stacked = self.stacked_experts(ops, h)
        if stacked is not None:
            weights, experts = self.route(h)
            return ops.moe_experts(h, weights, experts, *stacked)
        record = self.c_record(ops, h)
        if record is not None:
            return record.run(ops, h.contiguous())
        weights, experts = self.route(h)

        def expert_mlp(e: int, x: torch.Tensor) -> torch.Tensor:
            return linear(ops.silu_and_mul(linear(x, self.gate_up[e])), self.down[e])

        return experts_loop(h, weights, experts, self.num_experts, expert_mlp)

    def stacked_experts(self, ops, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up [E, 2I, H], down [E, H, I]) for `ops.moe_experts`, or None: these ops run
        the experts otherwise (only CudaOps sets `fused_moe_experts`; the CPU keeps the C MLP
        and the loop), or the experts are not dense tensors of h's dtype and device."""
        if not getattr(ops, "fused_moe_experts", False):
            return None
        if self.stacked is None or not self.stacked.matches(self):
            self.stacked = StackedExperts.build(self)
        return self.stacked.tensors(self, h)

    def c_record(self, ops, h: torch.Tensor | None = None) -> ExpertsRecord | None:
        """The record the C MLP (`cpu_kernels.moe_forward`) reads, or None: these experts,
        this router or these activations are not the C kernels' (the Python path runs)."""
        if h is not None and (h.dtype is not torch.float32 or h.device.type != "cpu"):
            return None
        if self.record is None or not self.record.matches(self):
            self.record = ExpertsRecord.build(self, ops)
        return self.record if self.record.words is not None else None


class ExpertsRecord:
    """A sparse layer's moe record (ops/csrc/decode_layers.h: the header, then gate_up and
    down per expert) for `cpu_kernels.moe_forward` and the decode plan, kept while the
    router and experts are the ones it was written for: sleep mode replaces every one, so
    the router, the first and the last expert are checked, by weak reference (decode_plan.py's
    PlanSlot does the same). `words` None: the C MLP cannot run this layer."""

    def __init__(self, moe: MoeWeights, words: np.ndarray | None, set_index: int | None):
        self.words, self.set_index = words, set_index
        self.workspace = torch.empty(0, dtype=torch.float32)
        self._keys = tuple(weakref.ref(w) for w in (moe.router, moe.gate_up[0], moe.down[-1]))

    @classmethod
    def build(cls, moe: MoeWeights, ops) -> ExpertsRecord:
        from ringllm.pipeline.ops import cpu_kernels
        from ringllm.pipeline.ops.cpu import ACT_SILU

        set_index = kernel_set_index(ops)
        router = moe.router
        if (
            set_index is None
            or router.dtype is not torch.float32
            or router.device.type != "cpu"
            or not router.is_contiguous()
        ):
            return cls(moe, None, set_index)
        records = []
        for gate_up, down in zip(moe.gate_up, moe.down, strict=True):
            records += [matrix_words(gate_up, set_index), matrix_words(down, set_index)]
        if any(r is None for r in records):
            return cls(moe, None, set_index)
        num_experts, hidden = router.shape
        header = np.zeros(cpu_kernels.MOE_HEADER_WORDS, dtype=np.int64)
        header[:7] = (
            num_experts, moe.top_k, int(moe.renormalize), moe.gate_up[0].shape[0] // 2,
            hidden, router.data_ptr(), ACT_SILU,
        )  # fmt: skip
        return cls(moe, np.concatenate([header, *records]), set_index)

    def matches(self, moe: MoeWeights) -> bool:
        now = (moe.router, moe.gate_up[0], moe.down[-1])
        return all(ref() is w for ref, w in zip(self._keys, now, strict=True))

    def run(self, ops, h: torch.Tensor) -> torch.Tensor:
        from ringllm.pipeline.ops import cpu_kernels

        words = self.words.ctypes.data
        floats = cpu_kernels.moe_workspace_floats(words, h.shape[0])
        if self.workspace.numel() < floats:
            self.workspace = torch.empty(floats, dtype=torch.float32)
        out = torch.empty_like(h)
        cpu_kernels.moe_forward(
            self.set_index, ops.threads, words, h.data_ptr(), h.shape[0], out.data_ptr(),
            self.workspace.data_ptr(),
        )  # fmt: skip
        return out


class StackedExperts:
    """A sparse layer's experts as CudaOps.moe_experts takes them: every gate_up stacked into
    one [E, 2I, H] tensor and every down into one [E, H, I], once; the layer's lists then hold
    views of the stacks (expert e's is stack[e]), so the experts' memory is held once, not
    twice (a layer's experts are held twice only while it is stacked).

    Nothing here holds a stack: it is rebuilt from the first view at each call, so when sleep
    mode takes the experts out of the lists their memory goes with them. Kept while the lists
    hold those views: sleep mode replaces every one, so the first and last of each list are
    checked by weak reference, as ExpertsRecord does. `dense` False: some expert is not a
    plain tensor (GGUF blocks, int8, 16-bit panels) or they differ in dtype, device or shape,
    and the loop runs."""

    def __init__(self, moe: MoeWeights, dense: bool):
        self.dense = dense
        self._keys = tuple(weakref.ref(w) for w in _stack_keys(moe))

    @classmethod
    def build(cls, moe: MoeWeights) -> StackedExperts:
        if not (_dense_alike(moe.gate_up) and _dense_alike(moe.down)):
            return cls(moe, False)
        if moe.gate_up[0].dtype != moe.down[0].dtype or moe.gate_up[0].device != moe.down[0].device:
            return cls(moe, False)
        moe.gate_up[:] = torch.stack(moe.gate_up).unbind(0)
        moe.down[:] = torch.stack(moe.down).unbind(0)
        return cls(moe, True)

    def matches(self, moe: MoeWeights) -> bool:
        return all(ref() is w for ref, w in zip(self._keys, _stack_keys(moe), strict=True))

    def tensors(self, moe: MoeWeights, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        first = moe.gate_up[0]
        if not self.dense or first.dtype != h.dtype or first.device != h.device:
            return None
        return _whole_stack(first, len(moe.gate_up)), _whole_stack(moe.down[0], len(moe.down))


def _stack_keys(moe: MoeWeights) -> tuple:
    return moe.gate_up[0], moe.gate_up[-1], moe.down[0], moe.down[-1]


def _dense_alike(weights: list) -> bool:
    first = weights[0]
    return all(
        isinstance(w, torch.Tensor)
        and w.layout == torch.strided
        and (w.dtype, w.device, w.shape) == (first.dtype, first.device, first.shape)
        for w in weights
    )


def _whole_stack(first: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The stack [E, ...] that `first` (its expert 0, a view at the stack's start) begins."""
    return first.as_strided((num_experts, *first.shape), (first.numel(), *first.stride()))


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate: int  # each expert's
    renormalize: bool
    sparse_step: int = 1  # every sparse_step-th layer is sparse
    dense_layers: tuple[int, ...] = ()


class MoeDecoder(LlamaForCausalLM):
    """The Llama decoder whose sparse layers' MLP is a `MoeWeights`; subclasses say their
    model type (its tensors' names: gguf_weights.MOE_NAMES) and read the config."""

    model_type = "qwen3_moe"

    @classmethod
    def moe_config(cls, raw: dict[str, Any]) -> MoeConfig:
        raise NotImplementedError

    def __init__(self, arch: ArchConfig, ops, dtype, device, max_positions, **kwargs) -> None:
        super().__init__(arch, ops, dtype, device, max_positions, **kwargs)
        self.moe = self.moe_config(arch.raw_config or {})
        moe = self.moe
        if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(
                f"config.json: {moe.top_k} experts per token of {moe.num_experts}: want "
                f"1 <= experts per token <= experts"
            )
        if moe.intermediate % self.tp_size:
            raise ValueError(
                f"tensor_parallel_size: {self.tp_size} ranks do not divide the experts' "
                f"intermediate size ({moe.intermediate})"
            )

    def is_sparse(self, i: int) -> bool:
        return i not in self.moe.dense_layers and (i + 1) % self.moe.sparse_step == 0

    def _load_mlp(self, source: WeightSource, i: int) -> dict[str, Any]:
        if not self.is_sparse(i):
            return super()._load_mlp(source, i)
        p = f"model.layers.{i}."
        h, inter = self.arch.hidden_size, self.moe.intermediate
        col = Shard(0, self.tp_rank, self.tp_size)
        row = Shard(1, self.tp_rank, self.tp_size)
        gate_up, down = [], []
        for e in range(self.moe.num_experts):
            gate_name, up_name, down_name = expert_names(self.model_type, e)
            gate = self._read_matrix(source, p + gate_name, (inter, h), col)
            up = self._read_matrix(source, p + up_name, (inter, h), col)
            gate_up.append(cat_rows([gate, up]))
            down.append(self._read_matrix(source, p + down_name, (h, inter), row))
        module, _ = MOE_NAMES[self.model_type]
        router = self._read(source, f"{p}{module}.gate.weight", (self.moe.num_experts, h))
        moe = MoeWeights(router, gate_up, down, self.moe.top_k, self.moe.renormalize)
        return {"gate_up": None, "down": None, "moe": moe}


@register("Qwen3MoeForCausalLM")
class Qwen3MoeForCausalLM(MoeDecoder):
    """Qwen3's attention (q/k norms) and its sparse MLP."""

    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        return dataclasses.replace(arch, qk_norm=True)

    @classmethod
    def moe_config(cls, raw: dict[str, Any]) -> MoeConfig:
        return MoeConfig(
            num_experts=int(raw.get("num_experts", 128)),
            top_k=int(raw.get("num_experts_per_tok", 8)),
            intermediate=int(raw.get("moe_intermediate_size", 768)),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            sparse_step=max(1, int(raw.get("decoder_sparse_step", 1))),
            dense_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        )


@register("MixtralForCausalLM")
class MixtralForCausalLM(MoeDecoder):
    """Mistral's decoder (a sliding window where config.json has one), every MLP sparse."""

    model_type = "mixtral"

    @classmethod
    def moe_config(cls, raw: dict[str, Any]) -> MoeConfig:
        return MoeConfig(
            num_experts=int(raw.get("num_local_experts", 8)),
            top_k=int(raw.get("num_experts_per_tok", 2)),
            intermediate=int(raw.get("intermediate_size", 14336)),
            renormalize=True,
        )
