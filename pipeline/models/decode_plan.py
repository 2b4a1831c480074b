"""A step's decoder layers in one C call: `DecodePlan`.

The Llama-family layer (models/llama.py, `LlamaForCausalLM`'s per-layer method, and the
subclasses' that keep its shape: Gemma 3's sandwich norms and GELU, per-layer rotary tables
and windows, Phi-3) is a dozen kernels, and on a decode step's few rows each, at one or a
few users, the Python around them (a tensor allocated per op, argument checks, dispatch:
about 300 calls a step on a 30-layer model) costs as much as reading the weights.
`cpu_kernels.decode_layers` runs the same kernels in the same order from C
(pipeline/ops/csrc/decode_layers.h), so a step's layers cost one call, with results bit for
bit those of the layer-by-layer path. It takes any step: decodes, prompt chunks, or both
(a served step that prefills a new prompt beside the streams decoding: the chunks' attention
is the prefill kernel's, called as models/attention.py calls it).

The plan is an int64 array of pointers and sizes, written once (`DecodePlan.build`) and
kept while the tensors it points at are the model's: `PlanSlot` checks, by weak reference,
the first layer's KV cache and the first and last matrices, which sleep mode and a new KV
cache replace (with every other one). A model the C driver cannot run is remembered as
`None` under the same check, so a step never builds twice.

Runs it: a float32 model on the CPU ops (`CpuOps`), one tensor-parallel rank, every matrix
a `QuantMatrix` (GGUF blocks, int8) or 16-bit panels of the ops' own kernel set, or row parts
of those. Anything else (bfloat16 activations, oneDNN or plain matrices, TP) keeps the
layer-by-layer path. `RINGLLM_FUSED_DECODE=0` turns it off for the process.
"""

from __future__ import annotations

import functools
import os
import weakref

import numpy as np
import torch

from ringllm.pipeline.models.forward_batch import ForwardBatch
from ringllm.pipeline.models.linear import PackedWeight16
from ringllm.pipeline.models.quant_weights import RowParts

ENV_FUSED = "RINGLLM_FUSED_DECODE"
_PART_QUANT, _PART_W16 = 1, 2
_WDTYPES = {torch.bfloat16: 1, torch.float16: 2}  # the C kernels' DT_* codes
# the header's fields, in decode_layers.h's order (eps and scale are float64 words)
_HEADER = (
    "magic num_layers hidden num_heads num_kv_heads head_dim inter cos_sin num_blocks "
    "block_size act cache_dtype attn_tiles eps scale"
).split()
_LAYER = (
    "input_norm post_norm q_norm k_norm qkv_bias key_cache value_cache pre_ff_norm "
    "post_ff_norm moe cos_sin window kv_group"
).split()
_MATRICES = ("qkv", "o_proj", "gate_up", "down")
_PART_WORDS = 5  # kind, fn, data, type, n
_MATRIX_HEAD = 3  # num_parts, n, k
_LORA_WORDS = 3  # a, b, r: each matrix's LoRA slots (models/lora.py), after the matrices


@functools.cache
def fused_decode_enabled() -> bool:
    """RINGLLM_FUSED_DECODE (default on), read once per process."""
    value = os.environ.get(ENV_FUSED, "1").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true"):
        raise ValueError(f"{ENV_FUSED}={value!r}: want 1 or 0")
    return value in ("1", "on", "true")


# The parts of a step's time the C call can report (decode_layers.h's PROF_* order), for
# `ringllm bench step`; `DecodePlan.run(profile=)` adds each part's seconds to its slot.
PROFILE_PARTS = (
    "norms",
    "q|k|v product",
    "q/k norms and rotary",
    "KV cache write",
    "attention",
    "o product",
    "gate|up product",
    "activation",
    "down product",
    "LoRA deltas",
    "experts (sparse MLP)",
)


