"""`ringllm make-gguf`: a Hugging Face folder -> one GGUF file, in any block format ringllm runs.

Tests need GGUF files of every architecture and block format without llama.cpp's converter
(a benchmark peer, never a test dependency): this writes them from the tiny folders
`ringllm make-model` makes, the way llama.cpp's converter lays them out:

    metadata   general.*, {arch}.* hyper-parameters, tokenizer.ggml.* (gpt2 BPE, pre "gpt-2"),
               tokenizer.chat_template
    tensors    llama.cpp's names (gguf_weights.py's tables, inverted), one type per matrix;
               norms, biases and every other 1-D tensor F32; `output.weight` only when the
               head is not tied to the embeddings

    HF q_proj / k_proj rows of one head (llama only)     file rows (llama.cpp's rotary layout)
        0 1 2 .. d/2-1 | d/2 .. d-1                          0 d/2 1 d/2+1 2 ... (pairs)

A matrix whose row length the chosen format cannot hold is written in the nearest format
that can (a warning names them): K-quants need rows of whole 256-value super-blocks and
fall back to Q8_0; the 32-value formats fall back to F16.

Invariants: reading the file back (`GGUFWeightSource`) gives the folder's tensors under
their HF names, in HF row order, within the chosen format's rounding; the config
`gguf_config.build_hf_config` rebuilds from it is the folder's.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import warnings
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from ringllm.pipeline.models.gguf_weights import (
    BLOCK_TENSOR_NAMES,
    EXPERT_TENSORS,
    GEMMA3_BLOCK_TENSOR_NAMES,
    MOE_NAMES,
    ROUTER_TENSOR,
    TOP_TENSOR_NAMES,
)
from ringllm.tools.gguf_quantize import K_QUANTS, QK_K, block_size, quantize

T = gguf.GGMLQuantizationType
TYPES = {
    "f32": T.F32,
    "f16": T.F16,
    "bf16": T.BF16,
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q5_0": T.Q5_0,
    "q5_1": T.Q5_1,
    "q8_0": T.Q8_0,
    "q4_k": T.Q4_K,
    "q5_k": T.Q5_K,
    "q6_k": T.Q6_K,
}
_F = gguf.LlamaFileType
# general.file_type of a file mostly in that type (a pure K-quant file is llama.cpp's "_S").
_FILE_TYPES = {
    T.F32: _F.ALL_F32,
    T.F16: _F.MOSTLY_F16,
    T.BF16: _F.MOSTLY_BF16,
    T.Q4_0: _F.MOSTLY_Q4_0,
    T.Q4_1: _F.MOSTLY_Q4_1,
    T.Q5_0: _F.MOSTLY_Q5_0,
    T.Q5_1: _F.MOSTLY_Q5_1,
    T.Q8_0: _F.MOSTLY_Q8_0,
    T.Q4_K: _F.MOSTLY_Q4_K_S,
    T.Q5_K: _F.MOSTLY_Q5_K_S,
    T.Q6_K: _F.MOSTLY_Q6_K,
}
# HF model_type -> general.architecture (Mistral's GGUFs say "llama" too).
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",  # llama.cpp's Mixtral: the llama architecture with experts
    "phi3": "phi3",
}
_PERMUTED_QK = {"llama"}
_HF_TO_GGUF_BLOCK = {hf: name for name, hf in BLOCK_TENSOR_NAMES.items()}
_GEMMA3_HF_TO_GGUF_BLOCK = {hf: name for name, hf in GEMMA3_BLOCK_TENSOR_NAMES.items()}
# Phi-3's fused matrices keep llama.cpp's fused names (attn_qkv; ffn_up holds gate | up)
_PHI3_HF_TO_GGUF_BLOCK = {
    **_HF_TO_GGUF_BLOCK,
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}
_HF_TO_GGUF_TOP = {hf: name for name, hf in TOP_TENSOR_NAMES.items()}
# a sparse layer's router and stacked experts (see _stack_experts) -> llama.cpp's names
_MOE_TO_GGUF = {
    f"{module}.{name}": gguf_name
    for module, names in MOE_NAMES.values()
    for name, gguf_name in [
        ("gate.weight", ROUTER_TENSOR),
        *((f"experts.{hf}", g) for hf, g in zip(names, EXPERT_TENSORS, strict=True)),
    ]
}
_MOE_MODULES = "|".join(re.escape(module) for module, _ in MOE_NAMES.values())
_EXPERT_RE = re.compile(rf"^model\.layers\.(\d+)\.({_MOE_MODULES})\.experts\.(\d+)\.(\w+)\.weight$")


def make_gguf(
    hf_folder: Path, out_path: Path, qtype: str = "q8_0", overrides: dict[str, str] | None = None
) -> Path:
    """Writes the GGUF `out_path` of HF folder `hf_folder` and returns its path.

    `qtype` is the type of every matrix; `overrides` maps a glob over tensor names (the
    GGUF name, e.g. "output.weight", "blk.*.ffn_down.weight", or the HF name) to the type
    of the matrices it matches, the first matching pattern winning."""
    hf_folder, out_path = Path(hf_folder), Path(out_path)
    config = _read_json(hf_folder / "config.json")
    arch = _architecture(config)
    main_type = _type(qtype, "qtype")
    rules = [
        (pattern, _type(name, f"type of {pattern!r}"))
        for pattern, name in (overrides or {}).items()
    ]
    weights = _stack_experts(_read_weights(hf_folder), config)

    writer = gguf.GGUFWriter(None, arch)
    writer.add_name(hf_folder.name)
    writer.add_file_type(int(_FILE_TYPES[main_type]))
    if main_type not in (T.F32, T.F16, T.BF16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hyper_parameters(writer, config, len(weights["model.embed_tokens.weight"]))
    _add_tokenizer(writer, hf_folder, config, len(weights["model.embed_tokens.weight"]))

    fallbacks = []
    for hf_name, array in weights.items():
        gguf_name = _gguf_name(hf_name, arch)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        if arch in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else _kv_heads(config)
            array = rotary_interleave(array, heads)
        wanted = _choose_type(gguf_name, hf_name, array, main_type, rules)
        stored = _storable_type(wanted, array)
        if stored != wanted:
            fallbacks.append(
                f"{gguf_name} ({array.shape[-1]} columns: {wanted.name} -> {stored.name})"
            )
        if array.ndim == 3:  # experts [E, rows, cols]: quantized row by row, kept 3D
            data = quantize(array.reshape(-1, array.shape[-1]), stored)
            data = data.reshape(*array.shape[:2], *data.shape[1:])
        else:
            data = quantize(array, stored)
        writer.add_tensor(gguf_name, data, raw_dtype=None if stored in (T.F32, T.F16) else stored)
    if fallbacks:
        warnings.warn(
            f"make-gguf: {len(fallbacks)} matrices cannot be held in the type asked for and "
            f"were written in another: {'; '.join(fallbacks)}",
            stacklevel=2,
        )
    _write(writer, out_path)
    return out_path


def rotary_interleave(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """HF q / k projection rows -> llama.cpp's order: each head's halves interleaved, so
    file row 2j is HF row j and file row 2j+1 is HF row j + d/2 (gguf_weights.py's
    `rotary_row_order` undoes it)."""
    num_rows, cols = rows.shape
    if num_rows % (2 * num_heads):
        raise ValueError(
            f"a q / k projection of {num_rows} rows does not split into {num_heads} heads of "
            "even size; check num_attention_heads / num_key_value_heads in config.json"
        )
    head_dim = num_rows // num_heads
    halves = rows.reshape(num_heads, 2, head_dim // 2, cols)
    return np.ascontiguousarray(halves.swapaxes(1, 2).reshape(num_rows, cols))


# ---- metadata -----------------------------------------------------------------------------


def _architecture(config: dict) -> str:
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json model_type is {model_type!r}; make-gguf writes {sorted(ARCHITECTURES)}"
        )
    scaling = config.get("rope_scaling") or (config.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default" and (model_type, rope_type) != ("phi3", "longrope"):
        raise ValueError(
            f"config.json has rope scaling {scaling!r}; make-gguf writes plain rope only "
            "but Phi-3's LongRoPE (ringllm reads no other rope scaling from a GGUF)"
        )
    return ARCHITECTURES[model_type]


def _kv_heads(config: dict) -> int:
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def _add_hyper_parameters(writer: gguf.GGUFWriter, config: dict, vocab_rows: int) -> None:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    rope_theta = config.get("rope_theta")
    if rope_theta is None:
        params = config.get("rope_parameters") or {}
        params = params.get("full_attention", params)  # per layer type: Gemma 3's global
        rope_theta = params.get("rope_theta", 10000.0)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(_kv_heads(config))
    if head_dim != hidden // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(rope_theta))
    if config.get("model_type") != "phi3":  # its own: a partial rotary (_add_phi3_fields)
        writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(vocab_rows)
    if config.get("model_type") == "gemma3_text":
        _add_gemma3_fields(writer, config)
    if config.get("model_type") in MOE_NAMES:
        _add_moe_fields(writer, config)
    if config.get("model_type") == "phi3":
        _add_phi3_fields(writer, config, head_dim)


def _add_phi3_fields(writer: gguf.GGUFWriter, config: dict, head_dim: int) -> None:
    """Phi-3 as llama.cpp's converter writes it: the rotary dimensions (a partial rotary),
    the window (0: none), and with LongRoPE the original context, the attention factor
    and the two factor lists as F32 tensors rope_factors_long / rope_factors_short."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    factor = config.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * float(factor))
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_sliding_window(int(config.get("sliding_window") or 0))
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type != "longrope":
        return
    original = int(
        scaling.get("original_max_position_embeddings")
        or config["original_max_position_embeddings"]
    )
    context = int(config["max_position_embeddings"])
    scale = context / original
    attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(attn_factor)
    for kind in ("long", "short"):
        values = np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", values)


