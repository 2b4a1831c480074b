"""LoRA adapters against PEFT + transformers on tiny random models.

The adapters are made by PEFT itself (`get_peft_model` with random A and B, then
`save_pretrained`), with different ranks, alphas, targets, rsLoRA and a rank pattern. One
step mixes three adapters and the base model, prompts and decodes alike; every logit row
must equal PEFT's for its adapter (float32: max abs diff <= 1e-4).
"""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from ringllm.pipeline.config import EngineConfig
from ringllm.pipeline.models.lora import LoraError
from ringllm.pipeline.worker.model_runner import ModelRunner, RunnerRequest
from tests.conftest import make_peft_adapter

ADAPTERS = {
    "all7": dict(
        r=8,
        lora_alpha=16,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    ),
    "qv": dict(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "mlp_rs": dict(
        r=16,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["o_proj", "down_proj", "up_proj", "lm_head"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"o_proj": 3},
    ),
}
PROMPTS = ([5, 9, 1, 33, 7, 2, 8], [3, 4, 11], [17, 2, 40, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9])


def make_runner(path, dtype="float32", **kwargs) -> ModelRunner:
    config = EngineConfig.from_kwargs(
        model=str(path), dtype=dtype, num_gpu_blocks_override=40, **kwargs
    )
    runner = ModelRunner(config)
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


make_adapter = make_peft_adapter  # B of std 0.05: deltas as large as the layers' outputs


@pytest.fixture(scope="module")
def adapters(model_factory, tmp_path_factory):
    base = model_factory("llama")
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, config) in enumerate(ADAPTERS.items()):
        make_adapter(base, root / name, seed, **config)
    return base, root


def peft_logits(base, adapter_dir, prompt) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = hf if adapter_dir is None else peft.PeftModel.from_pretrained(hf, adapter_dir)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def run_mixed(runner, lora_of: list[int], blocks_base: int = 0):
    """Prompt logits of PROMPTS (one step, every row), then one decode step of each
    prompt's argmax, all requests with their adapter: (prompt rows, decode row) each."""
    tables = [[blocks_base + 4 * i + j for j in range(4)] for i in range(len(PROMPTS))]
    out = runner.execute(
        [RunnerRequest(p, 0, tables[i], "all", lora_id=lora_of[i]) for i, p in enumerate(PROMPTS)]
    )
    prompt_rows = [out.rows(i) for i in range(len(PROMPTS))]
    nexts = [int(rows[-1].argmax()) for rows in prompt_rows]
    out = runner.execute(
        [
            RunnerRequest([nexts[i]], len(p), tables[i], lora_id=lora_of[i])
            for i, p in enumerate(PROMPTS)
        ]
    )
    return prompt_rows, [out.rows(i)[0] for i in range(len(PROMPTS))], nexts


def test_a_step_mixing_three_adapters_and_the_base_matches_peft(adapters):
    base, root = adapters
    runner = make_runner(base, enable_lora=True, max_loras=3, max_lora_rank=16)
    names = list(ADAPTERS)
    for i, name in enumerate(names, start=1):
        runner.add_lora(i, str(root / name), name)
    lora_of = [1, 0, 3, 2]  # the base model's request between adapters' ones
    prompt_rows, decode_rows, nexts = run_mixed(runner, lora_of)
    for i, prompt in enumerate(PROMPTS):
        adapter = None if lora_of[i] == 0 else root / names[lora_of[i] - 1]
        want = peft_logits(base, adapter, prompt + [nexts[i]])
        ours = torch.cat([prompt_rows[i], decode_rows[i][None]])
        diff = (ours - want).abs().max().item()
        assert diff <= 1e-4, f"request {i} (lora {lora_of[i]}): max abs logit diff {diff}"
        if adapter is not None:  # the adapter changes the logits: the check has teeth
            plain = peft_logits(base, None, prompt + [nexts[i]])
            assert (plain - want).abs().max().item() > 1e-2