def new_profile() -> torch.Tensor:
    """Zeroed seconds, one per PROFILE_PARTS entry, for `DecodePlan.run(profile=)`."""
    from ringllm.pipeline.ops import cpu_kernels

    if cpu_kernels.DECODE_PROFILE_PARTS != len(PROFILE_PARTS):
        raise RuntimeError("cpu_kernels and decode_plan.py disagree on the profile's parts")
    return torch.zeros(len(PROFILE_PARTS), dtype=torch.float64)


@functools.cache
def _layout() -> tuple[int, int, int, int]:
    from ringllm.pipeline.ops import cpu_kernels

    magic, header, layer, max_parts = cpu_kernels.DECODE_PLAN_LAYOUT
    words = len(_LAYER) + len(_MATRICES) * (_MATRIX_HEAD + max_parts * _PART_WORDS + _LORA_WORDS)
    if header != len(_HEADER) or layer != words:
        raise RuntimeError("cpu_kernels and decode_plan.py disagree on the decode plan's layout")
    return magic, header, layer, max_parts


class DecodePlan:
    """The words `cpu_kernels.decode_layers` reads, and the workspace it writes."""

    def __init__(
        self, words: np.ndarray, kernel_set: int, threads: int, max_positions: int, records=()
    ):
        self.words = torch.from_numpy(words)
        # the sparse layers' moe records (models/moe.py) the words point into, kept alive
        self.records = [r for r in records if r is not None]
        self.kernel_set, self.threads = kernel_set, threads
        self.max_positions = max_positions
        self.num_blocks, self.block_size = int(words[8]), int(words[9])
        self.workspace = torch.empty(0, dtype=torch.float32)
        self._workspace_rows = 0
        self.has_lora = False  # the words point at LoRA slots (models/lora.py)

    # ---- building ------------------------------------------------------------------

    @classmethod
    def build(cls, model, kv_caches, layer_groups=None) -> DecodePlan | None:
        """The plan of `model`'s layers over `kv_caches`, or None when the C driver cannot
        run this model (see the module docstring). `layer_groups`: each layer's KV group
        (ForwardBatch.layer_groups; None: one block table for all)."""
        ops = model.ops
        set_index = kernel_set_index(ops)
        if (
            set_index is None
            or model.dtype is not torch.float32
            or model.tp_size != 1
            or not model.layers
            or len(kv_caches) != len(model.layers)
            or model.head_dim % 2
            or model.num_heads % model.num_kv_heads
            or model.num_heads // model.num_kv_heads > 64
            or not _table_ok(model.cos_sin, model)
            or not all(_cache_ok(kc, vc, kv_caches[0][0].shape) for kc, vc in kv_caches)
            or kv_caches[0][0].shape[1::2] != (model.num_kv_heads, model.head_dim)
            or not all(_shapes_ok(w, model) for w in model.layers)
        ):
            return None
        from ringllm.pipeline.ops.cpu import CACHE_DTYPE_CODES

        magic, header, layer_words, max_parts = _layout()
        words = np.zeros(header + layer_words * len(model.layers), dtype=np.int64)
        kc = kv_caches[0][0]
        a = model.arch
        inter = _dense_inter(model)
        words[:13] = (
            magic, len(model.layers), a.hidden_size, model.num_heads, model.num_kv_heads,
            model.head_dim, inter, model.cos_sin.data_ptr(), kc.shape[0], kc.shape[2],
            _act_code(model.mlp_activation), CACHE_DTYPE_CODES[kc.dtype],
            int(getattr(ops, "attention_tiles", False)),
        )  # fmt: skip
        words[13:15].view(np.float64)[:] = (a.rms_norm_eps, model.scale)
        records = []
        for i, (w, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches, strict=True)):
            row = words[header + i * layer_words : header + (i + 1) * layer_words]
            cos_sin, window = model.layer_attention(w)
            moe = None if w.moe is None else w.moe.c_record(ops)
            if w.moe is not None and moe is None:
                return None  # experts or a router the C MLP does not take
            group = 0 if layer_groups is None else layer_groups[i]
            lora = getattr(model, "lora", None)
            if not _table_ok(cos_sin, model) or not _write_layer(
                row,
                w,
                k_cache,
                v_cache,
                cos_sin,
                (window, group),
                moe,
                set_index,
                None if lora is None else lora.groups_used,
            ):
                return None
            records.append(moe)
        plan = cls(words, set_index, ops.threads, model.cos_sin.shape[0], records)
        plan.has_lora = getattr(model, "lora", None) is not None
        return plan

    # ---- one step ------------------------------------------------------------------

    def run(
        self,
        ops,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        residual,
        lora_slots=None,
        profile: torch.Tensor | None = None,
    ):
        """The layers over a step's batch (decodes, prompt chunks or both): (hidden,
        residual) after the last layer, as `_layer` would leave them (`residual` None: the
        first layer's, on the first stage). None when the step's index tensors are not in
        the kernels' layouts (the caller runs the layers one by one); ValueError for an
        index out of bounds. `lora_slots`: each token's LoRA slot, int32 [m] (the model's
        `_lora_tokens`). `profile` (`new_profile()`): each part's wall time is added to
        it."""
        from ringllm.pipeline.ops import cpu_kernels

        m, size = hidden.shape
        if not ops.fused_step_ok(batch, self.num_blocks, self.block_size, self.max_positions):
            return None
        if lora_slots is not None and (
            lora_slots.dtype != torch.int32 or lora_slots.shape != (m,) or not self.has_lora
        ):
            return None
        hidden = hidden.contiguous() if hidden.dtype is torch.float32 else hidden.float()
        if residual is not None:
            residual = residual.contiguous()
        if m > self._workspace_rows:
            floats = cpu_kernels.decode_workspace_floats(self.words.data_ptr(), m)
            self.workspace = torch.empty(floats, dtype=torch.float32)
            self._workspace_rows = m
        hidden_out = torch.empty(m, size, dtype=torch.float32)
        residual_out = torch.empty(m, size, dtype=torch.float32)
        tables, slots = batch.block_tables, batch.slot_mapping
        group_strides = (0, 0)
        if batch.group_block_tables is not None:  # KV groups: [G, m, max_blocks], [G, m]
            tables, slots = batch.group_block_tables, batch.group_slot_mapping
            group_strides = (tables.stride(0), slots.stride(0))
        cpu_kernels.decode_layers(
            self.kernel_set, self.threads, self.words.data_ptr(), m, hidden.data_ptr(),
            0 if residual is None else residual.data_ptr(), hidden_out.data_ptr(),
            residual_out.data_ptr(), batch.positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.stride(-2), batch.seq_lens.data_ptr(),
            self.workspace.data_ptr(), *group_strides,
            0 if lora_slots is None else lora_slots.contiguous().data_ptr(),
            batch.num_reqs, batch.num_decodes,
            batch.prefill_query_start_loc.data_ptr() if batch.num_decodes < batch.num_reqs else 0,
            _profile_ptr(profile),
        )  # fmt: skip
        return hidden_out, residual_out


