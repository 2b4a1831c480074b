"""`ringllm serve --speculative-config` with two data-parallel engine cores: through the
official `openai` client the greedy completions and chat answers are those of the same engine
without speculation (the offline oracle), streamed or not; /metrics counts drafts and
acceptance under vLLM's names; a bad config is refused at start with the key named."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest

from ringllm.pipeline import SamplingParams
from tests.server.conftest import ENGINE_KWARGS, ServerProcess, _flags, launched

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
PROMPTS = [
    "one two three one two three one two three one two",
    "def f(x):\n    return x\n\ndef f(x):\n",
    "The cat sat on the mat. The cat sat on the",
    "abc abc abc abc abc",
]


@pytest.fixture(scope="module")
def spec_server(server_model, tmp_path_factory):
    args = [
        str(server_model), "--port", "0", "--engine-process", "--data-parallel-size", "2",
        "--speculative-config", json.dumps(SPEC), *_flags(ENGINE_KWARGS),
    ]  # fmt: skip
    with launched(args, tmp_path_factory.mktemp("spec")) as (proc, url, log_path):
        yield ServerProcess(url, proc.pid, server_model, log_path, api_key="")


@pytest.fixture(scope="module")
def client(spec_server):
    return openai.OpenAI(base_url=spec_server.v1, api_key="unused")


def test_greedy_completions_equal_the_engine_without_speculation(spec_server, client, offline_llm):
    model = client.models.list().data[0].id
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].text for o in offline_llm.generate(PROMPTS, params, use_tqdm=False)]
    got = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    for prompt, text in zip(PROMPTS, want, strict=True):
        stream = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == text
    metrics = spec_server.metrics()
    drafts = metrics["ringllm:spec_decode_num_draft_tokens_total"]
    accepted = metrics["ringllm:spec_decode_num_accepted_tokens_total"]
    assert metrics["ringllm:spec_decode_num_drafts_total"] > 0
    assert 0 < accepted <= drafts
    assert metrics["ringllm:spec_decode_num_accepted_tokens_per_pos_total"] > 0


def test_chat_with_logprobs_through_speculation(client, offline_llm):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPTS[0]}]
    response = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    want = offline_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    choice = response.choices[0]
    assert choice.message.content == want.text
    assert len(choice.logprobs.content) == len(want.token_ids)
    for got, lp, token in zip(choice.logprobs.content, want.logprobs, want.token_ids, strict=True):
        assert got.logprob == pytest.approx(lp[token].logprob, abs=1e-4)


def test_a_stop_string_inside_an_accepted_run_counts_only_the_tokens_kept(
    spec_server, client, offline_llm
):
    """The stop string ends the output at the token that completes it, inside the run of
    drafts it came in: usage (plain and streamed) and /metrics count what the engine without
    speculation gives, not the whole run."""
    model = client.models.list().data[0].id
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs = [o.outputs[0] for o in offline_llm.generate(PROMPTS, greedy, use_tqdm=False)]
    decode = offline_llm.get_tokenizer().decode
    before = spec_server.metrics()["ringllm:generation_tokens_total"]
    counted = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        # The text of the first k tokens: the tiny model repeats, so this completes at
        # token k or before, past the first n-gram hits (runs of up to 5 tokens).
        for k in (7, 10, 13):
            stop = decode(output.token_ids[:k])
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
            want = offline_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            ask = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                   "stop": [stop], "extra_body": {"ignore_eos": True}}  # fmt: skip
            got = client.completions.create(**ask)
            assert got.choices[0].text == want.text
            assert got.choices[0].finish_reason == "stop"
            assert got.usage.completion_tokens == len(want.token_ids), (prompt, stop)
            chunks = list(
                client.completions.create(
                    **ask, stream=True, stream_options={"include_usage": True}
                )
            )
            assert chunks[-1].usage.completion_tokens == len(want.token_ids), (prompt, stop)
            counted += 2 * len(want.token_ids)
    assert spec_server.metrics()["ringllm:generation_tokens_total"] - before == counted


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"method": "ngram", "num_speculative_tokens": 40},
            "speculative_config.num_speculative_tokens",
        ),
        (
            {"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2},
            "speculative_config.model: /nonexistent does not load",
        ),
    ],
)
def test_a_bad_speculative_config_stops_the_server_with_the_key_named(server_model, spec, message):
    """Checked before anything starts (a bad key) or by the engine process (a draft folder
    that does not load): exit 2, one line naming it, no traceback, nothing left behind."""
    result = subprocess.run(
        [sys.executable, "-m", "ringllm.tools.cli", "serve", str(server_model), "--port", "0",
         "--engine-process", "--speculative-config", json.dumps(spec)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
