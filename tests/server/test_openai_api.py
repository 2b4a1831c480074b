"""The server through the official `openai` client, with the offline engine as the oracle.

Every request goes through a real `ringllm serve` process; what it answers is compared
with what `ringllm.pipeline.LLM` (the same model, the same engine flags, in this process)
gives for the same sampling parameters, so a field mapped wrongly shows up as a
different text or token count.
"""

from __future__ import annotations

import openai
import pytest

from ringllm.pipeline import SamplingParams

MODEL_NAME = "tiny-llama"  # the server fixture's --served-model-name
PROMPT = "def parse_args(argv):\n    "
CHAT = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": [{"type": "text", "text": "Sort a list"}]},
]


@pytest.fixture(scope="module")
def client(server):
    assert server.model_name == MODEL_NAME
    key = server.api_key
    with openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120) as c:
        yield c


def offline(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == server.max_model_len


def test_completion_equals_offline_engine(client, offline_llm):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = offline(offline_llm, PROMPT, max_tokens=12, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.model == MODEL_NAME and resp.created > 0
    (choice,) = resp.choices
    assert choice.index == 0 and choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    prompt_tokens = len(offline_llm.get_tokenizer().encode(PROMPT))
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_max_tokens_default_is_16_for_completions_and_the_rest_of_the_context_for_chat(
    client, server
):
    """OpenAI's API and vLLM: /v1/completions without max_tokens generates 16 tokens; a chat
    completion without one may use whatever is left of the context."""
    completion = client.completions.create(
        model=MODEL_NAME, prompt=[5, 6, 7], temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == server.max_model_len
    assert chat.choices[0].finish_reason == "length"


def test_chat_equals_offline_engine(client, offline_llm):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=10, temperature=0
    )
    expected = offline_llm.chat(CHAT, SamplingParams(max_tokens=10, temperature=0), False)[0]
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    (choice,) = resp.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_completion_stream_with_usage(client, offline_llm):
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    expected = offline(offline_llm, PROMPT, max_tokens=9, temperature=0, ignore_eos=True)
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) >= 2  # one per token step, not one blob
    assert "".join(c.choices[0].text for c in token_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert all(c.usage is None for c in token_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 9
    assert usage_chunk.usage.prompt_tokens == len(offline_llm.get_tokenizer().encode(PROMPT))
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_role_first_then_deltas_then_usage(client, offline_llm):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    expected = offline_llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0), False)[0]
    first, *rest, usage_chunk = chunks
    assert first.object == "chat.completion.chunk"
    assert first.choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in rest)
    assert text == expected.outputs[0].text
    assert rest[-1].choices[0].finish_reason == expected.outputs[0].finish_reason
    assert usage_chunk.choices == []
    assert usage_chunk.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage_chunk.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_n2_choices_and_usage(client):
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, n=2, stream=True, temperature=1.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    roles, texts = set(), {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
    assert roles == {0, 1} and all(texts.values())


def test_list_prompts_and_token_ids(client, offline_llm):
    tok = offline_llm.get_tokenizer()
    prompts = ["import os\n", "class Foo:\n"]
    ids = [tok.encode(p) for p in prompts]
    expected = [offline(offline_llm, p, max_tokens=5, temperature=0).text for p in prompts]
    for prompt in (prompts, ids):
        resp = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0, n=2
        )
        by_index = {c.index: c.text for c in resp.choices}
        assert by_index == {0: expected[0], 1: expected[0], 2: expected[1], 3: expected[1]}
        assert resp.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    single = client.completions.create(model=MODEL_NAME, prompt=ids[1], max_tokens=5, temperature=0)
    assert single.choices[0].text == expected[1]