def _profile_ptr(profile: torch.Tensor | None) -> int:
    if profile is None:
        return 0
    if profile.dtype != torch.float64 or profile.shape != (len(PROFILE_PARTS),):
        raise ValueError(f"profile: want float64 [{len(PROFILE_PARTS)}] (new_profile())")
    if not profile.is_contiguous():
        raise ValueError("profile: want a contiguous tensor (new_profile())")
    return profile.data_ptr()


def _act_code(activation: str) -> int:
    """A model's `mlp_activation` as gated_act_args.act (ops/cpu.py's ACT_* codes)."""
    from ringllm.pipeline.ops.cpu import ACT_GELU_TANH, ACT_SILU

    return {"silu": ACT_SILU, "gelu_tanh": ACT_GELU_TANH}[activation]


def runs_fused(batch: ForwardBatch) -> bool:
    """A step the plan takes: any with a token (decodes, prompt chunks, or both: the chunks'
    attention is the prefill kernel's, as on the layer path)."""
    return batch.num_tokens > 0 and batch.num_reqs > 0


class PlanSlot:
    """A model's plan (or None: the model cannot be fused), kept while its first KV cache
    and its first and last matrices are the ones it was written for."""

    def __init__(self) -> None:
        self._plan: DecodePlan | None = None
        self._keys: tuple = ()
        self._groups: tuple | None = None
        self._lora_version = None

    def get(self, model, kv_caches, layer_groups=None) -> DecodePlan | None:
        lora = getattr(model, "lora", None)
        lora_version = None if lora is None else lora.version
        if (
            not self._matches(model, kv_caches)
            or self._groups != layer_groups
            or self._lora_version != lora_version  # which projections adapters take
        ):
            self._plan = DecodePlan.build(model, kv_caches, layer_groups)
            self._keys = _keys(model, kv_caches)
            self._groups = layer_groups
            self._lora_version = lora_version
        return self._plan

    def _matches(self, model, kv_caches) -> bool:
        if not self._keys or not kv_caches or not model.layers:
            return False
        first_cache, first, last, count = self._keys
        return (
            count == len(kv_caches)
            and first_cache() is kv_caches[0][0]
            and first() is model.layers[0].qkv
            and last() is model.layers[-1].o_proj
        )


