"""LoRA adapters on the Llama-family decoders: PEFT folders read, checked, and held in slots.

An adapter is what PEFT's `save_pretrained` writes: `adapter_config.json` (r, lora_alpha,
target_modules, use_rslora, rank_pattern / alpha_pattern) and `adapter_model.safetensors`
(or `.bin`) holding, for each module it adapts,

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

and the module's output becomes  W x + scale * B (A x),  scale = alpha / r (alpha / sqrt(r)
with rsLoRA). `read_adapter` takes the seven projections of a Llama-family layer (q, k, v,
o, gate, up, down); anything else, DoRA, trained biases or saved modules is refused with
the reason, as is a tensor whose shape is not the base model's (an adapter for another
model) or a rank above --max-lora-rank. A tensor-parallel rank keeps its shard: B's rows of
a column-parallel projection (q, k, v, gate, up), A's columns of a row-parallel one (o,
down), whose partial products the layer's all-reduce sums as it sums the base's. A pipeline
stage keeps its own layers only.

The model multiplies fused groups (q|k|v, gate|up), so a group's parts share one shrink
per layer and slot (`LoraSlots`), and each part's output rows take their own B:

    a_stack[group] [max_loras, P * R, in]      part p's A in rows p*R .. p*R + r_p
    b_stack[group] [max_loras, R, out]         part p's (scale * B)^T in its output
                                               columns, rows 0 .. r_p (zeros past the rank)

(P parts, R = --max-lora-rank). A step's requests name adapters by id (0: the base model);
`LoraSlots.token_slots` puts each adapter the step uses into a slot (one it holds already,
else a free one or the one used least recently) and gives each token its slot, -1 for the
base model; the ops' `lora_apply` adds the deltas after each projection, tokens grouped by
slot. The engine core's scheduler never mixes more than --max-loras adapters in a step.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ringllm.pipeline.lora_request import WEIGHT_FILES
from ringllm.pipeline.models.hf_config import ArchConfig

# PEFT module leaf -> (the model's projection group, part index in it)
TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_SUBLAYER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
_SUBLAYER |= {"o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ROW_PARALLEL = ("o_proj", "down")  # their input is split over the tensor-parallel ranks
MLP_GROUPS = ("gate_up", "down")
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)
_HEAD_KEY = re.compile(r"^(?:base_model\.model\.)?lm_head\.lora_([AB])(?:\.[\w-]+)?\.weight$")
HEAD = "lm_head"  # the LM head's group (its parts key: layer -1)
_BASE_COPY = re.compile(
    r"^(?:base_model\.model\.)?(?:lm_head|model\.embed_tokens)(?:\.base_layer)?\.weight$"
)


class LoraError(ValueError):
    """An adapter that cannot be served on this model (the message says why)."""


@dataclass(frozen=True)
class GroupShape:
    """A projection group's sizes on one tensor-parallel rank."""

    in_features: int
    part_outs: tuple[int, ...]  # each part's output rows, in order

    @property
    def out_features(self) -> int:
        return sum(self.part_outs)


def group_shapes(arch: ArchConfig, tp_size: int = 1) -> dict[str, GroupShape]:
    h, q, kv = arch.hidden_size, arch.q_size // tp_size, arch.kv_size // tp_size
    inter = arch.intermediate_size // tp_size
    return {
        "qkv": GroupShape(h, (q, kv, kv)),
        "o_proj": GroupShape(q, (h,)),
        "gate_up": GroupShape(h, (inter, inter)),
        "down": GroupShape(inter, (h,)),
    }


@dataclass
class LoraAdapter:
    """One adapter as a rank holds it: per (local layer, group, part) its A [r, in] and its
    scaled B [out, r], float32, this rank's shard."""

    name: str
    path: str
    rank: int  # the highest rank of its modules
    parts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    targets: tuple[str, ...] = ()  # the PEFT modules it adapts (q_proj, ...)


