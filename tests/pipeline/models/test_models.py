"""Model numerics against transformers: chunked prefill + decode over the paged cache.

For every architecture, a flat batch of mixed-length prompts is run as prefill chunks
split at odd points, then greedy decode steps; every logit row must equal transformers'
for the same sequence (float32: max abs diff <= 1e-4), and the greedy tokens must equal
transformers' greedy `generate`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.models.quant_weights import BF16_TILES
from ringllm.pipeline.ops.cpu_features import cpu_features
from ringllm.pipeline.ops.quant import bf16_tiles_available
from ringllm.pipeline.worker.model_runner import ModelRunner, RunnerRequest

NUM_NEW_TOKENS = 32
PROMPT_LENS = (5, 17, 40)
# Chunk boundaries per prompt: step k computes prompt[cuts[k-1]:cuts[k]].
CHUNK_CUTS = ((3, 5), (17,), (7, 23, 40))
# Blocks handed out out of order, so a wrong block-table lookup cannot pass by accident.
BLOCKS = ([9, 2, 30, 4, 17, 6], [1, 22, 8, 14, 11], [3, 27, 5, 19, 12, 25, 7, 21])


def make_runner(path, dtype="float32", **kwargs):
    config = EngineConfig.from_kwargs(
        model=str(path), dtype=dtype, num_gpu_blocks_override=32, **kwargs
    )
    runner = ModelRunner(config)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def run_chunked_then_greedy(runner, prompts):
    """Returns (all-position prompt logits, per-step decode logits, generated tokens) per prompt."""
    prompt_logits = [[] for _ in prompts]
    done = [0] * len(prompts)
    for step in range(max(len(c) for c in CHUNK_CUTS)):
        reqs, owners = [], []
        for i, cuts in enumerate(CHUNK_CUTS):
            if step < len(cuts):
                reqs.append(
                    RunnerRequest(prompts[i][done[i] : cuts[step]], done[i], BLOCKS[i], "all")
                )
                owners.append(i)
                done[i] = cuts[step]
        out = runner.execute(reqs)
        for j, i in enumerate(owners):
            prompt_logits[i].append(out.rows(j))
    prompt_logits = [torch.cat(rows) for rows in prompt_logits]
    tokens = [[int(rows[-1].argmax())] for rows in prompt_logits]
    decode_logits = [[] for _ in prompts]
    for _ in range(NUM_NEW_TOKENS - 1):
        reqs = [
            RunnerRequest([tokens[i][-1]], len(prompts[i]) + len(tokens[i]) - 1, BLOCKS[i])
            for i in range(len(prompts))
        ]
        out = runner.execute(reqs)
        for i in range(len(prompts)):
            decode_logits[i].append(out.rows(i)[0])
            tokens[i].append(int(out.rows(i)[0].argmax()))
    return prompt_logits, decode_logits, tokens


def random_prompts(vocab_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize(
    "name", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe", "mixtral"]
)
def test_float32_matches_transformers(model_factory, name):
    path = model_factory(name)
    runner = make_runner(path)
    prompts = random_prompts(runner.arch.vocab_size)
    prompt_logits, decode_logits, tokens = run_chunked_then_greedy(runner, prompts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            # No EOS: both sides must produce exactly NUM_NEW_TOKENS greedy tokens.
            hf.generation_config.eos_token_id = None
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            generated = out[0, len(prompt) :].tolist()
            full = hf(torch.tensor([prompt + tokens[i][:-1]])).logits[0]
        assert tokens[i] == generated, f"{name} prompt {i}: greedy tokens differ from transformers"
        ours = torch.cat([prompt_logits[i], torch.stack(decode_logits[i])])
        assert ours.shape == full.shape
        diff = (ours - full).abs().max().item()
        assert diff <= 1e-4, f"{name} prompt {i}: max abs logit diff {diff}"


@pytest.mark.parametrize("name", ["gemma3", "mistral", "phi3"])
def test_a_sliding_window_in_another_config_spelling_matches_transformers(
    model_factory, tmp_path, name
):
    """Gemma 3's transformers-4 config (rope_local_base_freq, rope_theta, no layer_types:
    the five-to-one pattern) and Mistral with a `sliding_window` of 8 keys on every layer:
    the prompts cross the window in prefill chunks and in decode. Phi-3's legacy spelling
    (rope_scaling, top-level original context) with an original context of 32 tokens:
    every sequence passes it, so transformers and the engine (whose context does too) both
    take LongRoPE's long factors and the attention factor, and a window of 8 keys."""
    import json
    import shutil

    path = tmp_path / name
    shutil.copytree(model_factory(name, config_style="legacy"), path)
    config = json.loads((path / "config.json").read_text())
    if name == "gemma3":
        del config["layer_types"]
    elif name == "phi3":
        config.update(original_max_position_embeddings=32, sliding_window=8)
    else:
        config.update(sliding_window=8, use_sliding_window=True)
    (path / "config.json").write_text(json.dumps(config))
    runner = make_runner(path)
    prompts = random_prompts(runner.arch.vocab_size, seed=5)
    prompt_logits, decode_logits, tokens = run_chunked_then_greedy(runner, prompts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            full = hf(torch.tensor([prompt + tokens[i][:-1]])).logits[0]
        ours = torch.cat([prompt_logits[i], torch.stack(decode_logits[i])])
        diff = (ours - full).abs().max().item()
        assert diff <= 1e-4, f"{name} prompt {i}: max abs logit diff {diff}"
        assert full[len(prompt) - 1 :].argmax(-1).tolist() == tokens[i]


@pytest.mark.parametrize(
    "name, checkpoint",
    [
        ("llama", "bfloat16"),
        ("llama", "float16"),
        ("qwen2", "bfloat16"),
        ("qwen2", "float16"),
        ("qwen3_moe", "bfloat16"),
        pytest.param("qwen3_moe", "float16", marks=pytest.mark.slow),
    ],
)
def test_16bit_checkpoint_in_float32_matches_transformers_float32(model_factory, name, checkpoint):
    """A 16-bit checkpoint computed in float32: transformers widens the weights at load;
    ringllm keeps them 16-bit and widens them in registers (models/linear.py, where the C
    kernels have a SIMD set), which must give the same numbers to the order of the sums.
    Qwen3-MoE: its experts' 16-bit panels run in the C sparse MLP (models/moe.py)."""
    from ringllm.pipeline.models.linear import layout

    moe_shape = {"moe_intermediate_size": 768, "head_dim": 96} if name == "qwen3_moe" else {}
    path = model_factory(name, dtype=checkpoint, **PACKED_SHAPE, **moe_shape)
    runner = make_runner(path, dtype="float32")
    widened_in_registers = linear_16bit_here()
    assert layout(runner.model.layers[0].qkv) == ("ringllm16" if widened_in_registers else "onednn")
    for w in runner.model.layers:
        if w.moe is not None:
            record = w.moe.c_record(runner.ops)
            assert (record is not None) == widened_in_registers
    prompts = random_prompts(runner.arch.vocab_size, seed=3)
    prompt_logits, decode_logits, tokens = run_chunked_then_greedy(runner, prompts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers' grouped expert products take no float64: its MoE's truth runs the
    # experts one by one (on an Intel Xeon ours and its float32 differ by 1.1e-4 there: the
    # float64 truth tells whose rounding that is)
    experts = {"experts_implementation": "eager"} if moe_shape else {}
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, **experts)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt + tokens[i][:-1]])
        with torch.no_grad():
            full = hf(ids).logits[0]
            truth = exact.eval()(ids).logits[0]
        ours = torch.cat([prompt_logits[i], torch.stack(decode_logits[i])])
        # NOTE: within 1e-4 of transformers' float32, or (on a CPU whose BLAS sums in another
        # order, as an Intel Xeon's oneDNN does) no further from the float64 truth than
        # twice transformers' own float32 error: the oracle's rounding, not ours.
        hf_error = (full.double() - truth).abs().max().item()
        ours_error = (ours.double() - truth).abs().max().item()
        assert (ours - full).abs().max().item() <= 1e-4 or ours_error <= 2 * hf_error, (
            f"max abs logit diff {(ours - full).abs().max().item():.2e}; from float64: "
            f"ours {ours_error:.2e}, transformers float32 {hf_error:.2e}"
        )
        assert ours[len(prompt) - 1 :].argmax(-1).tolist() == tokens[i]


