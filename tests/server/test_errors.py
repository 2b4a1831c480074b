"""Bad requests against the real server: each gets OpenAI's error body, the right status and
`param`, and none of them hurts the requests that follow (or yields a 500)."""

from __future__ import annotations

import pytest

CHAT_OK = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"prompt": "def f", "max_tokens": 2, **fields}


def chat(**fields):
    return {"messages": CHAT_OK, "max_tokens": 2, **fields}


def bad_schema_tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": 5}}}


BAD_COMPLETIONS = [
    (completion(temperature="hot"), "temperature", "number"),
    (completion(top_p=2), "top_p", "(0, 1]"),
    (completion(temperature=-1), "temperature", "[0, inf)"),
    (completion(n=0), "n", "[1, 2147483647]"),
    (completion(n=257), "n", "at most 256"),
    (completion(prompt=["a", "b", "c"], n=100), "n", "300 choices"),
    (completion(max_tokens=0), "max_tokens", "[1, 2147483647]"),
    (completion(max_tokens=1.5), "max_tokens", "integer"),
    (completion(logprobs=21), "logprobs", "[0, 20]"),
    (completion(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    (completion(seed="a"), "seed", "integer"),
    (completion(stop=5), "stop", "string"),
    (completion(stop=""), "stop", "non-empty"),
    (completion(stop_token_ids=[-1]), "stop_token_ids", "token ids"),
    (completion(stop_token_ids=[10**7]), "stop_token_ids", "vocab size"),
    (completion(logit_bias={"abc": 1}), "logit_bias", "decimal"),
    (completion(logit_bias={"5": "x"}), "logit_bias", "number"),
    (completion(logit_bias={"9999999": 1}), "logit_bias", "vocab size"),
    (completion(ignore_eos="yes"), "ignore_eos", "boolean"),
    (completion(min_tokens=5, max_tokens=2), "min_tokens", "max_tokens"),
    (completion(suffix="tail"), "suffix", "not supported"),
    (completion(best_of=3), "best_of", "n (1)"),
    (completion(frobnicate=1), "frobnicate", "unrecognized"),
    (completion(stream_options={"include_usage": True}), "stream_options", "stream"),
    (completion(stream=True, stream_options={"x": 1}), "stream_options", "include_usage"),
    ({"max_tokens": 2}, "prompt", "required"),
    (completion(prompt=5), "prompt", "string"),
    (completion(prompt=[]), "prompt", "list"),
    (completion(prompt=[1, "a"]), "prompt", "list"),
    (completion(prompt=[[1, 2], []]), "prompt", "list"),
    (completion(prompt=[10**7]), "prompt", "vocabulary"),
    # budgets (server/limits.py defaults): field, value and limit in the message
    (completion(stop=[f"s{i}" for i in range(17)]), "stop", "17 stop strings; at most 16"),
    (completion(stop=["x" * 513]), "stop", "513 characters; at most 512"),
    (completion(stop_token_ids=list(range(257))), "stop_token_ids", "257 ids; at most 256"),
    (completion(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias", "at most 1024"),
    (completion(n=200, max_tokens=20000), "max_tokens", "4000000 tokens"),
    # the wire types: int32 counts, float32 in the sampler, int64/uint64 seeds
    (completion(top_k=2**31), "top_k", "2147483647"),
    (completion(max_tokens=2**31), "max_tokens", "2147483647"),
    (completion(min_tokens=2**31, max_tokens=None), "min_tokens", "2147483647"),
    (completion(seed=2**64), "seed", "18446744073709551615"),
    (completion(seed=-(2**63) - 1), "seed", "-9223372036854775808"),
    (completion(logit_bias={"2147483648": 1}), "logit_bias", "2147483647"),
    (completion(stop_token_ids=[2**31]), "stop_token_ids", "2147483647"),
    (completion(repetition_penalty=1e-320), "repetition_penalty", "float32"),
    (completion(temperature=1e300), "temperature", "float32"),
    (completion(min_p=1e-45), "min_p", "float32"),
]

BAD_CHATS = [
    (chat(messages=[]), "messages", "non-empty"),
    (chat(n=1000), "n", "at most 256"),
    (chat(messages="hi"), "messages", "list"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages", "role"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages",
        "messages[0].content[0].image_url: must be an object",
    ),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        "messages",
        "content part type 'image_url' is not supported; this model does not take images",
    ),
    (chat(tools=[{"type": "function", "function": {}}]), "tools", "not a function name"),
    (chat(tool_choice="auto"), "tool_choice", "needs tools"),
    (chat(response_format={"type": "xml"}), "response_format", "is not one of"),
    (chat(functions=[{"name": "f"}]), "functions", "not supported"),
    (chat(top_logprobs=2), "top_logprobs", "logprobs"),
    (chat(logprobs=True, top_logprobs=30), "top_logprobs", "[0, 20]"),
    (chat(logprobs=3), "logprobs", "boolean"),
    (chat(max_tokens=None, max_completion_tokens=0), "max_completion_tokens", "[1, 2147483647]"),
    (chat(max_completion_tokens=3), "max_completion_tokens", "both"),
    (chat(echo=True), "echo", "unrecognized"),
    (chat(messages=CHAT_OK * 2049), "messages", "2049 messages; at most 2048"),
    # counted before any schema is checked (these schemas are bad: the count is named)
    (chat(tools=[bad_schema_tool(i) for i in range(129)]), "tools", "129 tools; at most 128"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 4097}]),
        "messages",
        "4097 content parts; at most 4096",
    ),
    (chat(messages=[{"role": "user", "content": None}]), "messages", "needs content"),
    (chat(messages=[{"role": "user"}]), "messages", "needs content"),
    (chat(messages=[{"role": "assistant", "content": None}]), "messages", "tool_calls"),
    (chat(messages=[{"role": "user", "content": [None]}]), "messages", "must be an object"),
    (chat(messages=[{"role": "user", "content": [{"type": "x"}]}]), "messages", "'x'"),
    (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages", "'text'"),
    (
        chat(n=200, max_tokens=None, max_completion_tokens=20000),
        "max_completion_tokens",
        "200 choice(s) x max_completion_tokens 20000 = 4000000 tokens",
    ),
]


def assert_error(status, body, content_type, expected_status, param=None, fragment=""):
    assert status == expected_status, body
    assert content_type == "application/json"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert fragment in error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body,param,fragment", BAD_COMPLETIONS)
def test_bad_completion_fields_are_400(server, body, param, fragment):
    for stream in (False, True):
        if stream and ("stream" in body or "stream_options" in body):
            continue
        status, payload, ctype = server.call("POST", "/v1/completions", {"stream": stream, **body})
        error = assert_error(status, payload, ctype, 400, param, fragment)
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param,fragment", BAD_CHATS)
def test_bad_chat_fields_are_400(server, body, param, fragment):
    body = {k: v for k, v in body.items() if v is not None}
    status, payload, ctype = server.call("POST", "/v1/chat/completions", body)
    assert_error(status, payload, ctype, 400, param, fragment)


def test_malformed_bodies_are_400(server):
    for data in (b"{not json", b"\xff\xfe", b"", b"[1, 2]", b'"text"', b"null"):
        status, payload, ctype = server.call("POST", "/v1/completions", data=data)
        assert_error(status, payload, ctype, 400)


STRICT_JSON = [
    (b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}', "NaN"),
    (b'{"prompt": "a", "max_tokens": 2, "temperature": -Infinity}', "Infinity"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "digit"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too deeply"),
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "surrogate"),
    (b'{"prompt": "a", "\\udfff": 1}', "surrogate"),
]


@pytest.mark.parametrize("data,fragment", STRICT_JSON)
def test_bodies_that_are_not_strict_json_are_400(server, data, fragment):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        status, payload, ctype = server.call("POST", path, data=data)
        assert_error(status, payload, ctype, 400, fragment=fragment)


def test_bodies_that_are_not_sent_as_json_are_415(server):
    # a cross-origin page can POST these without a CORS preflight: none may reach a handler
    body = b'{"prompt": "a", "max_tokens": 2}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        headers = {**server.auth, "Content-Type": ctype}
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            status, payload, got = server.call("POST", path, data=body, headers=headers)
            assert_error(status, payload, got, 415, fragment=ctype)
    headers = {**server.auth, "Content-Type": "application/json; charset=utf-8"}
    assert server.call("POST", "/v1/completions", data=body, headers=headers)[0] == 200


def test_prompt_over_the_context_names_the_counts(server):
    n = server.max_model_len
    for stream in (False, True):
        body = {"prompt": [5] * n, "stream": stream}
        status, payload, ctype = server.call("POST", "/v1/completions", body)
        error = assert_error(status, payload, ctype, 400, "prompt")
        assert f"{n} tokens" in error["message"] and f"max_model_len {n}" in error["message"]
    long_chat = {"messages": [{"role": "user", "content": "x " * n}], "stream": True}
    status, payload, ctype = server.call("POST", "/v1/chat/completions", long_chat)
    error = assert_error(status, payload, ctype, 400, "messages")
    assert f"max_model_len {n}" in error["message"]


def test_max_tokens_over_the_context_is_400(server):
    n = server.max_model_len
    body = {"prompt": [5] * 10, "max_tokens": n}
    status, payload, ctype = server.call("POST", "/v1/completions", body)
    error = assert_error(status, payload, ctype, 400, "max_tokens")
    assert f"maximum context length is {n} tokens" in error["message"]
    assert f"{n + 10} were requested (10 in the prompt, {n} for the completion)" in error["message"]


def test_unknown_model_is_404(server):
    status, payload, ctype = server.call("POST", "/v1/completions", completion(model="gpt-4"))
    error = assert_error(status, payload, ctype, 404, "model", "gpt-4")
    assert error["type"] == "not_found_error"


def test_routes_and_methods(server):
    assert_error(*server.call("POST", "/v1/nothing", {}), 404, fragment="/v1/nothing")
    assert_error(*server.call("GET", "/v1/completions"), 405, fragment="POST")
    assert_error(*server.call("DELETE", "/v1/models"), 405, fragment="GET")


def test_oversized_body_is_413(server):
    data = b'{"prompt": "' + b"a" * server.max_body_bytes + b'"}'
    assert_error(*server.call("POST", "/v1/completions", data=data), 413)


def test_api_key(server):
    body = completion()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        error = assert_error(*server.call("POST", "/v1/completions", body, headers=headers), 401)
        assert error["type"] == "authentication_error"
    assert_error(*server.call("GET", "/v1/models", headers={}), 401)
    assert server.call("GET", "/health", headers={})[0] == 200
    # /metrics and the tokenizer endpoints are behind the key too (--open-metrics opens /metrics)
    assert_error(*server.call("GET", "/metrics", headers={}), 401)
    assert_error(*server.call("POST", "/tokenize", {"prompt": "x"}, headers={}), 401)
    assert server.call("GET", "/metrics")[0] == 200
    assert server.call("POST", "/v1/completions", body)[0] == 200


def test_tokenize_and_detokenize(server, offline_llm):
    tok = offline_llm.get_tokenizer()
    text = "import sys\nprint(sys.argv)"
    status, body, _ = server.call("POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200
    assert body["tokens"] == tok.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    status, back, _ = server.call("POST", "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(body["tokens"])}

    messages = [{"role": "user", "content": "hello"}]
    _, counted, _ = server.call("POST", "/tokenize", {"messages": messages})
    _, done, _ = server.call(
        "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1}
    )
    assert counted["count"] == done["usage"]["prompt_tokens"]

    assert_error(*server.call("POST", "/tokenize", {"prompt": 5}), 400, "prompt")
    assert_error(*server.call("POST", "/tokenize", {}), 400)
    assert_error(*server.call("POST", "/detokenize", {"tokens": [-1]}), 400, "tokens")
    assert_error(*server.call("POST", "/detokenize", {"tokens": "abc"}), 400, "tokens")


def test_health_version_metrics(server):
    status, _, _ = server.call("GET", "/health", headers={})
    assert status == 200
    status, body, _ = server.call("GET", "/version")
    assert status == 200 and body["version"]
    values = server.metrics()
    for name in (
        "ringllm:num_requests_running",
        "ringllm:num_requests_waiting",
        "ringllm:kv_cache_usage_perc",
        "ringllm:prefix_cache_queries_total",
        "ringllm:prefix_cache_hits_total",
        "ringllm:num_preemptions_total",
        "ringllm:prompt_tokens_total",
        "ringllm:generation_tokens_total",
        "ringllm:time_to_first_token_seconds_count",
        "ringllm:inter_token_latency_seconds_count",
        "ringllm:e2e_request_latency_seconds_count",
        "ringllm:request_queue_time_seconds_count",
    ):
        assert name in values, name


def test_metrics_count_tokens_and_successes(server):
    before = server.metrics()
    status, body, _ = server.call(
        "POST", "/v1/completions", completion(prompt=[7, 8, 9, 10], max_tokens=5, ignore_eos=True)
    )
    assert status == 200
    after = server.metrics()
    assert after["ringllm:prompt_tokens_total"] - before["ringllm:prompt_tokens_total"] == 4
    assert after["ringllm:generation_tokens_total"] - before["ringllm:generation_tokens_total"] == 5
    key = "ringllm:request_success_total{length}"
    assert after[key] - before.get(key, 0) == 1
    assert (
        after["ringllm:e2e_request_latency_seconds_count"]
        - before["ringllm:e2e_request_latency_seconds_count"]
        == 1
    )
    assert (
        after["ringllm:prefix_cache_queries_total"] >= before["ringllm:prefix_cache_queries_total"]
    )


def test_server_still_serves_and_logged_no_tracebacks(server):
    status, body, _ = server.call("POST", "/v1/completions", completion(max_tokens=3))
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert "Traceback" not in server.log()
    assert " 500 " not in server.log()


def test_reset_prefix_cache(server):
    """vLLM's POST /reset_prefix_cache: behind the key, no body needed; after it the same
    prompt finds nothing cached, where before it did."""
    prompt = {"prompt": [7, 8, 9, 10] * 16, "max_tokens": 1}  # four full blocks of 16

    def hits_after_one():
        before = server.metrics()["ringllm:prefix_cache_hits_total"]
        status, _, _ = server.call("POST", "/v1/completions", prompt)
        assert status == 200
        return server.metrics()["ringllm:prefix_cache_hits_total"] - before

    hits_after_one()
    assert hits_after_one() >= 48  # cached: the second one hits
    status, body, _ = server.call("POST", "/reset_prefix_cache", headers={})
    assert status == 401 and body["error"]["type"]
    status, body, _ = server.call("POST", "/reset_prefix_cache")  # no body, no content type
    assert status == 200
    assert hits_after_one() == 0
    assert hits_after_one() >= 48