def _add_moe_fields(writer: gguf.GGUFWriter, config: dict) -> None:
    """Experts per layer and per token, each expert's MLP size (Qwen3-MoE), refusing what
    llama.cpp's files cannot say: dense layers among sparse ones, top k left unnormalized."""
    if config["model_type"] == "qwen3_moe":
        if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                "make-gguf: a Qwen3-MoE GGUF has every layer sparse; this config keeps dense "
                "layers (mlp_only_layers / decoder_sparse_step)"
            )
        if not config.get("norm_topk_prob", False):
            raise ValueError(
                "make-gguf: llama.cpp renormalizes a Qwen3-MoE's top k weights; this config "
                "has norm_topk_prob false"
            )
        writer.add_expert_count(int(config["num_experts"]))
        writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
    else:
        writer.add_expert_count(int(config["num_local_experts"]))
    writer.add_expert_used_count(int(config["num_experts_per_tok"]))


def _add_gemma3_fields(writer: gguf.GGUFWriter, config: dict) -> None:
    """Gemma 3's window, its pattern (only where it is not llama.cpp's five to one), the
    sliding layers' rotary base and the logit cap."""
    types = config.get("layer_types")
    if types is not None:
        pattern = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
        if any((t == "full_attention") != ((i + 1) % pattern == 0) for i, t in enumerate(types)):
            raise ValueError("make-gguf: Gemma 3 layer_types must repeat one sliding pattern")
        if pattern != 6:
            writer.add_uint32("gemma3.attention.sliding_window_pattern", pattern)
    if config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
    params = config.get("rope_parameters") or {}
    local = (params.get("sliding_attention") or {}).get("rope_theta")
    writer.add_float32(
        "gemma3.rope.freq_base_swa", float(local or config.get("rope_local_base_freq", 10000.0))
    )
    if config.get("final_logit_softcapping") is not None:
        writer.add_float32(
            "gemma3.final_logit_softcapping", float(config["final_logit_softcapping"])
        )


