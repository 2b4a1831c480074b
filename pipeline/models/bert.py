"""BERT encoders (sentence-transformers' all-MiniLM-L6-v2 and its kind): embeddings only.

An encoder reads its whole prompt at once, every position attending to every other
(bidirectional, no causal mask), so the engine runs it differently from a decoder:

- `encoder_only`: the engine core turns chunked prefill and the prefix cache off for it
  (a prompt must be one step; a cached block holds nothing an encoder can start from),
  and the front end takes pooling requests only (pipeline/pooling.py).
- No KV cache is read or written: the model asks for the smallest one there is (one
  "layer" of one head of size 1), which the scheduler still counts blocks in.
- Attention runs over the step's prompts padded into one batch (torch's
  scaled_dot_product_attention, a key mask per prompt): one call per layer.

    x = LayerNorm(word[ids] + position[positions] + token_type[0])
    each layer: x = LayerNorm(x + O(attention(Q x, K x, V x)))
                x = LayerNorm(x + W2 gelu(W1 x))
    -> x: the last hidden state, which the pooler reads (mean, for MiniLM)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ringllm.pipeline.models.hf_config import ArchConfig
from ringllm.pipeline.models.linear import linear, prepack
from ringllm.pipeline.models.registry import register
from ringllm.pipeline.models.stages import StageInfo


@dataclass
class BertLayer:
    qkv: object  # [3H, H]: query, key, value rows (each matrix in models/linear.py's layout)
    qkv_bias: torch.Tensor
    out: object
    out_bias: torch.Tensor
    attn_norm: list[torch.Tensor]
    up: object
    up_bias: torch.Tensor
    down: object
    down_bias: torch.Tensor
    mlp_norm: list[torch.Tensor]


class _Padding:
    """The step's prompts as one padded batch [R, L, ...] for attention: a prompt's rows
    at its positions (a prompt is computed whole, from position 0), and a key mask that
    keeps each query to its own prompt's positions. One attention call per layer."""

    def __init__(self, batch) -> None:
        starts = batch.query_start_loc.to(torch.int64)
        lengths = starts[1:] - starts[:-1]
        self.length = int(lengths.max())
        self.row = torch.repeat_interleave(torch.arange(len(lengths)), lengths.cpu()).to(
            lengths.device
        )
        self.position = batch.positions
        keys = torch.arange(self.length, device=lengths.device)
        # [R, 1, 1, L]: every query of a prompt sees its prompt's keys, none of the padding
        self.mask = (keys[None, :] < lengths[:, None])[:, None, None, :]
        self.num_rows = len(lengths)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        padded = rows.new_zeros((self.num_rows, self.length, rows.shape[-1]))
        padded[self.row, self.position] = rows
        return padded

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[self.row, self.position]


