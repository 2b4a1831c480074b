"""LoRA adapters through the whole engine: LLM.generate with adapters per prompt against
PEFT's greedy generate, tensor-parallel ranks holding their shards, more adapters than
slots, the prefix cache kept apart per adapter, and adapters that do not fit refused
while the engine goes on."""

from __future__ import annotations

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from ringllm.pipeline import LLM, LoRARequest, SamplingParams
from tests.conftest import make_peft_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
CONFIGS = {
    "a": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "c": dict(
        r=16, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "gate_proj", "lm_head"]
    ),
}


def _prompts():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 500, (40,), generator=g).tolist()
    return [shared + [7, 8], shared + [9], torch.randint(3, 500, (23,), generator=g).tolist()]


@pytest.fixture(scope="module")
def lora_setup(model_factory, tmp_path_factory):
    base = model_factory("llama")
    root = tmp_path_factory.mktemp("engine_adapters")
    for seed, (name, config) in enumerate(CONFIGS.items()):
        make_peft_adapter(base, root / name, 100 + seed, **config)
    return base, root


def _peft_greedy(base, adapter, prompt, n) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = hf if adapter is None else peft.PeftModel.from_pretrained(hf, adapter)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _requests(root):
    return [LoRARequest(name, i, str(root / name)) for i, name in enumerate(CONFIGS, start=1)]


@pytest.mark.parametrize(
    "parallel",
    [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
    ids=["one", "tp2", "pp2"],
)
def test_generate_mixing_adapters_matches_peft(lora_setup, parallel):
    """One generate call: each prompt with an adapter or none, batched together; tp2: each
    rank holds its shard of every adapter (column / row parallel as the layers); pp2: each
    stage its own layers' part."""
    base, root = lora_setup
    loras = _requests(root)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    per_prompt = [loras[0], None, loras[2]]
    args = dict(model=str(base), dtype="float32", num_gpu_blocks_override=40, **parallel)
    with LLM(enable_lora=True, max_loras=2, max_lora_rank=16, **args) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=per_prompt)
        assert [r.lora_name for r in llm.list_loras()] == ["a", "c"]
        second = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=loras[1])
    for prompt, lora, out in zip(_prompts(), per_prompt, outs, strict=True):
        adapter = None if lora is None else lora.lora_path
        assert out.outputs[0].token_ids == _peft_greedy(base, adapter, prompt, 12)
    want_b = _peft_greedy(base, loras[1].lora_path, _prompts()[0], 12)
    assert second[0].outputs[0].token_ids == want_b


def test_more_adapters_than_slots_and_the_prefix_cache_kept_apart(lora_setup):
    """max_loras 1: three adapters' requests wait their turn and each matches PEFT. The
    same prompt again: a hit under its own adapter, none under another or the base."""
    base, root = lora_setup
    loras = _requests(root)
    prompt = _prompts()[0]
    args = dict(model=str(base), dtype="float32", num_gpu_blocks_override=60)
    with LLM(enable_lora=True, max_loras=1, max_lora_rank=16, **args) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": prompt}] * 4, GREEDY, use_tqdm=False,
            lora_request=[*loras, None],
        )  # fmt: skip
        for lora, out in zip([*loras, None], outs, strict=True):
            adapter = None if lora is None else lora.lora_path
            assert out.outputs[0].token_ids == _peft_greedy(base, adapter, prompt, 12)
        llm.reset_prefix_cache()
        first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False,
                             lora_request=loras[0])[0]  # fmt: skip
        cached = {}
        for name, lora in (("same", loras[0]), ("other", loras[1]), ("base", None)):
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False,
                               lora_request=lora)[0]  # fmt: skip
            cached[name] = out.num_cached_tokens
        assert first.num_cached_tokens == 0
        assert cached == {"same": 32, "other": 0, "base": 0}  # two full blocks of 16


def test_an_unfit_adapter_is_refused_and_the_engine_goes_on(lora_setup, model_factory, tmp_path):
    base, root = lora_setup
    other = model_factory("llama", hidden_size=96)
    hf = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "other"
    )
    big = tmp_path / "big"
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.get_peft_model(hf, peft.LoraConfig(r=32, target_modules=["q_proj"])).save_pretrained(big)
    args = dict(model=str(base), dtype="float32", num_gpu_blocks_override=40)
    with LLM(enable_lora=True, max_lora_rank=16, tensor_parallel_size=2, **args) as llm:
        with pytest.raises(ValueError, match="another base model"):
            llm.add_lora(LoRARequest("other", 5, str(tmp_path / "other")))
        with pytest.raises(ValueError, match="above max_lora_rank 16"):
            llm.add_lora(LoRARequest("big", 6, str(big)))
        with pytest.raises(ValueError, match="not a folder"):
            llm.add_lora(LoRARequest("gone", 7, str(tmp_path / "gone")))
        assert llm.list_loras() == []
        good = LoRARequest("a", 5, str(root / "a"))
        assert llm.add_lora(good) is True
        assert llm.add_lora(good) is False  # loaded already
        with pytest.raises(ValueError, match="loaded under id 5 already"):
            llm.add_lora(LoRARequest("a2", 5, str(root / "b")))
        out = llm.generate([{"prompt_token_ids": _prompts()[2]}], GREEDY, use_tqdm=False,
                           lora_request=good)[0]  # fmt: skip
        assert out.outputs[0].token_ids == _peft_greedy(base, good.lora_path, _prompts()[2], 12)
        with pytest.raises(ValueError, match="no such adapter is loaded"):
            llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(lora_id=9), use_tqdm=False)
        assert llm.remove_lora(5) is True
        assert llm.remove_lora(5) is False
        assert llm.list_loras() == []
    with LLM(**args) as plain, pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_lora(good)


@pytest.mark.parametrize("level", [1, 2])
def test_adapters_outlive_a_sleep(lora_setup, level):
    """Level 1 keeps the slots in place, level 2 reads the weights again and the same
    slots go back onto the new layers: the adapter's tokens are the same after the wake."""
    base, root = lora_setup
    lora = _requests(root)[0]
    prompt = [{"prompt_token_ids": _prompts()[2]}]
    args = dict(model=str(base), dtype="float32", num_gpu_blocks_override=40)
    with LLM(enable_lora=True, max_lora_rank=16, enable_sleep_mode=True, **args) as llm:
        before = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        llm.sleep(level)
        llm.wake_up()
        after = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert before.outputs[0].token_ids == _peft_greedy(base, lora.lora_path, _prompts()[2], 12)