def _add_tokenizer(writer: gguf.GGUFWriter, hf_folder: Path, config: dict, vocab_rows: int) -> None:
    tokenizer = _read_json(hf_folder / "tokenizer.json")
    _check_pre_tokenizer(tokenizer)
    tokenizer_config = _read_json(hf_folder / "tokenizer_config.json", {})
    tokens, token_types = _vocabulary(tokenizer, vocab_rows)
    ids = {token: token_id for token_id, token in enumerate(tokens)}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges([_merge_text(m) for m in tokenizer["model"].get("merges", [])])
    for key, add in (
        ("bos", writer.add_bos_token_id),
        ("eos", writer.add_eos_token_id),
        ("pad", writer.add_pad_token_id),
    ):
        token_id = _special_id(key, tokenizer_config, config, ids)
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
    template_file = hf_folder / "chat_template.jinja"
    template = (
        template_file.read_text(encoding="utf-8")
        if template_file.is_file()
        else tokenizer_config.get("chat_template")
    )
    if template:
        writer.add_chat_template(template)


def _check_pre_tokenizer(tokenizer: dict) -> None:
    # ringllm rebuilds "gpt-2" as plain byte-level BPE with GPT-2's regex and no prefix
    # space (gguf_tokenizer.py); anything else would tokenize differently once read back.
    pre = tokenizer.get("pre_tokenizer") or {}
    plain = (
        pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space", False)
        and pre.get("use_regex", True)
    )
    if tokenizer["model"].get("type") != "BPE" or not plain:
        raise ValueError(
            f"tokenizer.json is a {tokenizer['model'].get('type')} model with pre-tokenizer "
            f"{pre.get('type')!r}; make-gguf writes GPT-2 byte-level BPE (what "
            "`ringllm make-model` makes) only"
        )