def read_adapter(
    path: str | Path,
    arch: ArchConfig,
    max_rank: int,
    *,
    name: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: range | None = None,
    dense_mlp: tuple[bool, ...] | None = None,
    head: bool = True,
) -> LoraAdapter:
    """The PEFT adapter at `path`, checked against the model (`arch`, the whole model's) and
    cut to this rank's shard and this stage's `layers` (local index = layer - start).
    `dense_mlp[i]`: layer i has a gated MLP (False: a mixture of experts, whose experts
    take no adapter); `head`: this stage holds the LM head (its adapter, if any, is kept:
    parts key (-1, "lm_head", 0), B's rows this rank's vocabulary shard, padded).
    LoraError says what is wrong with an adapter that does not fit."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"no LoRA adapter at {str(path)!r}: not a folder")
    config = _read_config(folder)
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)")):
        if config.get(flag):
            raise LoraError(f"{folder}: {why} adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"{folder}: bias={config['bias']!r}: trained biases are not supported")
    if config.get("modules_to_save"):
        raise LoraError(
            f"{folder}: modules_to_save {config['modules_to_save']} (whole modules saved "
            "with the adapter) are not supported"
        )
    r = config.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"{folder}: adapter_config.json r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(
            f"{folder}: LoRA rank {r} is above max_lora_rank {max_rank} "
            "(start the server with a larger --max-lora-rank)"
        )
    tensors = _read_tensors(folder)
    full = group_shapes(arch)
    layers = layers if layers is not None else range(arch.num_hidden_layers)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    head_pair: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if _BASE_COPY.match(key):
            # PEFT saves the frozen head or embedding beside an adapter of the head (its
            # save_embedding_layers="auto"): the base model's own, unless the vocabulary
            # was resized, which the base model then lacks
            if tuple(tensor.shape) != (arch.vocab_size, arch.hidden_size):
                raise LoraError(
                    f"{folder}: {key} is {list(tensor.shape)}; the model's vocabulary is "
                    f"[{arch.vocab_size}, {arch.hidden_size}] (adapters for a resized "
                    "vocabulary are not supported)"
                )
            continue
        head_match = _HEAD_KEY.match(key)
        if head_match is not None:
            head_pair[head_match[1]] = tensor
            continue
        match = _KEY.match(key)
        if match is None:
            raise LoraError(f"{folder}: {_unsupported(key)}")
        layer, sublayer, leaf, which = int(match[1]), match[2], match[3], match[4]
        if leaf not in TARGETS or _SUBLAYER[leaf] != sublayer:
            raise LoraError(f"{folder}: {_unsupported(key)}")
        if layer >= arch.num_hidden_layers:
            raise LoraError(
                f"{folder}: {key} is for layer {layer}; the model has "
                f"{arch.num_hidden_layers} layers (an adapter for another base model?)"
            )
        found.setdefault((layer, leaf), {})[which] = tensor
    if not found and not head_pair:
        raise LoraError(f"{folder}: the adapter holds no LoRA weights")
    parts: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    if head_pair:
        a, b = _checked_pair(
            folder, "lm_head", "lm_head", head_pair, arch.hidden_size, arch.vocab_size, max_rank
        )
        top_rank = a.shape[0]
        if head:
            b = b.float() * _scale(config, "lm_head", a.shape[0])
            if tp_size > 1:  # the vocabulary's rows of this rank, padded as the head's
                rows = -(-arch.vocab_size // tp_size)
                b = b[tp_rank * rows : (tp_rank + 1) * rows]
                b = torch.nn.functional.pad(b, (0, 0, 0, rows - b.shape[0]))
            parts[(-1, HEAD, 0)] = (a.float().contiguous(), b.contiguous())
    for (layer, leaf), pair in sorted(found.items()):
        where = f"layer {layer} {leaf}"
        group, part = TARGETS[leaf]
        shape = full[group]
        a, b = _checked_pair(
            folder, where, leaf, pair, shape.in_features, shape.part_outs[part], max_rank
        )
        rank = a.shape[0]
        top_rank = max(top_rank, rank)
        if layer not in layers:
            continue
        if group in MLP_GROUPS and dense_mlp is not None and not dense_mlp[layer]:
            raise LoraError(
                f"{folder}: layer {layer} {leaf}: the layer's MLP is a mixture of experts; "
                "adapters on experts are not supported"
            )
        scale = _scale(config, f"model.layers.{layer}.{_SUBLAYER[leaf]}.{leaf}", rank)
        a, b = a.float(), b.float() * scale
        if tp_size > 1:
            if group in ROW_PARALLEL:
                a = a.chunk(tp_size, dim=1)[tp_rank]
            else:
                b = b.chunk(tp_size, dim=0)[tp_rank]
        parts[(layer - layers.start, group, part)] = (a.contiguous(), b.contiguous())
    targets = tuple(sorted({leaf for _, leaf in found} | ({HEAD} if head_pair else set())))
    return LoraAdapter(name or folder.name, str(folder), top_rank, parts, targets)


def _checked_pair(folder, where, module, pair, want_in, want_out, max_rank):
    """The (A, B) of one module, checked: both there, one rank, the model's sizes."""
    if set(pair) != {"A", "B"}:
        raise LoraError(f"{folder}: {where} has lora_{''.join(pair)} but not both A and B")
    a, b = pair["A"], pair["B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoraError(
            f"{folder}: {where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not "
            "a [r, in] and an [out, r] matrix of one rank"
        )
    if a.shape[1] != want_in or b.shape[0] != want_out:
        raise LoraError(
            f"{folder}: {where} maps {a.shape[1]} -> {b.shape[0]} features; the model's "
            f"{module} maps {want_in} -> {want_out} (an adapter for another base model)"
        )
    if a.shape[0] > max_rank:
        raise LoraError(
            f"{folder}: {where} has rank {a.shape[0]}, above max_lora_rank {max_rank} "
            "(start the server with a larger --max-lora-rank)"
        )
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraError(f"{folder}: {where} holds NaN or infinite values")
    return a, b