def test_more_adapters_than_slots_take_turns(adapters):
    """max_loras 2 with three adapters: a step's new adapter takes the slot of the one
    used least recently, and every row still matches the adapter its request named."""
    base, root = adapters
    runner = make_runner(base, enable_lora=True, max_loras=2, max_lora_rank=16)
    names = list(ADAPTERS)
    for i, name in enumerate(names, start=1):
        runner.add_lora(i, str(root / name), name)
    prompt = PROMPTS[0]
    for step, ids in enumerate(([1, 2], [3, 1], [2, 3], [1, 0])):
        out = runner.execute(
            [
                RunnerRequest(prompt, 0, [8 * step + 2 * k, 8 * step + 2 * k + 1], lora_id=lora)
                for k, lora in enumerate(ids)
            ]
        )
        for k, lora in enumerate(ids):
            adapter = None if lora == 0 else root / names[lora - 1]
            want = peft_logits(base, adapter, prompt)[-1]
            diff = (out.rows(k)[0] - want).abs().max().item()
            assert diff <= 1e-4, f"step {step}, lora {lora}: max abs logit diff {diff}"
    with pytest.raises(LoraError, match="max_loras"):
        runner.execute([RunnerRequest(prompt, 0, [0, 1], lora_id=i) for i in (1, 2, 3)])


def test_an_int8_base_takes_adapters(adapters):
    """A base quantized at load (int8) with an adapter: as close to PEFT on the float
    model as the int8 base alone is to transformers, while the adapter's own effect is
    far larger than that gap."""
    base, root = adapters
    runner = make_runner(base, quantization="int8", enable_lora=True, max_lora_rank=16)
    runner.add_lora(1, str(root / "all7"))
    prompt = PROMPTS[3]
    out = runner.execute(
        [RunnerRequest(prompt, 0, [0, 1], "all"), RunnerRequest(prompt, 0, [2, 3], "all", 1)]
    )
    plain, adapted = peft_logits(base, None, prompt), peft_logits(base, root / "all7", prompt)
    base_gap = (out.rows(0) - plain).abs().max().item()
    lora_gap = (out.rows(1) - adapted).abs().max().item()
    effect = (adapted - plain).abs().max().item()
    assert lora_gap <= 3 * base_gap + 1e-3, (lora_gap, base_gap)
    assert effect > 10 * lora_gap, (effect, lora_gap)


def test_a_bfloat16_step_stays_close_to_peft(adapters):
    base, root = adapters
    runner = make_runner(base, dtype="bfloat16", enable_lora=True, max_lora_rank=16)
    runner.add_lora(1, str(root / "all7"))
    prompt = PROMPTS[0]
    out = runner.execute([RunnerRequest(prompt, 0, [0, 1], "all", 1)])
    want = peft_logits(base, root / "all7", prompt)
    cos = torch.nn.functional.cosine_similarity(out.rows(0), want, dim=-1)
    assert cos.min().item() > 0.99


