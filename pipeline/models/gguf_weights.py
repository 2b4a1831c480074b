"""Reads a GGUF file's tensors under their Hugging Face names, kept in their block formats.

`GGUFWeightSource` has `WeightSource`'s interface (models/weights.py: `names`, `in`,
`get(name, shard, shape)`) over a memory-mapped GGUF, plus `get_blocks`, which hands a
quantized matrix over as it is in the file:

    get_blocks("model.layers.0.mlp.down_proj.weight", Shard(dim=1, rank=0, size=2))
      -> GGUFBlocks(qtype="q6_k", n=2048, k=4096, blocks=uint8 [2048, 4096 / 256 * 210])

A tensor-parallel rank reads only its shard: rows of blocks (dim 0), or a block-aligned
run of every row's blocks (dim 1: `k / tp_size` must be a whole number of blocks).
`get` returns any tensor dequantized to float32 (norms, biases, and every matrix when a
dtype other than the blocks is asked for).

GGUF and HF orders differ in two ways, both undone here: GGUF lists dimensions
fastest-first (numpy's shape is the reverse), and for the `llama` architecture llama.cpp
permutes the rows of q and k (see `rotary_row_order`); a row permutation moves whole rows,
so it applies to blocks as to dense rows.

Invariants: every tensor of the file maps to exactly one HF name or is an error naming it;
shapes are checked against what the metadata implies; nothing is read until asked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from ringllm.pipeline.models.gguf_config import (
    GGUFFormatError,
    architecture_of,
    build_hf_config,
    open_gguf,
)
from ringllm.pipeline.models.gguf_file import GGUFFile, GGUFTensor
from ringllm.pipeline.models.weights import Shard
from ringllm.pipeline.ops.quant import GGML_TYPES

# llama.cpp tensor name (inside block N) -> HF name (inside model.layers.N).
BLOCK_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's sandwich norms (llama.cpp's ffn_norm is its pre-feed-forward norm there).
GEMMA3_BLOCK_TENSOR_NAMES = {
    **BLOCK_TENSOR_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# A sparse layer's router, and its experts' matrices: one 3D tensor [E, rows, cols] each,
# seen as E matrices under the HF per-expert names (`expert_names`).
ROUTER_TENSOR = "ffn_gate_inp.weight"
EXPERT_TENSORS = {"ffn_gate_exps.weight": 0, "ffn_up_exps.weight": 1, "ffn_down_exps.weight": 2}
MOE_NAMES = {  # model_type -> (the MLP's module, its experts' gate / up / down names)
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
# Phi-3's fused matrices (rows q | k | v, gate | up), each served as its parts under the
# Llama names (`fused_parts`); LongRoPE's factors are metadata (gguf_config.py).
PHI3_FUSED_TENSORS = ("attn_qkv.weight", "ffn_up.weight")
PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
TOP_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAME_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_T = gguf.GGMLQuantizationType
# The block formats the engine runs as they are, by the kernels' names (one table: ops/quant.py).
QUANTIZED_TYPES = GGML_TYPES
DENSE_TYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}


@dataclass(frozen=True)
class GGUFBlocks:
    """An [n, k] matrix in a GGUF block format: `blocks` [n, k / block * block_bytes]."""

    qtype: str
    n: int
    k: int
    blocks: torch.Tensor  # uint8, row-major, its own memory (not the file's mapping)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def expected_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the checkpoint of `config` must hold."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_rows = config["num_attention_heads"] * head_dim
    kv_rows = config["num_key_value_heads"] * head_dim
    ffn = config["intermediate_size"]
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    if config.get("attention_bias"):
        per_layer["self_attn.q_proj.bias"] = (q_rows,)
        per_layer["self_attn.k_proj.bias"] = (kv_rows,)
        per_layer["self_attn.v_proj.bias"] = (kv_rows,)
    if config["model_type"] in ("qwen3", "gemma3_text"):
        per_layer["self_attn.q_norm.weight"] = (head_dim,)
        per_layer["self_attn.k_norm.weight"] = (head_dim,)
    if config["model_type"] == "gemma3_text":
        per_layer["pre_feedforward_layernorm.weight"] = (hidden,)
        per_layer["post_feedforward_layernorm.weight"] = (hidden,)
    if config["model_type"] in MOE_NAMES:
        if config["model_type"] == "qwen3_moe":
            per_layer["self_attn.q_norm.weight"] = (head_dim,)
            per_layer["self_attn.k_norm.weight"] = (head_dim,)
            experts, inter = config["num_experts"], config["moe_intermediate_size"]
        else:
            experts, inter = config["num_local_experts"], ffn
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del per_layer[name]
        module, _ = MOE_NAMES[config["model_type"]]
        per_layer[f"{module}.gate.weight"] = (experts, hidden)
        for e in range(experts):
            gate, up, down = expert_names(config["model_type"], e)
            per_layer[gate] = per_layer[up] = (inter, hidden)
            per_layer[down] = (hidden, inter)
    for layer in range(config["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    return shapes


def expert_names(model_type: str, e: int | str) -> tuple[str, str, str]:
    """Expert e's gate, up and down matrices, by their names inside a layer (HF's, as
    `MOE_NAMES` spells them)."""
    module, names = MOE_NAMES[model_type]
    return tuple(f"{module}.experts.{e}.{name}.weight" for name in names)


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """The HF name of llama.cpp tensor `gguf_name`; an error for a tensor we cannot place.
    A sparse layer's experts tensor names its experts' matrices with "{e}" for the index."""
    if gguf_name in TOP_TENSOR_NAMES:
        return TOP_TENSOR_NAMES[gguf_name]
    names = GEMMA3_BLOCK_TENSOR_NAMES if model_type == "gemma3_text" else BLOCK_TENSOR_NAMES
    match = _BLOCK_NAME_RE.match(gguf_name)
    if match and model_type in MOE_NAMES:
        module, _ = MOE_NAMES[model_type]
        if match.group(2) == ROUTER_TENSOR:
            return f"model.layers.{match.group(1)}.{module}.gate.weight"
        if match.group(2) in EXPERT_TENSORS:
            which = EXPERT_TENSORS[match.group(2)]
            return f"model.layers.{match.group(1)}.{expert_names(model_type, '{e}')[which]}"
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise GGUFFormatError(f"GGUF tensor {gguf_name!r} has no place in the models ringllm runs")


def fused_parts(leaf: str, config: dict) -> list[tuple[str, int, int]]:
    """(HF name inside a layer, first row, rows) of each part of Phi-3's fused `leaf`."""
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    if leaf == "attn_qkv.weight":
        return [
            ("self_attn.q_proj.weight", 0, q),
            ("self_attn.k_proj.weight", q, kv),
            ("self_attn.v_proj.weight", q + kv, kv),
        ]
    inter = config["intermediate_size"]
    return [("mlp.gate_proj.weight", 0, inter), ("mlp.up_proj.weight", inter, inter)]