def test_completion_logprobs_and_echo(client, offline_llm):
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    ref = offline(offline_llm, PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for i, token_id in enumerate(ref.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref.logprobs[i][token_id].logprob, abs=1e-5)
        assert len(lp.top_logprobs[i]) <= 3
        # greedy: the chosen token is the best one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert lp.tokens == [offline_llm.get_tokenizer().decode([t]) for t in ref.token_ids]

    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = echoed.choices[0]
    assert choice.text == PROMPT + resp.choices[0].text
    num_prompt = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 6
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.token_logprobs[num_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_shape_and_values(client, offline_llm):
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    ref = offline_llm.chat(CHAT, params, False)[0].outputs[0]
    content = resp.choices[0].logprobs.content
    assert len(content) == 5
    tok = offline_llm.get_tokenizer()
    for entry, token_id, position in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-5)
        assert bytes(entry.bytes) == tok.token_bytes(token_id)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", errors="replace") == resp.choices[0].message.content


def test_stop_strings(client, offline_llm):
    ref = offline(offline_llm, PROMPT, max_tokens=24, temperature=0, ignore_eos=True).text
    # a two-character stop that first occurs after the start (and is whole characters)
    cut = next(
        i
        for i in range(1, len(ref) - 2)
        if "\ufffd" not in ref[i : i + 2] and ref.find(ref[i : i + 2]) == i
    )
    stop = ref[cut : cut + 2]
    common = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    resp = client.completions.create(**common, stop=[stop, "@@never@@"])
    assert resp.choices[0].text == ref[:cut]
    assert resp.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        **common, stop=stop, extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == ref[: cut + len(stop)]
    streamed = client.completions.create(**common, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == ref[:cut]


def test_same_seed_same_output(client):
    def sample(seed):
        return client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"temperature": 0, "repetition_penalty": 1.8},
        {"temperature": 0.8, "top_p": 0.9, "seed": 11},
        {"temperature": 0.9, "top_k": 5, "min_p": 0.05, "seed": 12},
        {"temperature": 0, "min_tokens": 8, "stop_token_ids": [300, 301]},
        {"temperature": 0, "logit_bias": {"300": 100}},
        {"temperature": 0, "skip_special_tokens": False, "ignore_eos": True},
    ],
)
def test_sampling_fields_reach_the_engine(client, offline_llm, fields):
    body = dict(fields)
    params = {**fields, "max_tokens": 12}
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    openai_names = {"temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"}
    direct = {k: body.pop(k) for k in list(body) if k in openai_names}
    if "logit_bias" in body:
        direct["logit_bias"] = body.pop("logit_bias")
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, extra_body=body, **direct
    )
    expected = offline(offline_llm, PROMPT, **params)
    assert resp.choices[0].text == expected.text
    assert resp.usage.completion_tokens == len(expected.token_ids)
    if "logit_bias" in fields:
        assert expected.token_ids == [300] * 12


def test_streamed_echo_with_logprobs_of_a_chunked_prompt(client, offline_llm, server):
    # longer than one step's token budget (1024): the prompt is prefilled in chunks
    prompt = [3 + (k * 13) % 400 for k in range(1500)]
    common = dict(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=1,
                  echo=True, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**common).choices[0]
    chunks = list(client.completions.create(**common, stream=True))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == len(prompt) + 3
    assert tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(
        whole.logprobs.token_logprobs[1:], abs=1e-5
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_the_history_after_a_tool_call_is_rendered_by_the_model_template(client, offline_llm):
    """The agent turn the openai client sends back after a tool call (its own message
    object, content null beside tool_calls, then the tool's result) renders in the model's
    own template, which concatenates content and knows no tools: the answer is the offline
    engine's for the same history, not a 400."""
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, tools=[weather], tool_choice=named, max_tokens=40,
        temperature=0.0,
    )  # fmt: skip
    message = first.choices[0].message
    assert message.content is None and message.tool_calls[0].function.name == "get_weather"
    history = [
        *CHAT,
        message,  # the client serializes it as it came: "content": null
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 C, sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[weather], max_tokens=8, temperature=0.0
    )
    plain = [*CHAT, {**message.model_dump(), "content": ""}, history[-1]]
    want = offline_llm.chat(plain, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert answer.choices[0].message.content == want[0].outputs[0].text