def _vocabulary(tokenizer: dict, vocab_rows: int) -> tuple[list[str], list[int]]:
    """Token strings by id and their llama.cpp types; ids the tokenizer lacks up to the
    embedding's rows become "[PAD<id>]" (UNUSED), as llama.cpp's converter writes them."""
    by_id: dict[int, tuple[str, int]] = {
        token_id: (token, gguf.TokenType.NORMAL)
        for token, token_id in tokenizer["model"]["vocab"].items()
    }
    for added in tokenizer.get("added_tokens", []):
        kind = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    size = max(vocab_rows, max(by_id) + 1)
    if size > vocab_rows:
        raise ValueError(
            f"tokenizer.json has token id {max(by_id)}, past the embedding's {vocab_rows} rows "
            "(config.json vocab_size)"
        )
    unused = gguf.TokenType.UNUSED
    entries = [by_id.get(i, (f"[PAD{i}]", unused)) for i in range(size)]
    return [token for token, _ in entries], [int(kind) for _, kind in entries]


def _merge_text(merge) -> str:
    # tokenizers writes a merge as "a b" (older) or ["a", "b"] (newer)
    return merge if isinstance(merge, str) else " ".join(merge)


def _special_id(key: str, tokenizer_config: dict, config: dict, ids: dict[str, int]):
    """The id of special token `key` (bos / eos / pad): the token tokenizer_config.json
    names, else config.json's id (its first, if a list)."""
    token = tokenizer_config.get(f"{key}_token")
    if isinstance(token, dict):  # an AddedToken serialized as an object
        token = token.get("content")
    if isinstance(token, str) and token in ids:
        return ids[token]
    value = config.get(f"{key}_token_id")
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)


# ---- tensors ------------------------------------------------------------------------------