def _copy(root, name, tmp_path):
    shutil.copytree(root / name, tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize(
    "spoil, message",
    [
        ("missing", "not a folder"),
        ("no_config", "no adapter_config.json"),
        ("bad_json", "not readable JSON"),
        ("no_weights", "no adapter weights"),
        ("bad_weights", "not a readable weights file"),
        ("dora", "DoRA"),
        ("rank", "above max_lora_rank 4"),
        ("embed", "LoRA on model.embed_tokens is not supported"),
        ("other_base", "an adapter for another base model"),
        ("nan", "NaN"),
    ],
)
def test_an_unfit_adapter_is_refused_with_the_reason(
    adapters, model_factory, tmp_path, spoil, message
):
    base, root = adapters
    runner = make_runner(base, enable_lora=True, max_lora_rank=4 if spoil == "rank" else 16)
    path = tmp_path / "nothing"
    if spoil != "missing":
        path = _copy(root, "all7", tmp_path)
    config = path / "adapter_config.json"
    weights = path / "adapter_model.safetensors"
    if spoil == "no_config":
        config.unlink()
    elif spoil == "bad_json":
        config.write_text("{r: 8")
    elif spoil == "no_weights":
        weights.unlink()
    elif spoil == "bad_weights":
        weights.write_bytes(b"not safetensors")
    elif spoil == "dora":
        config.write_text(json.dumps({**json.loads(config.read_text()), "use_dora": True}))
    elif spoil in ("embed", "nan"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(weights))
        if spoil == "embed":
            key = "base_model.model.model.embed_tokens.lora_embedding_A"
            tensors[key] = torch.zeros(8, 512)
        else:
            key = next(k for k in tensors if "lora_B" in k)
            tensors[key][0, 0] = float("nan")
        save_file(tensors, str(weights))
    elif spoil == "other_base":
        other = model_factory("llama", hidden_size=96)
        path = tmp_path / "other"
        make_adapter(other, path, 0, **ADAPTERS["qv"])
    with pytest.raises(LoraError, match=message):
        runner.add_lora(1, str(path))
    # the runner goes on: a good adapter loads under the same id and runs
    runner.add_lora(1, str(root / "qv"))
    out = runner.execute([RunnerRequest(PROMPTS[1], 0, [0], lora_id=1)])
    want = peft_logits(base, root / "qv", PROMPTS[1])[-1]
    assert (out.rows(0)[0] - want).abs().max().item() <= 1e-4


def test_a_gguf_base_takes_adapters(model_factory, tmp_path):
    """A Q8_0 GGUF of the same model (its q / k rows as llama.cpp stores them) with an
    adapter made on the float model: as close to PEFT as the GGUF base alone is to
    transformers."""
    from ringllm.tools.make_gguf import make_gguf

    base = model_factory("llama", rope_scaling="none")  # make-gguf writes plain rope
    make_adapter(base, tmp_path / "all7", 0, **ADAPTERS["all7"])
    path = make_gguf(base, tmp_path / "tiny-q8_0.gguf", "q8_0")
    runner = make_runner(path, dtype="auto", enable_lora=True, max_lora_rank=16)
    assert runner.model.quantization == "gguf"  # the blocks as they are, not dequantized
    runner.add_lora(1, str(tmp_path / "all7"))
    prompt = PROMPTS[3]
    out = runner.execute(
        [RunnerRequest(prompt, 0, [0, 1], "all"), RunnerRequest(prompt, 0, [2, 3], "all", 1)]
    )
    plain = peft_logits(base, None, prompt)
    adapted = peft_logits(base, tmp_path / "all7", prompt)
    base_gap = (out.rows(0) - plain).abs().max().item()
    lora_gap = (out.rows(1) - adapted).abs().max().item()
    effect = (adapted - plain).abs().max().item()
    assert lora_gap <= 3 * base_gap + 1e-3, (lora_gap, base_gap)
    assert effect > 10 * lora_gap, (effect, lora_gap)


def test_adapters_past_max_cpu_loras_are_refused_until_one_is_unloaded(adapters):
    base, root = adapters
    runner = make_runner(base, enable_lora=True, max_lora_rank=16, max_cpu_loras=2)
    runner.add_lora(1, str(root / "qv"))
    runner.add_lora(2, str(root / "all7"))
    with pytest.raises(LoraError, match="unload one first"):
        runner.add_lora(3, str(root / "mlp_rs"))
    assert runner.remove_lora(1) and not runner.remove_lora(1)
    runner.add_lora(3, str(root / "mlp_rs"))
    out = runner.execute([RunnerRequest(PROMPTS[1], 0, [0], lora_id=3)])
    want = peft_logits(base, root / "mlp_rs", PROMPTS[1])[-1]
    assert (out.rows(0)[0] - want).abs().max().item() <= 1e-4
