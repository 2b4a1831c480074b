"""End to end through the offline API on a tiny random model, with transformers as oracle."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringllm.pipeline import LLM, BeamSearchParams, RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(
        model_path,
        dtype="float32",
        max_num_seqs=64,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=512,
    )


@pytest.fixture(scope="module")
def hf(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def random_prompts(count, seed, min_len=1, max_len=60, vocab=500):
    rng = random.Random(seed)
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(count)
    ]


def test_64_mixed_requests_batched_equal_alone(llm):
    rng = random.Random(1)
    prompts = random_prompts(64, seed=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        for _ in prompts
    ]
    batched = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, batched, strict=True):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == p.max_tokens
        assert out.outputs[0].finish_reason == "length"
        assert out.prompt_token_ids == prompt


def test_greedy_equals_transformers_generate(llm, hf):
    for prompt in random_prompts(3, seed=3, min_len=5):
        ours = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
            )
        assert ours == ref[0, len(prompt) :].tolist()


def test_seeded_sampling_independent_of_batch(llm):
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = random_prompts(1, seed=4)[0]
    alone = llm.generate([prompt], target, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(9, seed=5)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    for position in (0, 4, 9):
        prompts = others[:position] + [prompt] + others[position:]
        params = [noise] * position + [target] + [noise] * (9 - position)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[position].outputs[0].token_ids == alone
    unseeded = llm.generate([prompt] * 2, noise, use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_preemption_keeps_outputs_identical(model_path):
    prompts = random_prompts(16, seed=6, min_len=30, max_len=50)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seeded = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True) for i in range(16)
    ]
    roomy = LLM(model_path, dtype="float32", num_gpu_blocks_override=256)
    tight = LLM(model_path, dtype="float32", num_gpu_blocks_override=20)
    for params in (greedy, seeded):
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    scheduler = tight.llm_engine.engine_core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv.pool.num_free_blocks == 20  # everything freed


def test_stop_strings(llm):
    prompt = random_prompts(1, seed=7, min_len=10)[0]
    full = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 3 : len(text) // 3 + 2]
    assert len(stop) == 2 and stop in text
    cut = text.index(stop)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    params.include_stop_str_in_output = True
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: cut + len(stop)]
    assert not llm.llm_engine.engine_core.has_unfinished_requests()


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompts(1, seed=8, min_len=10)[0]
    tokens = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_token = tokens[5]
    first = tokens.index(stop_token)
    params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_token])
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    params = SamplingParams(
        temperature=0.0, max_tokens=16, stop_token_ids=[stop_token], min_tokens=first + 2
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1


def test_n_and_seeds(llm):
    prompt = random_prompts(1, seed=9)[0]
    out = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 1
    # at temperature 1 the tiny random model puts 85-99% of a step's mass on its top token, so
    # four children can agree on all 12 tokens by chance (seed 11's do, with the sampler's
    # keyed draws; 12-17's do not): temperature 3 flattens the steps
    params = SamplingParams(n=4, temperature=3.0, seed=11, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    # The n children share the prompt's full blocks through the prefix cache.
    assert first.num_cached_tokens >= 0


def test_logprobs_match_transformers(llm, hf):
    prompt = random_prompts(1, seed=10, min_len=20, max_len=20)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + step]
        assert tokens[step] in position and position[tokens[step]].rank == 1
        assert len(position) == 3  # the chosen token is also the top-1
        for token, lp in position.items():
            assert abs(lp.logprob - row[token].item()) < 1e-4
    cumulative = sum(out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens))
    assert abs(out.outputs[0].cumulative_logprob - cumulative) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        top = ref[i - 1].topk(2)
        for token, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(out.prompt_logprobs[i][token].logprob - value) < 1e-4


def test_beam_search_matches_transformers(llm, hf):
    prompt = random_prompts(1, seed=12, min_len=8, max_len=8)[0]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    result = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
    assert len(result.sequences) == 3
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            num_beams=3,
            num_return_sequences=3,
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            early_stopping=False,
            length_penalty=0.0,
        )
    expected = [row[len(prompt) :].tolist() for row in ref]
    assert result.sequences[0].output_token_ids == expected[0]
    assert {tuple(s.output_token_ids) for s in result.sequences} == {tuple(e) for e in expected}
    scores = [s.cum_logprob for s in result.sequences]
    assert scores == sorted(scores, reverse=True)


def test_prefix_cache_hits_and_identical_outputs(model_path):
    prefix = random_prompts(1, seed=13, min_len=48, max_len=48)[0]
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]
    cached = LLM(model_path, dtype="float32", num_gpu_blocks_override=64)
    first = cached.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    second = cached.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    uncached = LLM(
        model_path, dtype="float32", num_gpu_blocks_override=64, enable_prefix_caching=False
    )
    ref = uncached.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    assert ref.num_cached_tokens == 0
    assert ref.outputs[0].token_ids == second.outputs[0].token_ids
    cached.reset_prefix_cache()
    again = cached.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0


def test_streaming_deltas_add_up(llm):
    """Text, token ids and logprobs of the deltas are the final output's; the front end
    keeps no logprobs it has handed out (a long stream's would grow without bound)."""
    engine = llm.llm_engine
    prompt = random_prompts(1, seed=14)[0]
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    final = llm.generate([prompt], with_logprobs, use_tqdm=False)[0].outputs[0]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        logprobs=5,
        output_kind=RequestOutputKind.DELTA,
    )
    engine.add_request("stream", prompt, params)
    states = engine.front_end.output_processor.states
    text, tokens, logprobs, outputs, kept = "", [], [], 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs
            outputs += 1
        if "stream" in states:
            kept.append(len(states["stream"].logprobs))
    assert (text, tokens) == (final.text, final.token_ids)
    assert logprobs == final.logprobs
    assert outputs == 16
    assert kept and max(kept) == 0