def _keys(model, kv_caches) -> tuple:
    if not kv_caches or not model.layers:
        return ()
    return (
        weakref.ref(kv_caches[0][0]),
        weakref.ref(model.layers[0].qkv),
        weakref.ref(model.layers[-1].o_proj),
        len(kv_caches),
    )


def kernel_set_index(ops) -> int | None:
    """The index of the C kernel set of `CpuOps` (None: other ops, no C kernels)."""
    from ringllm.pipeline.ops import cpu_kernels

    name = getattr(ops, "kernel_set", None)
    return cpu_kernels.KERNEL_SETS.index(name) if name in cpu_kernels.KERNEL_SETS else None


def _cache_ok(key_cache, value_cache, shape) -> bool:
    """Every layer's pair: [num_blocks, kv_heads, block_size, head_dim] of one shape and a
    cache dtype the C kernels read (float32, 16-bit, fp8 or int8 under the float32
    activations; an int8 pair with its scales behind it, where the C loop finds them)."""
    from ringllm.pipeline.ops.cpu import CACHE_DTYPE_CODES
    from ringllm.pipeline.ops.kv_int8 import has_scales

    return (
        key_cache.dtype in CACHE_DTYPE_CODES
        and value_cache.dtype is key_cache.dtype
        and key_cache.device.type == "cpu"
        and key_cache.shape == value_cache.shape == shape
        and key_cache.dim() == 4
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and (key_cache.dtype is not torch.int8 or has_scales(key_cache) and has_scales(value_cache))
    )


def _shapes_ok(w, model) -> bool:
    """The matrices' shapes the C driver assumes (one rank: whole heads and MLP; every
    dense MLP of one size; a sparse layer's experts are its moe record's)."""
    h, q = model.arch.hidden_size, model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    if not (w.qkv.shape == (q + 2 * kv, h) and w.o_proj.shape == (h, q)):
        return False
    if w.moe is not None:
        return True
    inter = w.gate_up.shape[0] // 2
    return (
        w.gate_up.shape == (2 * inter, h)
        and w.down.shape == (h, inter)
        and inter == _dense_inter(model)
    )


