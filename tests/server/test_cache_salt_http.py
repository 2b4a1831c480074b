"""`cache_salt` (vLLM's tenant isolation of the prefix cache) through the official client.

The salt keys the first block's hash, so every block of a salted request chains from it:
two requests with the same prompt share cached blocks only if they carry the same salt
(or both none). Measured with the server's prefix-cache counters, which count prompt
tokens found cached.
"""

from __future__ import annotations

import openai
import pytest

HITS = "ringllm:prefix_cache_hits_total"
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18] * 8  # four full blocks of 16, seen nowhere else
CACHED = 48  # at least three of them found again (the last token is always computed)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0) as c:
        yield c


def hits_of(server, send) -> float:
    before = server.metrics()[HITS]
    send()
    return server.metrics()[HITS] - before


def test_completions_share_a_prefix_only_with_the_same_salt(server, client):
    def complete(salt=None):
        extra = {} if salt is None else {"cache_salt": salt}
        return lambda: client.completions.create(
            model=server.model_name, prompt=PROMPT, max_tokens=1, extra_body=extra
        )

    assert hits_of(server, complete("tenant-a")) == 0
    assert hits_of(server, complete("tenant-b")) == 0  # same prompt, another tenant
    assert hits_of(server, complete("tenant-a")) >= CACHED
    assert hits_of(server, complete()) == 0  # no salt shares nothing with a salted one
    assert hits_of(server, complete()) >= CACHED  # and among itself, as before


def test_chat_shares_a_prefix_only_with_the_same_salt(server, client):
    messages = [{"role": "user", "content": "isolated tenants " * 40}]

    def chat(salt=None):
        extra = {} if salt is None else {"cache_salt": salt}
        return lambda: client.chat.completions.create(
            model=server.model_name, messages=messages, max_tokens=1, extra_body=extra
        )

    assert hits_of(server, chat("tenant-a")) == 0
    assert hits_of(server, chat("tenant-b")) == 0
    assert hits_of(server, chat("tenant-a")) >= CACHED
    assert hits_of(server, chat()) == 0


def test_a_salted_stream_is_isolated_too(server, client):
    prompt = [21, 22, 23, 24] * 16

    def stream(salt):
        def send():
            chunks = client.completions.create(
                model=server.model_name, prompt=prompt, max_tokens=2, stream=True,
                extra_body={"cache_salt": salt},
            )  # fmt: skip
            assert [c for c in chunks if c.choices]

        return send

    assert hits_of(server, stream("s1")) == 0
    assert hits_of(server, stream("s2")) == 0
    assert hits_of(server, stream("s1")) >= CACHED


@pytest.mark.parametrize("salt", ["", 7, ["a"], {"a": 1}, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400(server, client, endpoint, salt):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "completions":
            client.completions.create(
                model=server.model_name, prompt="hi", max_tokens=1,
                extra_body={"cache_salt": salt},
            )  # fmt: skip
        else:
            client.chat.completions.create(
                model=server.model_name, messages=[{"role": "user", "content": "hi"}],
                max_tokens=1, extra_body={"cache_salt": salt},
            )  # fmt: skip
    error = caught.value.body
    assert error["param"] == "cache_salt"
    assert error["message"].startswith("cache_salt: must be a") and "string" in error["message"]


def test_a_null_salt_is_no_salt(server):
    body = {"prompt": PROMPT, "max_tokens": 1, "cache_salt": None}
    status, _, _ = server.call("POST", "/v1/completions", body)
    assert status == 200
    assert "Traceback" not in server.log()