def test_admission_errors_leave_nothing_behind(llm):
    engine = llm.llm_engine
    with pytest.raises(
        ValueError, match=r"prompt: 3000 tokens leave no room .* max_model_len 2048"
    ):
        llm.generate([[5] * 3000], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 99999]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params: 2 given for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)
    # A bad prompt in the middle of a list: the ones before it are withdrawn too.
    with pytest.raises(ValueError):
        llm.generate([[5, 6], [5] * 3000], GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert not engine.engine_core.has_unfinished_requests()
    assert (
        engine.engine_core.scheduler.kv.pool.num_free_blocks
        == engine.engine_core.scheduler.kv.num_blocks
    )


def test_never_fitting_prompt_refused(model_path):
    small = LLM(model_path, dtype="float32", num_gpu_blocks_override=4)
    with pytest.raises(
        ValueError, match=r"more KV blocks than the whole cache has \(4 blocks of 16 tokens\)"
    ):
        small.generate([[5] * 100], GREEDY, use_tqdm=False)


def test_chat_uses_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 16


# -- images (LLaVA) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from ringllm.tools.make_model import ModelShape, make_model

    return make_model(tmp_path_factory.mktemp("llava") / "llava", ModelShape(arch="llava"))


def test_images_offline_equal_transformers(llava_path):
    """LLM.generate with multi_modal_data and LLM.chat with image parts: the greedy tokens of
    transformers' LlavaForConditionalGeneration on what its own processor makes."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    rng = np.random.default_rng(7)
    first, second = (
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in [(40, 48), (64, 30)]
    )
    processor = AutoProcessor.from_pretrained(llava_path)
    hf = LlavaForConditionalGeneration.from_pretrained(llava_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    content = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    inputs = processor(text=text, images=[first, second], return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = out[0, inputs.input_ids.shape[1] :].tolist()

    llm = LLM(llava_path, dtype="float32", max_model_len=512, num_gpu_blocks_override=128)
    try:
        by_data = llm.generate(
            {"prompt": text, "multi_modal_data": {"image": [first, second]}}, GREEDY, use_tqdm=False
        )[0]
        pil_parts = [
            {"type": "image_pil", "image_pil": first},
            {"type": "text", "text": "and"},
            {"type": "image", "image": second},
            {"type": "text", "text": "?"},
        ]
        by_chat = llm.chat([{"role": "user", "content": pil_parts}], GREEDY, use_tqdm=False)[0]
        (alone,) = llm.generate(
            {"prompt": "<image> alone", "multi_modal_data": {"image": first}},
            GREEDY,
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert by_data.prompt_token_ids == inputs.input_ids[0].tolist() == by_chat.prompt_token_ids
    assert by_data.outputs[0].token_ids == expected == by_chat.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 16


def test_images_to_a_text_only_model_are_refused(llm):
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    with pytest.raises(ValueError, match="^multi_modal_data: this model does not take images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
    parts = [{"type": "text", "text": "hi"}, {"type": "image_pil", "image_pil": image}]
    with pytest.raises(
        ValueError, match=r"content\[1\]: content part type 'image_pil' is not supported"
    ):
        llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)


def test_beam_search_with_an_image_matches_transformers(llava_path):
    """Every beam's prompt keeps the image (beams only append to it)."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (36, 44, 3), np.uint8))
    processor = AutoProcessor.from_pretrained(llava_path)
    hf = LlavaForConditionalGeneration.from_pretrained(llava_path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    text = "<image> describe"
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(
            **inputs,
            num_beams=3,
            num_return_sequences=3,
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
            early_stopping=False,
            length_penalty=0.0,
        )
    expected = [row[inputs.input_ids.shape[1] :].tolist() for row in ref]
    llm = LLM(llava_path, dtype="float32", max_model_len=512, num_gpu_blocks_override=128)
    try:
        params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
        prompt = {"prompt": text, "multi_modal_data": {"image": image}}
        result = llm.beam_search([prompt], params)[0]
    finally:
        llm.shutdown()
    assert result.sequences[0].output_token_ids == expected[0]
    assert {tuple(s.output_token_ids) for s in result.sequences} == {tuple(e) for e in expected}


def test_n_children_share_the_prompts_image(llava_path):
    """n = 3 children of one image prompt: each is its own engine request with the image
    (the prefix cache shares its KV); greedy, all equal the n = 1 answer."""
    import numpy as np
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (30, 30, 3), np.uint8))
    prompt = {"prompt": "<image> what", "multi_modal_data": {"image": image}}
    llm = LLM(llava_path, dtype="float32", max_model_len=512, num_gpu_blocks_override=128)
    try:
        (one,) = llm.generate(prompt, GREEDY, use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=3)
        (three,) = llm.generate(prompt, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [c.token_ids for c in three.outputs] == [one.outputs[0].token_ids] * 3