def _read_weights(hf_folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files as float32 numpy, by HF name."""
    files = sorted(hf_folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{hf_folder} holds no .safetensors file to convert")
    weights = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                weights[name] = f.get_tensor(name).float().numpy()
    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{hf_folder} has no model.embed_tokens.weight: not a decoder checkpoint")
    return weights


def _stack_experts(weights: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """A sparse layer's per-expert matrices stacked into one [E, rows, cols] array each, as
    llama.cpp stores them, under "model.layers.N.<module>.experts.<gate / up / down>"."""
    model_type = config.get("model_type")
    if model_type not in MOE_NAMES:
        return weights
    out, stacked = {}, {}
    for name, array in weights.items():
        match = _EXPERT_RE.match(name)
        if match is None:
            out[name] = array
            continue
        layer, module, e, which = match.groups()
        stacked.setdefault(f"model.layers.{layer}.{module}.experts.{which}", {})[int(e)] = array
    for name, by_expert in stacked.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"make-gguf: {name} lacks experts ({sorted(by_expert)})")
        out[name] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _HF_TO_GGUF_TOP:
        return _HF_TO_GGUF_TOP[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[3] in _MOE_TO_GGUF:
        return f"blk.{parts[2]}.{_MOE_TO_GGUF[parts[3]]}"
    names = {"gemma3": _GEMMA3_HF_TO_GGUF_BLOCK, "phi3": _PHI3_HF_TO_GGUF_BLOCK}.get(
        arch, _HF_TO_GGUF_BLOCK
    )
    parts = hf_name.split(".", 3)  # model . layers . N . rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in names:
        return f"blk.{parts[2]}.{names[parts[3]]}"
    raise ValueError(f"tensor {hf_name!r} has no llama.cpp name make-gguf knows")


def _choose_type(gguf_name, hf_name, array, main_type, rules) -> T:
    if array.ndim == 1 or gguf_name.endswith(ROUTER_TENSOR):
        return T.F32  # norms, biases and routers: F32, as llama.cpp's converter keeps them
    for pattern, qtype in rules:
        if fnmatch.fnmatchcase(gguf_name, pattern) or fnmatch.fnmatchcase(hf_name, pattern):
            return qtype
    return main_type


def _storable_type(qtype: T, array: np.ndarray) -> T:
    """`qtype`, or the format the matrix falls back to when its rows do not fill blocks."""
    cols = array.shape[-1]
    if qtype in K_QUANTS and cols % QK_K:
        qtype = T.Q8_0
    if block_size(qtype) > 1 and cols % block_size(qtype):
        return T.F16
    return qtype


def _type(name: str, what: str) -> T:
    if name.lower() not in TYPES:
        raise ValueError(f"{what}: {name!r} is not one of {', '.join(TYPES)}")
    return TYPES[name.lower()]


def _write(writer: gguf.GGUFWriter, out_path: Path) -> None:
    # Written beside the target and renamed: a reader never sees half a file.
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".partial")
    writer.write_header_to_file(path=partial)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out_path)


def _read_json(path: Path, default=None):
    if not path.is_file():
        if default is not None:
            return default
        raise ValueError(f"{path} does not exist; make-gguf reads a Hugging Face model folder")
    return json.loads(path.read_text(encoding="utf-8"))


# ---- command line -------------------------------------------------------------------------


def _override(text: str) -> tuple[str, str]:
    pattern, sep, name = text.rpartition("=")
    if not sep or not pattern or name.lower() not in TYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not PATTERN=TYPE with TYPE one of {', '.join(TYPES)}"
        )
    return pattern, name


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "make-gguf",
        help="write a GGUF file of a Hugging Face folder in any block format",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("hf_folder", type=Path, help="Hugging Face model folder (make-model's)")
    p.add_argument("out", type=Path, help="GGUF file to write")
    p.add_argument("--type", default="q8_0", choices=list(TYPES), help="type of every matrix")
    p.add_argument(
        "--type-of",
        type=_override,
        action="append",
        default=[],
        metavar="PATTERN=TYPE",
        help="type of the matrices whose GGUF or HF name matches the glob PATTERN "
        "(e.g. 'output.weight=q6_k'); the first matching one wins",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    out = make_gguf(args.hf_folder, args.out, args.type, dict(args.type_of))
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringllm")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-gguf", *(argv or [])])
    return _run(args)