# Matrices big enough for the packed layouts (models/linear.py's MIN_PACKED_ELEMENTS).
PACKED_SHAPE = {"hidden_size": 384, "intermediate_size": 768}


def linear_16bit_here() -> bool:
    from ringllm.pipeline.models.linear import _ringllm16_set

    return _ringllm16_set() is not None


# bf16 rounds every activation to 8 bits of mantissa; transformers and ringllm round at
# slightly different points (fused residual add, float32 rotary), so logits agree to a
# few hundredths relative to their spread, not bit for bit.
BF16_REL_TOLERANCE = 0.05


def test_bfloat16_close_to_transformers(model_factory):
    path = model_factory("llama", dtype="bfloat16")
    runner = make_runner(path, dtype="bfloat16")
    assert runner.dtype == torch.bfloat16
    prompts = random_prompts(runner.arch.vocab_size, seed=1)
    prompt_logits, _, _ = run_chunked_then_greedy(runner, prompts)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            full = hf(torch.tensor([prompt])).logits[0].float()
        rel = ((prompt_logits[i] - full).abs().max() / full.std()).item()
        assert rel <= BF16_REL_TOLERANCE, f"prompt {i}: bf16 max diff / logit std = {rel}"


def test_auto_dtype_of_a_bf16_checkpoint_is_what_the_cpu_computes_in(model_factory):
    """bfloat16 where the CPU has bf16 arithmetic, else float32 (pipeline/ops/cpu_features);
    where the AMX tile unit multiplies the matrices (models/quant_weights.py BF16_TILES),
    float32 activations around its bf16 products, the KV cache bfloat16."""
    runner = make_runner(model_factory("llama", dtype="bfloat16"), dtype="auto")
    computes = cpu_features().auto_dtype(torch.bfloat16)
    assert computes == (torch.bfloat16 if cpu_features().bf16_arithmetic else torch.float32)
    tiles = runner.model.quantization == BF16_TILES
    assert tiles == (computes == torch.bfloat16 and bf16_tiles_available())
    assert runner.dtype == (torch.float32 if tiles else computes)
    assert runner.kv_dtype == computes


def test_logit_rows_follow_caller_order(model_factory):
    """Mixed decode + prefill in one step: rows come back in the order requests were given."""
    runner = make_runner(model_factory("llama"))
    p = random_prompts(runner.arch.vocab_size)
    first = runner.execute([RunnerRequest(p[0], 0, BLOCKS[0]), RunnerRequest(p[1], 0, BLOCKS[1])])
    t0, t1 = int(first.rows(0).argmax()), int(first.rows(1).argmax())
    mixed = runner.execute(
        [
            RunnerRequest(p[2], 0, BLOCKS[2], "none"),
            RunnerRequest([t0], len(p[0]), BLOCKS[0]),
            RunnerRequest([t1], len(p[1]), BLOCKS[1], "all"),
        ]
    )
    assert mixed.row_starts == [0, 0, 1, 2]
    alone = runner.execute([RunnerRequest([t1], len(p[1]), BLOCKS[1])])
    assert torch.allclose(mixed.rows(2), alone.rows(0), atol=1e-5)