def _dense_inter(model) -> int:
    """The dense MLPs' intermediate size (0: every layer sparse)."""
    return next((w.gate_up.shape[0] // 2 for w in model.layers if w.moe is None), 0)


def _table_ok(cos_sin: torch.Tensor, model) -> bool:
    """A rotary table the kernels read: float32 [max_positions, head_dim], dense."""
    return (
        cos_sin.dtype is torch.float32
        and cos_sin.is_contiguous()
        and cos_sin.shape == (model.cos_sin.shape[0], model.head_dim)
    )


def _write_layer(
    row: np.ndarray,
    w,
    key_cache,
    value_cache,
    cos_sin,
    attention,
    moe,
    set_index,
    lora_groups=None,
) -> bool:
    """Layer w's words; `attention`: its (window, KV group); `moe`: its ExpertsRecord (a
    sparse layer: no gate_up / down); `lora_groups`: the projections some loaded LoRA
    adapter takes (models/lora.py; the others' words stay zeros)."""
    sandwich = (getattr(w, "pre_ff_norm", None), getattr(w, "post_ff_norm", None))
    if (sandwich[0] is None) != (sandwich[1] is None):
        return False
    vectors = (w.input_norm, w.post_norm, w.q_norm, w.k_norm, w.qkv_bias)
    if any(v is not None and not _f32_vector(v) for v in vectors + sandwich):
        return False
    row[: len(_LAYER)] = [0 if v is None else v.data_ptr() for v in vectors] + [
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        *(0 if v is None else v.data_ptr() for v in sandwich),
        0 if moe is None else moe.words.ctypes.data,
        cos_sin.data_ptr(),
        *attention,
    ]
    at = len(_LAYER)
    for name in _MATRICES:
        if moe is not None and name in ("gate_up", "down"):
            at += _MATRIX_HEAD + _layout()[3] * _PART_WORDS  # zeros: no parts
            continue
        words = matrix_words(getattr(w, name), set_index)
        if words is None:
            return False
        row[at : at + len(words)] = words
        at += len(words)
    for name in _MATRICES:  # the LoRA slots (zeros: none), float32 like the activations
        stacks = (getattr(w, "lora", None) or {}).get(name)
        if stacks is not None and lora_groups is not None and name in lora_groups:
            a, b, _ = stacks
            if a.dtype is not torch.float32 or not (a.is_contiguous() and b.is_contiguous()):
                return False
            row[at : at + _LORA_WORDS] = (a.data_ptr(), b.data_ptr(), b.shape[1])
        at += _LORA_WORDS
    return True


def matrix_words(weight, set_index: int) -> np.ndarray | None:
    """Weight's decode_plan_matrix record (decode_layers.h), or None: a weight the C
    products cannot run (see the module docstring)."""
    max_parts = _layout()[3]
    parts = _parts(weight, set_index)
    if parts is None or len(parts) > max_parts:
        return None
    words = np.zeros(_MATRIX_HEAD + max_parts * _PART_WORDS, dtype=np.int64)
    words[:_MATRIX_HEAD] = (len(parts), *weight.shape)
    for p, part in enumerate(parts):
        start = _MATRIX_HEAD + p * _PART_WORDS
        words[start : start + _PART_WORDS] = part
    return words


def _f32_vector(v: torch.Tensor) -> bool:
    return v.dtype is torch.float32 and v.dim() == 1 and v.is_contiguous() and v.is_cpu


def _parts(weight, set_index: int) -> list[tuple] | None:
    """(kind, fn, data, type, n) of each row part, or None: a part the driver cannot run."""
    from ringllm.pipeline.ops.quant import QuantMatrix

    pieces = weight.parts if isinstance(weight, RowParts) else [weight]
    out = []
    for piece in pieces:
        if type(piece) is QuantMatrix:
            qtype, quant_set = piece._indices
            out.append((_PART_QUANT, _qlinear_address(quant_set), piece.data.data_ptr(),
                        qtype, piece.n))  # fmt: skip
        elif isinstance(piece, PackedWeight16) and piece.kernel_set == set_index:
            out.append((_PART_W16, 0, piece.panels.data_ptr(), _WDTYPES[piece.dtype], piece.n))
        else:
            return None
    return out


@functools.cache
def _qlinear_address(quant_set: int) -> int:
    from ringllm.pipeline.ops import quant_kernels

    return quant_kernels.qlinear_address(quant_set)