def expert_slices(tensor: GGUFTensor) -> list[GGUFTensor]:
    """A 3D experts tensor (GGUF shape [cols, rows, E]) as E matrices, views of its data."""
    if len(tensor.shape) != 3:
        raise GGUFFormatError(
            f"GGUF tensor {tensor.name!r} has shape {tensor.shape}; experts come as one "
            "3D tensor [columns, rows, experts] per matrix"
        )
    cols, rows, experts = (int(d) for d in tensor.shape)
    each = tensor.n_bytes // experts
    data = tensor.data
    out = []
    for e in range(experts):
        part = data[e] if data.ndim == 3 else data[e * rows : (e + 1) * rows]
        out.append(
            GGUFTensor(
                f"{tensor.name}[{e}]", tensor.tensor_type, (cols, rows), part, each,
                tensor.offset + e * each,
            )
        )  # fmt: skip
    return out


def rotary_row_order(num_rows: int, num_heads: int) -> np.ndarray:
    """The file row each HF row of a llama q / k projection is in.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3)... while HF rotates (x_i, x_{i+d/2}),
    so its converter stores each head's rows interleaved: file row 2j is HF row j and file
    row 2j+1 is HF row j + d/2. HF row r of a head is therefore file row
    2r (r < d/2) or 2(r - d/2) + 1."""
    if num_rows % (2 * num_heads):
        raise GGUFFormatError(
            f"projection has {num_rows} rows, not a multiple of 2 * {num_heads} heads"
        )
    head_dim = num_rows // num_heads
    half = head_dim // 2
    r = np.arange(head_dim)
    in_head = np.where(r < half, 2 * r, 2 * (r - half) + 1)
    return (np.arange(num_heads)[:, None] * head_dim + in_head[None, :]).reshape(-1)