def _read_config(folder: Path) -> dict:
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise LoraError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file}: must hold a JSON object")
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the adapter's fault
            raise LoraError(f"{file}: not a readable weights file ({exc})") from None
    raise LoraError(f"{folder}: no adapter weights ({' or '.join(WEIGHT_FILES)})")


def _unsupported(key: str) -> str:
    module = key.split(".lora_")[0].removeprefix("base_model.model.")
    return (
        f"{key}: LoRA on {module} is not supported (ringllm adapts the q/k/v/o and "
        "gate/up/down projections of the decoder layers and the LM head)"
    )


def _pattern_value(patterns: dict, module: str):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that is the module's name
    or a regex matching its dotted suffix."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return None


def _scale(config: dict, module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


class LoraSlots:
    """The adapters a worker has loaded (at most `max_adapters`) and the `max_loras` slots
    a step's adapters are multiplied from (see the module docstring)."""

    def __init__(
        self,
        shapes: dict[str, GroupShape],
        num_layers: int,
        dense_mlp: tuple[bool, ...],
        max_loras: int,
        max_rank: int,
        max_adapters: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        head: GroupShape | None = None,
    ) -> None:
        """`head`: the LM head's sizes on this rank (the last pipeline stage's; None: no
        head here)."""
        self.max_loras, self.max_rank, self.max_adapters = max_loras, max_rank, max_adapters
        self.dtype = dtype
        self.adapters: dict[int, LoraAdapter] = {}
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # least recently used first
        # the projection groups some loaded adapter takes (the others are skipped), and a
        # count of their changes (the decode plan is written again on one)
        self.groups_used: frozenset[str] = frozenset()
        self.version = 0
        self.stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]] = []
        for i in range(num_layers):
            layer = {}
            for group, shape in shapes.items():
                if group in MLP_GROUPS and not dense_mlp[i]:
                    continue
                width = len(shape.part_outs) * max_rank
                a = torch.zeros(max_loras, width, shape.in_features, dtype=dtype, device=device)
                b = torch.zeros(max_loras, max_rank, shape.out_features, dtype=dtype, device=device)
                layer[group] = (a, b, shape.part_outs)
            self.stacks.append(layer)
        self.head = None  # the LM head's (a, b, parts), like a layer group's
        if head is not None:
            a = torch.zeros(max_loras, max_rank, head.in_features, dtype=dtype, device=device)
            b = torch.zeros(max_loras, max_rank, head.out_features, dtype=dtype, device=device)
            self.head = (a, b, head.part_outs)
        self._shapes = shapes

    def add(self, lora_id: int, adapter: LoraAdapter) -> None:
        if lora_id <= 0:
            raise LoraError(f"lora id {lora_id}: must be >= 1 (0 is the base model)")
        if lora_id in self.adapters:
            raise LoraError(f"lora id {lora_id} is loaded already")
        if len(self.adapters) >= self.max_adapters:
            raise LoraError(
                f"{len(self.adapters)} adapters are loaded, the most this engine holds "
                "(max_cpu_loras); unload one first"
            )
        self.adapters[lora_id] = adapter
        self._count_groups()

    def remove(self, lora_id: int) -> bool:
        self._slot_of.pop(lora_id, None)
        removed = self.adapters.pop(lora_id, None) is not None
        self._count_groups()
        return removed

    def _count_groups(self) -> None:
        used = frozenset(g for a in self.adapters.values() for _, g, _ in a.parts)
        if used != self.groups_used:
            self.groups_used = used
            self.version += 1

    def token_slots(self, lora_ids, counts) -> torch.Tensor | None:
        """Each token's slot, int32 [T] (-1: the base model), for requests naming adapters
        `lora_ids` [R] with `counts` [R] tokens each; None when none takes an adapter.
        The adapters used are put into slots first."""
        import numpy as np

        ids = np.asarray(lora_ids, np.int64)
        if not ids.any():
            return None
        used = [int(i) for i in np.unique(ids[ids > 0])]
        unknown = [i for i in used if i not in self.adapters]
        if unknown:
            raise LoraError(f"lora ids {unknown} are not loaded on this worker")
        if len(used) > self.max_loras:
            raise LoraError(
                f"a step mixes {len(used)} adapters; the workers hold {self.max_loras} (max_loras)"
            )
        slot_by_id = self._place(used)
        per_request = np.full(len(ids), -1, np.int32)
        for lora_id, slot in slot_by_id.items():
            per_request[ids == lora_id] = slot
        return torch.from_numpy(np.repeat(per_request, np.asarray(counts, np.int64)))

    def _place(self, used: list[int]) -> dict[int, int]:
        placed = {}
        for lora_id in used:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                placed[lora_id] = self._slot_of[lora_id]
        taken = set(self._slot_of.values())
        for lora_id in used:
            if lora_id in placed:
                continue
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:  # the least recently used adapter not in this step gives up its slot
                victim = next(i for i in self._slot_of if i not in used)
                slot = self._slot_of.pop(victim)
            self._write(slot, self.adapters[lora_id])
            self._slot_of[lora_id] = slot
            taken.add(slot)
            placed[lora_id] = slot
        return placed

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        r = self.max_rank
        for stacks in [*(s for layer in self.stacks for s in layer.values()), self.head]:
            if stacks is not None:
                stacks[0][slot].zero_()
                stacks[1][slot].zero_()
        for (i, group, part), (a, b) in adapter.parts.items():
            stacks = self.head if group == HEAD else self.stacks[i].get(group)
            if stacks is None:
                continue
            a_stack, b_stack, part_outs = stacks
            rank, first = a.shape[0], sum(part_outs[:part])
            a_stack[slot, part * r : part * r + rank] = a.to(self.dtype)
            b_stack[slot, :rank, first : first + b.shape[0]] = b.T.to(self.dtype)