@register("BertModel")
class BertModel:
    encoder_only = True
    num_kv_heads = 1  # the smallest KV cache the runner can allocate (unused)
    head_dim = 1

    @classmethod
    def adapt_config(cls, arch: ArchConfig) -> ArchConfig:
        return arch

    @staticmethod
    def layer_windows(arch: ArchConfig) -> list[int]:
        return [0]

    def __init__(
        self,
        arch: ArchConfig,
        ops,
        dtype: torch.dtype,
        device: str,
        max_positions: int,
        comm=None,
        stage: StageInfo | None = None,
        quantization: str | None = None,
    ) -> None:
        if comm is not None and comm.world_size > 1:
            raise ValueError("tensor_parallel_size: an encoder (BERT) runs on one rank only")
        if stage is not None and stage.size > 1:
            raise ValueError("pipeline_parallel_size: an encoder (BERT) runs on one stage only")
        if quantization is not None:
            raise ValueError(f"quantization: {quantization!r} is not for encoders (BERT)")
        raw = arch.raw_config or {}
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type: {raw['position_embedding_type']!r}; ringllm's BERT "
                "takes absolute position embeddings only"
            )
        if raw.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act: {raw['hidden_act']!r} is not a GELU")
        self.arch = arch
        self.ops = ops
        self.dtype = dtype
        self.device = device
        self.num_heads = arch.num_attention_heads
        self.eps = float(raw.get("layer_norm_eps", 1e-12))
        self.gelu = "tanh" if raw.get("hidden_act") in ("gelu_new", "gelu_pytorch_tanh") else "none"
        self.max_positions = max_positions
        self.stage = stage or StageInfo.whole(1)
        self.layers: list[BertLayer] = []

    @property
    def num_local_layers(self) -> int:
        return 1  # KV caches: one unused pair (see the module docstring)

    def load_weights(self, source) -> None:
        a = self.arch
        h, inter = a.hidden_size, a.intermediate_size

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return source.get(name, shape=shape).to(device=self.device, dtype=self.dtype)

        type_vocab = int((a.raw_config or {}).get("type_vocab_size", 2))
        self.word = get("embeddings.word_embeddings.weight", (a.vocab_size, h))
        self.position = get("embeddings.position_embeddings.weight", (a.max_position_embeddings, h))
        self.token_type = get("embeddings.token_type_embeddings.weight", (type_vocab, h))[0]
        self.embed_norm = self._norm(get, "embeddings.LayerNorm", h)
        for i in range(a.num_hidden_layers):
            p = f"encoder.layer.{i}."
            parts = ("query", "key", "value")
            self.layers.append(
                BertLayer(
                    qkv=prepack(
                        torch.cat([get(f"{p}attention.self.{n}.weight", (h, h)) for n in parts])
                    ),
                    qkv_bias=torch.cat([get(f"{p}attention.self.{n}.bias", (h,)) for n in parts]),
                    out=prepack(get(f"{p}attention.output.dense.weight", (h, h))),
                    out_bias=get(f"{p}attention.output.dense.bias", (h,)),
                    attn_norm=self._norm(get, f"{p}attention.output.LayerNorm", h),
                    up=prepack(get(f"{p}intermediate.dense.weight", (inter, h))),
                    up_bias=get(f"{p}intermediate.dense.bias", (inter,)),
                    down=prepack(get(f"{p}output.dense.weight", (h, inter))),
                    down_bias=get(f"{p}output.dense.bias", (h,)),
                    mlp_norm=self._norm(get, f"{p}output.LayerNorm", h),
                )
            )

    @staticmethod
    def _norm(get, prefix: str, h: int) -> list[torch.Tensor]:
        return [get(f"{prefix}.weight", (h,)), get(f"{prefix}.bias", (h,))]  # (a list: sleep.py)

    def forward(self, batch, kv_caches, inputs_embeds=None, intermediate=None) -> torch.Tensor:
        """The last hidden states [T, H] of the step's prompts, each prompt whole."""
        if int(batch.positions.max()) >= self.arch.max_position_embeddings:
            raise ValueError(
                f"a prompt past the model's {self.arch.max_position_embeddings} positions"
            )
        x = self.word[batch.input_ids] + self.position[batch.positions] + self.token_type
        x = F.layer_norm(x, x.shape[-1:], *self.embed_norm, self.eps)
        padding = _Padding(batch)
        for layer in self.layers:
            x = self._layer(layer, x, padding)
        return x

    def _layer(self, layer: BertLayer, x: torch.Tensor, padding: _Padding) -> torch.Tensor:
        h, heads = x.shape[-1], self.num_heads
        qkv = padding.pad(linear(x, layer.qkv, layer.qkv_bias))  # [R, L, 3H]
        rows, length = qkv.shape[:2]
        q, k, v = (
            part.reshape(rows, length, heads, h // heads).transpose(1, 2)
            for part in qkv.split(h, dim=-1)
        )
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=padding.mask)
        context = padding.unpad(attended.transpose(1, 2).reshape(rows, length, h))
        x = F.layer_norm(
            x + linear(context, layer.out, layer.out_bias), (h,), *layer.attn_norm, self.eps
        )
        up = F.gelu(linear(x, layer.up, layer.up_bias), approximate=self.gelu)
        x = F.layer_norm(
            x + linear(up, layer.down, layer.down_bias), (h,), *layer.mlp_norm, self.eps
        )
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """An encoder has no LM head: the rows the sampler never reads (every request to an
        encoder pools), zeros."""
        return torch.zeros((hidden.shape[0], self.arch.vocab_size), dtype=torch.float32)
