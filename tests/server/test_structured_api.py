"""Structured outputs and tool calling over HTTP, judged by clients and oracles no one here
wrote: the official `openai` client (`chat.completions.parse` with a pydantic model, streamed
`delta.tool_calls`), `jsonschema`, `re`, LangChain's `ChatOpenAI.bind_tools` and the OpenAI
Agents SDK with its chat-completions model, all pointed at `ringllm serve`."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 999},
                "b": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
# forces a Hermes-style call, so "auto" parsing meets a real model's (constrained) text
HERMES_CALL = r'I will check\.<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tool_server):
    return tool_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def test_json_schema_choices_validate_at_temperature_1(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=USER, n=24, seed=5, temperature=1.0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )  # fmt: skip
    texts = [c.message.content for c in response.choices]
    assert all(c.finish_reason == "stop" for c in response.choices), texts
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 12


def test_completions_take_every_spelling(client, model_name):
    def complete(**extra):
        return client.completions.create(
            model=model_name,
            prompt="Answer:",
            n=12,
            seed=1,
            temperature=1.0,
            max_tokens=40,
            **extra,
        ).choices

    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    for body in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        assert all(re.fullmatch(regex, c.text) for c in complete(extra_body=body))
    choices = ["alpha", "beta", "gamma delta"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        assert all(c.text in choices for c in complete(extra_body=body))
    for body in ({"guided_json": PERSON}, {"structured_outputs": {"json": PERSON}}):
        for c in client.completions.create(
            model=model_name,
            prompt="{",
            n=8,
            seed=2,
            temperature=1.0,
            max_tokens=120,
            extra_body=body,
        ).choices:
            jsonschema.validate(json.loads(c.text), PERSON)
    grammar = 'start: "yes" | "no" | "(" start ")"'
    assert all(
        re.fullmatch(r"\(*(yes|no)\)*", c.text)
        for c in complete(extra_body={"guided_grammar": grammar})
        if c.finish_reason == "stop"
    )


def test_json_object_is_an_object(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=USER, n=8, seed=3, temperature=1.0, max_tokens=300,
        response_format={"type": "json_object"},
    )  # fmt: skip
    done = [c for c in response.choices if c.finish_reason == "stop"]
    assert done
    assert all(isinstance(json.loads(c.message.content), dict) for c in done)


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


def test_openai_parse_returns_the_pydantic_object(client, model_name):
    completion = client.chat.completions.parse(
        model=model_name, messages=USER, response_format=Pet, temperature=0.0, max_tokens=100
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Pet)


def tool_calls_of(choice) -> list[tuple[str, dict]]:
    return [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]


def test_required_and_named_tool_choice_make_valid_calls(client, model_name):
    required = client.chat.completions.create(
        model=model_name, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=12, seed=4, temperature=1.0, max_tokens=120,
    )  # fmt: skip
    names = set()
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.add(call.function.name)
    assert len({c.message.tool_calls[0].id for c in required.choices}) == 12
    named = client.chat.completions.create(
        model=model_name, messages=USER, tools=TOOLS, n=8, seed=4, temperature=1.0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    for choice in named.choices:
        ((name, arguments),) = tool_calls_of(choice)
        assert name == "get_weather" and choice.finish_reason == "tool_calls"
        jsonschema.validate(arguments, SCHEMAS["get_weather"])


def streamed(client, model_name, **kwargs) -> tuple[list[dict], str, str, str | None]:
    """(calls, content, reasoning, finish_reason) put together from a stream's deltas."""
    calls: dict[int, dict] = {}
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(model=model_name, stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id is not None:
                assert call["id"] is None, "a call's id comes once"
                call["id"] = piece.id
            if piece.function is not None and piece.function.name is not None:
                assert call["name"] is None, "a call's name comes once"
                call["name"] = piece.function.name
            if piece.function is not None:
                call["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, reasoning, finish


@pytest.mark.parametrize(
    "tool_choice, extra",
    [
        ("required", {"parallel_tool_calls": False}),
        ({"type": "function", "function": {"name": "add"}}, {}),
        ("auto", {"extra_body": {"guided_regex": HERMES_CALL}}),
    ],
    ids=["required", "named", "auto"],
)
def test_streamed_tool_calls_equal_the_response(client, model_name, tool_choice, extra):
    kwargs = dict(
        messages=USER, tools=TOOLS, tool_choice=tool_choice, seed=9, temperature=1.0,
        max_tokens=200, **extra,
    )  # fmt: skip
    whole = client.chat.completions.create(model=model_name, **kwargs).choices[0]
    calls, content, _, finish = streamed(client, model_name, **kwargs)
    assert whole.finish_reason == finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    assert (content or None) == whole.message.content
    for name, arguments in tool_calls_of(whole):
        jsonschema.validate(arguments, SCHEMAS[name])


def test_auto_tool_choice_reads_the_calls_the_model_writes(client, model_name):
    """The model (made to write a Hermes call by a grammar) says something, then calls a
    tool: content and the parsed call come apart."""
    choice = client.chat.completions.create(
        model=model_name, messages=USER, tools=TOOLS, seed=1, temperature=1.0, max_tokens=200,
        extra_body={"guided_regex": HERMES_CALL},
    ).choices[0]  # fmt: skip
    assert choice.message.content == "I will check."
    ((name, arguments),) = tool_calls_of(choice)
    assert name == "add" and set(arguments) == {"a", "b"}
    plain = client.chat.completions.create(
        model=model_name, messages=USER, tools=TOOLS, seed=1, temperature=1.0, max_tokens=20,
        extra_body={"guided_regex": "No tool needed here"},
    ).choices[0]  # fmt: skip
    assert plain.message.content == "No tool needed here" and not plain.message.tool_calls
    assert plain.finish_reason == "stop"


def test_reasoning_content_comes_apart(client, model_name):
    thinking = r"<think>\nLet me think[a-z ]{0,20}\.\n</think>\n\nThe answer is (yes|no)\."
    kwargs = dict(
        messages=USER, seed=2, temperature=1.0, max_tokens=60, extra_body={"guided_regex": thinking}
    )
    message = client.chat.completions.create(model=model_name, **kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.strip().startswith("Let me think") and "<think>" not in reasoning
    assert re.fullmatch(r"The answer is (yes|no)\.", message.content)
    _, content, streamed_reasoning, _ = streamed(client, model_name, **kwargs)
    assert (content, streamed_reasoning) == (message.content, reasoning)


def test_a_history_with_tool_calls_and_results_renders(client, model_name):
    history = [
        *USER,
        {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]  # fmt: skip
    response = client.chat.completions.create(
        model=model_name,
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
    )
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, None, "not a valid JSON Schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "is not one of"),
        ({"structured_outputs": {"regex": "[a-"}}, None, "cannot be enforced"),
        ({"guided_grammar": "start: ("}, None, "cannot be enforced"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "one output constraint"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "not a function name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools", "not a valid JSON Schema"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot go together"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "llguidance"),
    ],
)  # fmt: skip
def test_bad_constraints_are_a_400_that_names_them(client, model_name, body, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model_name, messages=USER, max_tokens=4, extra_body=body
        )
    error = caught.value.body
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param


# ---- frameworks ------------------------------------------------------------------------


class WeatherArgs(BaseModel):
    """The weather in a city."""

    city: str = Field(min_length=1, max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def test_langchain_tool_round_trip(server, model_name):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool("get_weather", args_schema=WeatherArgs)
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        return f"22 degrees {unit} in {city}"

    llm = ChatOpenAI(
        base_url=server + "/v1", api_key="unused", model=model_name, temperature=0, max_tokens=80
    )
    with_tools = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    reply = with_tools.invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather"
    WeatherArgs(**call["args"])  # valid against the tool's own schema
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    final = llm.invoke([question, reply, result])
    assert isinstance(final.content, str) and final.response_metadata["finish_reason"] in (
        "stop",
        "length",
    )


def test_openai_agents_sdk_calls_the_tool(server, model_name):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace upload anywhere
    seen: list[tuple[str, str]] = []

    @function_tool
    def get_weather(args: WeatherArgs) -> str:
        """The weather in a city."""
        seen.append((args.city, args.unit))
        return f"sunny in {args.city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(
            model=model_name,
            openai_client=openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused"),
        ),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0.0, max_tokens=80),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(seen) == 1
    assert result.final_output == f"sunny in {seen[0][0]}"


def test_logprobs_of_refused_tokens_are_strict_json(server, model_name):
    """Under a grammar most top tokens are refused (-inf): the body stays strict JSON
    (no -Infinity; vLLM's -9999.0 stands in), parsed here by a parser that takes no
    constants, for a response and a stream."""
    import urllib.request

    def refuse_constants(name):
        raise ValueError(f"not strict JSON: {name}")

    body = {
        "model": model_name, "messages": USER, "max_tokens": 8, "logprobs": True,
        "top_logprobs": 5, "structured_outputs": {"choice": ["yes", "no"]},
    }  # fmt: skip
    for stream in (False, True):
        request = urllib.request.Request(
            server + "/v1/chat/completions",
            data=json.dumps({**body, "stream": stream}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read().decode()
        texts = [line[6:] for line in raw.splitlines() if line.startswith("data: {")] or [raw]
        logprobs = []
        for text in texts:
            for choice in json.loads(text, parse_constant=refuse_constants)["choices"]:
                for position in (choice.get("logprobs") or {}).get("content") or []:
                    logprobs += [top["logprob"] for top in position["top_logprobs"]]
        assert logprobs and min(logprobs) == -9999.0  # refused tokens were among the top 5