class GGUFWeightSource:
    """The tensors of one GGUF file, by HF name (see the module docstring)."""

    def __init__(self, gguf_path: Path, reader: GGUFFile | None = None) -> None:
        self.path = Path(gguf_path)
        self.reader = reader or open_gguf(self.path)
        self.config = build_hf_config(self.reader)
        _, self.architecture = architecture_of(self.reader)
        expected = expected_tensor_shapes(self.config)
        self._tensors: dict[str, GGUFTensor] = {}
        self._part_rows: dict[str, np.ndarray] = {}  # a fused tensor's part: its file rows
        # Gemma's RMSNorm weights: llama.cpp stores 1 + w, HF (and so the model) w
        self._norm_shift = 1.0 if self.config["model_type"] == "gemma3_text" else 0.0
        for name, tensor, rows in self._named_tensors():
            if rows is not None:
                self._part_rows[name] = rows
            if name not in expected:
                raise GGUFFormatError(
                    f"GGUF tensor {tensor.name!r} ({name}) is outside the "
                    f"{self.config['num_hidden_layers']}-layer "
                    f"{self.config['architectures'][0]} its metadata describes"
                )
            if tensor.tensor_type not in QUANTIZED_TYPES and tensor.tensor_type not in DENSE_TYPES:
                raise GGUFFormatError(
                    f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, a type ringllm "
                    f"cannot run; it runs {_type_names()}"
                )
            shape = _hf_shape(tensor)
            if rows is not None:
                if shape[0] < int(rows[-1]) + 1:
                    raise GGUFFormatError(
                        f"GGUF tensor {tensor.name!r} has {shape[0]} rows; the metadata "
                        f"implies at least {int(rows[-1]) + 1} (its part {name})"
                    )
                shape = (len(rows), *shape[1:])
            if shape != expected[name]:
                raise GGUFFormatError(
                    f"GGUF tensor {tensor.name!r} has shape {shape}; "
                    f"the metadata implies {expected[name]} for {name}"
                )
            self._tensors[name] = tensor
        missing = sorted(set(expected) - set(self._tensors))
        if missing:
            raise GGUFFormatError(
                f"GGUF lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}"
            )

    def _named_tensors(self):
        """(HF name, tensor, rows) of every tensor of the file: a 3D experts tensor as its
        E experts' matrices, Phi-3's fused matrices as their parts (rows: the part's rows
        of the file's tensor; None: all)."""
        model_type = self.config["model_type"]
        for tensor in self.reader.tensors:
            match = _BLOCK_NAME_RE.match(tensor.name)
            if model_type == "phi3" and tensor.name in PHI3_ROPE_FACTORS:
                continue  # LongRoPE's factors: read into the config
            if model_type == "phi3" and match and match.group(2) in PHI3_FUSED_TENSORS:
                prefix = f"model.layers.{match.group(1)}."
                for leaf, start, count in fused_parts(match.group(2), self.config):
                    yield prefix + leaf, tensor, np.arange(start, start + count)
                continue
            name = hf_tensor_name(tensor.name, model_type)
            if "{e}" not in name:
                yield name, tensor, None
            else:
                for e, part in enumerate(expert_slices(tensor)):
                    yield name.format(e=e), part, None

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def qtype(self, name: str) -> str | None:
        """The block format of tensor `name` ("q4_k", ...), None for F32 / F16 / BF16."""
        return QUANTIZED_TYPES.get(self._tensor(name).tensor_type)

    def file_bytes(self) -> int:
        """The bytes of every tensor in the file (what a decode step streams, roughly)."""
        return sum(int(t.n_bytes) for t in self.reader.tensors)

    def get(
        self, name: str, shard: Shard | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """Tensor `name` (its `shard`) in HF orientation, dequantized to float32 when it
        is in a block format (F16 / BF16 come back in their own dtype)."""
        tensor = self._tensor(name)
        rows = self._rows(name, tensor, shape)
        data = np.asarray(tensor.data)
        if tensor.tensor_type in DENSE_TYPES:
            full = data.reshape(_hf_shape(tensor))
            if rows is not None:
                full = full[rows]
            out = np.array(_slice(full, shard, name))
            if tensor.tensor_type == gguf.GGMLQuantizationType.BF16:  # uint16 bit patterns
                out = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
            else:
                out = torch.from_numpy(out)
            if self._norm_shift and name.endswith("norm.weight"):
                # exact: a stored 1 + w within [0.5, 2] less 1 rounds nothing (Sterbenz)
                out = (out.float() - self._norm_shift).to(out.dtype)
            return out
        blocks = self._block_rows(name, tensor, data, rows, shard)
        dense = gguf.quants.dequantize(blocks, tensor.tensor_type)
        return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32))

    def get_blocks(
        self, name: str, shard: Shard | None = None, shape: tuple[int, ...] | None = None
    ) -> GGUFBlocks:
        """Matrix `name` (its `shard`) in its block format, as it is in the file."""
        tensor = self._tensor(name)
        qtype = QUANTIZED_TYPES.get(tensor.tensor_type)
        if qtype is None:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is {tensor.tensor_type.name}, not blocks"
            )
        rows = self._rows(name, tensor, shape)
        blocks = self._block_rows(name, tensor, np.asarray(tensor.data), rows, shard)
        block_size, _ = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        n = blocks.shape[0]
        k = blocks.shape[1] // self._block_bytes(tensor) * block_size
        return GGUFBlocks(qtype, n, k, torch.from_numpy(blocks))

    def mapped_rows(self, name: str) -> np.ndarray:
        """Matrix `name`'s rows of blocks mapped read-only from the file on their own (no
        copy, and a mapping apart from the loader's: only the pages of rows looked up are
        ever resident). Only for a matrix whose rows are in HF order (not a llama q / k)."""
        tensor = self._tensor(name)
        if tensor.tensor_type not in QUANTIZED_TYPES or self._rows(name, tensor, None) is not None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no mapped rows of blocks")
        shape = tensor.data.shape
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=shape)

    # ---- helpers -----------------------------------------------------------------------

    def _tensor(self, name: str) -> GGUFTensor:
        if name not in self._tensors:
            raise KeyError(f"tensor {name!r} is missing from the GGUF file {self.path}")
        return self._tensors[name]

    def _rows(self, name: str, tensor: GGUFTensor, shape) -> np.ndarray | None:
        """Checks the HF shape; the file row of each HF row where they differ (llama q / k,
        a part of a fused tensor)."""
        hf_shape = _hf_shape(tensor)
        part = self._part_rows.get(name)
        if part is not None:
            hf_shape = (len(part), *hf_shape[1:])
        if shape is not None and hf_shape != tuple(shape):
            raise GGUFFormatError(
                f"{self.path.name}: tensor {tensor.name!r} ({name}) has shape {hf_shape}; "
                f"the metadata implies {tuple(shape)}"
            )
        if part is not None:
            return part
        if not self.architecture.permuted_qk:
            return None
        if name.endswith("q_proj.weight"):
            return rotary_row_order(hf_shape[0], self.config["num_attention_heads"])
        if name.endswith("k_proj.weight"):
            return rotary_row_order(hf_shape[0], self.config["num_key_value_heads"])
        return None

    def _block_bytes(self, tensor: GGUFTensor) -> int:
        return gguf.GGML_QUANT_SIZES[tensor.tensor_type][1]

    def _block_rows(self, name, tensor, data: np.ndarray, rows, shard) -> np.ndarray:
        """The shard's rows of blocks, copied out of the file's mapping."""
        if data.ndim != 2:
            data = data.reshape(-1, data.shape[-1])
        if rows is not None:
            data = data[rows]
        if shard is None or shard.size == 1:
            return np.array(data)
        if shard.dim == 0:
            return np.array(_slice(data, shard, name))
        block_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
        k = _hf_shape(tensor)[1]
        if k % (shard.size * block_size):
            raise GGUFFormatError(
                f"tensor {name!r}: its {k} columns do not split into {shard.size} shards of "
                f"whole {tensor.tensor_type.name} blocks ({block_size} columns each); use "
                "another tensor_parallel_size"
            )
        per_shard = k // shard.size // block_size * self._block_bytes(tensor)
        return np.array(data[:, shard.rank * per_shard : (shard.rank + 1) * per_shard])


def _hf_shape(tensor: GGUFTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first, so numpy's (rows, cols) is the reversed list.
    return tuple(int(d) for d in reversed(tensor.shape))


def _slice(array: np.ndarray, shard: Shard | None, name: str) -> np.ndarray:
    """`shard` of a dense array (or of rows of blocks, dim 0), as WeightSource cuts it."""
    if shard is None or shard.size == 1:
        return array
    extent = array.shape[shard.dim]
    if shard.padded:
        part = -(-extent // shard.size)
        start, stop = min(extent, shard.rank * part), min(extent, (shard.rank + 1) * part)
    else:
        if extent % shard.size:
            raise GGUFFormatError(
                f"tensor {name!r}: dim {shard.dim} of size {extent} does not split into "
                f"{shard.size} equal shards"
            )
        part = extent // shard.size
        start, stop = shard.rank * part, (shard.rank + 1) * part
    index = [slice(None)] * array.ndim
    index[shard.dim] = slice(start, stop)
    return array[tuple(index)]


def _type_names() -> str:
    names = [t.name for t in (*QUANTIZED_TYPES, *DENSE_TYPES)]
    return ", ".join(names)
