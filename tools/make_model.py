"""`ringllm make-model`: a small model of a real architecture with random weights.

Writes a Hugging Face folder (config.json, model.safetensors or a sharded index,
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja) that
transformers loads as it would a downloaded checkpoint. The tokenizer is a byte-level BPE
trained with `tokenizers` on the Python standard library's own source text, read in a
fixed order, so the same arguments always give the same folder. Tests build their models
with this in seconds; nothing is committed or downloaded.

Weights are scaled so the logits are far from uniform (lm_head rows of norm ~ sqrt(H)/2):
greedy decoding then has clear winners and is a meaningful check, not a coin flip decided
by rounding.

`--arch llava` writes a LLaVA-1.5 (transformers' LlavaForConditionalGeneration): the
Llama decoder of the other flags behind a tiny CLIP vision tower (`VisionShape`, tools/make_llava.py) and its
projector, an `<image>` special token (its id is config.json's `image_token_index`), a chat
template that puts `<image>` where a message has an image part, and the image processor's
configs (preprocessor_config.json: CLIP's resize, crop and normalization; processor_config.json).

`--draft-of DIR --num-layers N` writes instead a layer-truncated copy of an existing
folder (`make_draft`): the same tokenizer and embeddings, final norm and head, only layers
0..N-1: a draft model for speculative decoding without a model hub.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ringllm.tools.make_llava import (
    IMAGE_TOKEN,
    LLAVA_CHAT_TEMPLATE,
    VisionShape,
    llava_config,
    llava_weights,
    write_processor_configs,
)

ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "llava": ("LlavaForConditionalGeneration", "llava"),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    arch: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear | llama3
    dtype: str = "float32"
    config_style: str = "legacy"  # legacy: rope_theta/torch_dtype; new: rope_parameters/dtype
    num_shards: int = 1
    seed: int = 0
    model_vocab_size: int | None = (
        None  # config vocab (>= the tokenizer's); default: the tokenizer's
    )
    config_only: bool = False  # no weights: for --load-format dummy at large shapes
    # gemma3: the sliding layers' window (five sliding layers to one global, as Gemma 3)
    sliding_window: int = 16
    final_logit_softcapping: float | None = None
    # phi3: the fraction of each head the rotary turns (Phi-4-mini: 0.75), and
    # original_max_position_embeddings (with rope_scaling "longrope")
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # qwen3_moe / mixtral: experts per sparse layer, chosen per token, each one's MLP size
    # (mixtral: intermediate_size), Qwen3-MoE's renormalized top-k and dense layers
    num_experts: int = 8
    experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()


def make_model(out: Path, shape: ModelShape, vision: VisionShape | None = None) -> Path:
    """Writes the model folder `out` and returns it (`vision`: llava's tower, default
    VisionShape())."""
    if shape.arch not in ARCHS:
        raise ValueError(f"arch: {shape.arch!r} is not one of {sorted(ARCHS)}")
    llava = shape.arch == "llava"
    vision = vision or VisionShape()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape.vocab_size)
    if llava:
        tokenizer.add_special_tokens([IMAGE_TOKEN])
    tokenizer.save(str(out / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    if shape.model_vocab_size is not None:
        if shape.model_vocab_size < vocab_size:
            raise ValueError(
                f"model_vocab_size: {shape.model_vocab_size} is smaller than the tokenizer's {vocab_size} tokens"
            )
        vocab_size = shape.model_vocab_size
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + [IMAGE_TOKEN] * llava}
    text_shape = dataclasses.replace(shape, arch="llama") if llava else shape
    config = _config(text_shape, vocab_size, ids)
    if llava:
        config = llava_config(shape, vision, config, ids[IMAGE_TOKEN])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    template = LLAVA_CHAT_TEMPLATE if llava else CHATML_TEMPLATE
    tokenizer_config = _tokenizer_config(ids, template)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "chat_template.jinja").write_text(template)
    if llava:
        write_processor_configs(out, vision)
    if not shape.config_only:
        weights = random_weights(text_shape, vocab_size)
        if llava:
            weights = llava_weights(shape, vision, weights)
        _save_weights(out, weights, shape.num_shards)
    return out


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer


def _corpus(max_bytes: int = 400_000):
    """Text found on every machine with Python: the stdlib's sources, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def _config(shape: ModelShape, vocab_size: int, ids: dict[str, int]) -> dict:
    arch_name, model_type = ARCHS[shape.arch]
    head_dim = shape.head_dim or shape.hidden_size // shape.num_heads
    config = {
        "architectures": [arch_name],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "attention_bias": shape.arch == "qwen2",
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if shape.arch in ("qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"):
        config.update(sliding_window=None, use_sliding_window=False)
    if shape.arch == "qwen3_moe":
        config.update(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=shape.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(shape.mlp_only_layers),
            head_dim=head_dim,
            output_router_logits=False,
        )
    if shape.arch == "mixtral":
        config.update(
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_tok,
            intermediate_size=shape.moe_intermediate_size,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    if shape.arch == "gemma3":
        _gemma3_config(config, shape, head_dim)
        return config
    if shape.arch == "phi3":
        rope = _phi3_config(config, shape, head_dim, ids)
    else:
        rope = _rope_scaling(shape)
    if shape.config_style == "legacy":
        config.update(rope_theta=shape.rope_theta, rope_scaling=rope, torch_dtype=shape.dtype)
    else:
        config.update(
            rope_parameters={"rope_theta": shape.rope_theta, **(rope or {"rope_type": "default"})}
        )
        config.update(dtype=shape.dtype)
    return config


def _gemma3_config(config: dict, shape: ModelShape, head_dim: int) -> None:
    """Gemma 3's own fields: layer types, the two rotary bases, its activation and scales."""
    del config["hidden_act"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=head_dim,
        sliding_window=shape.sliding_window,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
            for i in range(shape.num_layers)
        ],
        final_logit_softcapping=shape.final_logit_softcapping,
        attn_logit_softcapping=None,
    )
    rope = _rope_scaling(shape)
    if shape.config_style == "legacy":
        config.update(
            rope_theta=shape.rope_theta * 100,
            rope_local_base_freq=shape.rope_theta,
            rope_scaling=rope,
            torch_dtype=shape.dtype,
        )
    else:
        config.update(
            rope_parameters={
                "full_attention": {
                    "rope_theta": shape.rope_theta * 100,
                    **(rope or {"rope_type": "default"}),
                },
                "sliding_attention": {"rope_theta": shape.rope_theta, "rope_type": "default"},
            },
            dtype=shape.dtype,
        )


def _phi3_config(config: dict, shape: ModelShape, head_dim: int, ids: dict) -> dict | None:
    """Phi-3's own fields; its rope scaling (LongRoPE: one factor per rotary pair)."""
    config.update(
        partial_rotary_factor=shape.partial_rotary_factor,
        original_max_position_embeddings=(
            shape.original_max_position_embeddings or shape.max_position_embeddings
        ),
        sliding_window=None,
        pad_token_id=ids["<|endoftext|>"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    if shape.rope_scaling != "longrope":
        return _rope_scaling(shape)
    pairs = int(head_dim * shape.partial_rotary_factor) // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.5 * i for i in range(pairs)],
    }


def _rope_scaling(shape: ModelShape) -> dict | None:
    if shape.rope_scaling == "none":
        return None
    if shape.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": 2.0}
    if shape.rope_scaling == "llama3":
        return {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    raise ValueError(
        f"rope_scaling: {shape.rope_scaling!r} is not one of none, linear, llama3"
        + (" (longrope: phi3 only)" if shape.rope_scaling == "longrope" else "")
    )


def _tokenizer_config(ids: dict[str, int], template: str = CHATML_TEMPLATE) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 2048,
        "chat_template": template,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t, i in ids.items()
        },
    }


def random_weights(shape: ModelShape, vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(shape.seed)
    h, inter = shape.hidden_size, shape.intermediate_size
    d = shape.head_dim or h // shape.num_heads
    q_size, kv_size = shape.num_heads * d, shape.num_kv_heads * d

    def mat(rows: int, cols: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (std if std is not None else cols**-0.5)

    def norm(n: int) -> torch.Tensor:
        # Gemma's RMSNorm multiplies by 1 + w: its weights are stored near 0
        return (shape.arch != "gemma3") + 0.1 * torch.randn(n, generator=g)

    w = {"model.embed_tokens.weight": mat(vocab_size, h, 0.5), "model.norm.weight": norm(h)}
    if not shape.tie_word_embeddings:
        w["lm_head.weight"] = mat(vocab_size, h, 0.5)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(q_size, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv_size, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv_size, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, q_size)
        if shape.arch in ("qwen3_moe", "mixtral") and i not in shape.mlp_only_layers:
            w.update(_experts(shape, p, mat))
        else:
            w[p + "mlp.gate_proj.weight"] = mat(inter, h)
            w[p + "mlp.up_proj.weight"] = mat(inter, h)
            w[p + "mlp.down_proj.weight"] = mat(h, inter)
        if shape.arch == "qwen2":
            for name, n in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(n, generator=g)
        if shape.arch in ("qwen3", "gemma3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(d)
            w[p + "self_attn.k_norm.weight"] = norm(d)
        if shape.arch == "gemma3":
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h)
        if shape.arch == "phi3":  # fused as Phi-3's checkpoints are
            w[p + "self_attn.qkv_proj.weight"] = torch.cat(
                [w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"]
            )
            w[p + "mlp.gate_up_proj.weight"] = torch.cat(
                [w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]
            )
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        shape.dtype
    ]
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def _experts(shape: ModelShape, p: str, mat) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts, named per expert as the published checkpoints
    name them (gguf_weights.MOE_NAMES: Qwen3-MoE's mlp.experts.E.gate_proj, Mixtral's
    block_sparse_moe.experts.E.w1)."""
    from ringllm.pipeline.models.gguf_weights import MOE_NAMES, expert_names

    h, inter = shape.hidden_size, shape.moe_intermediate_size
    module, _ = MOE_NAMES[shape.arch]
    # router rows of norm ~4: clear winners, so the top-k choice is no coin flip
    w = {f"{p}{module}.gate.weight": mat(shape.num_experts, h, 4 * h**-0.5)}
    for e in range(shape.num_experts):
        gate, up, down = expert_names(shape.arch, e)
        w[p + gate] = mat(inter, h)
        w[p + up] = mat(inter, h)
        w[p + down] = mat(h, inter)
    return w


def _save_weights(out: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(weights)
    weight_map = {}
    for s in range(num_shards):
        file_name = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::num_shards]}
        save_file(part, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# weight files, not copied into a truncated copy (its weights are written anew)
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)(\.index\.json)?$")
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.")


def make_draft(out: Path, source: Path, num_layers: int) -> Path:
    """Writes `out`: `source` (an HF folder with safetensors weights) cut to its first
    `num_layers` layers; every other file (tokenizer, configs, chat template) copied."""
    from ringllm.pipeline.models.weights import WeightSource

    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= num_layers <= total:
        raise ValueError(
            f"num_layers: must be in [1, {total}] (the layers of {source}), got {num_layers}"
        )
    if out.resolve() == source.resolve():
        raise ValueError(f"out: {out} is the source folder; choose another folder")
    weights = WeightSource(source)  # before anything is written: a folder without weights fails
    kept = {}
    for name in weights.names():
        layer = _LAYER_TENSOR.match(name)
        if layer is None or int(layer.group(1)) < num_layers:
            kept[name] = weights.get(name).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name != "config.json" and not _WEIGHT_FILE.match(path.name):
            shutil.copy2(path, out / path.name)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen3 ...)
        config["layer_types"] = config["layer_types"][:num_layers]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a small random-weight model, or a layer-truncated draft of one (HF folder)",
    )
    p.add_argument("out", type=Path, help="output folder")
    d = ModelShape()
    p.add_argument(
        "--draft-of",
        type=Path,
        default=None,
        metavar="DIR",
        help="write DIR's first --num-layers layers instead (a draft model; shape flags ignored)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help=f"layers (default {d.num_layers}; with --draft-of: required, the layers kept)",
    )
    p.add_argument("--arch", choices=sorted(ARCHS), default=d.arch)
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "num_kv_heads",
        "vocab_size",
        "max_position_embeddings",
        "num_shards",
        "seed",
        "sliding_window",
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--rope-theta", type=float, default=d.rope_theta)
    p.add_argument(
        "--rope-scaling",
        choices=["none", "linear", "llama3", "longrope"],
        default=d.rope_scaling,
        help="longrope: phi3 only",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=d.dtype)
    p.add_argument("--config-style", choices=["legacy", "new"], default=d.config_style)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument(
        "--final-logit-softcapping", type=float, default=None, help="gemma3: tanh cap of logits"
    )
    p.add_argument(
        "--partial-rotary-factor",
        type=float,
        default=d.partial_rotary_factor,
        help="phi3: the fraction of each head the rotary turns",
    )
    p.add_argument(
        "--original-max-position-embeddings",
        type=int,
        default=None,
        help="phi3: the pretraining context (LongRoPE's long factors past it)",
    )
    p.add_argument(
        "--model-vocab-size",
        type=int,
        default=None,
        help="config vocab size (default: the tokenizer's)",
    )
    p.add_argument(
        "--config-only",
        action="store_true",
        help="write no weights (serve with --load-format dummy)",
    )
    moe = p.add_argument_group("mixture of experts (qwen3_moe, mixtral)")
    moe.add_argument("--num-experts", type=int, default=d.num_experts, help="experts per layer")
    moe.add_argument(
        "--experts-per-tok", type=int, default=d.experts_per_tok, help="experts each token uses"
    )
    moe.add_argument(
        "--moe-intermediate-size",
        type=int,
        default=d.moe_intermediate_size,
        help="each expert's MLP size",
    )
    moe.add_argument(
        "--norm-topk-prob",
        action=argparse.BooleanOptionalAction,
        default=d.norm_topk_prob,
        help="qwen3_moe: renormalize the chosen experts' weights (mixtral always does)",
    )
    moe.add_argument(
        "--mlp-only-layers",
        type=int,
        nargs="*",
        default=list(d.mlp_only_layers),
        help="qwen3_moe: layers that keep a dense MLP of --intermediate-size",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.draft_of is not None:
        if args.num_layers is None:
            raise SystemExit("make-model: --draft-of needs --num-layers (the layers to keep)")
        print(make_draft(args.out, args.draft_of, args.num_layers))
        return 0
    fields = {f: getattr(args, f) for f in ModelShape.__dataclass_fields__}
    fields["mlp_only_layers"] = tuple(fields["mlp_only_layers"])
    if fields["num_layers"] is None:
        del fields["num_layers"]  # the shape's default
    out = make_model(args.out, ModelShape(**fields))
    print(out)
    return 0
