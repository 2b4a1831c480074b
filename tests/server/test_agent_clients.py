"""Agent frameworks end to end against `ringllm serve`, each over the API it speaks by
default: the OpenAI Agents SDK (its Responses model), LangChain's ChatOpenAI with the
Responses API and its ChatAnthropic (the Messages API), pydantic-ai (its Responses model).

Each runs a whole tool loop: a call made, run by the framework, its result sent back in the
framework's own history shape, and a final answer. The tiny test model would never call a
tool by itself: the calls are forced by name (tool_choice), which the server enforces with
a grammar, so every call's arguments fit its tool's schema. The server parses free text for
calls too (--enable-auto-tool-choice, hermes) and takes thinking apart (qwen3), as a real
deployment would.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

API_KEY = "unused"  # the tool server takes any key


class WeatherArgs(BaseModel):
    city: Literal["Paris", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


class Forecast(BaseModel):
    city: Literal["Paris", "Oslo"]
    sunny: bool


class TimeArgs(BaseModel):
    city: Literal["Paris", "Oslo"]
    hours_ahead: int = Field(ge=0, le=12)


@pytest.fixture(scope="module")
def model_name(tool_server):
    return openai.OpenAI(base_url=tool_server + "/v1", api_key=API_KEY).models.list().data[0].id


def test_openai_agents_sdk_two_tool_loop_on_the_responses_api(tool_server, model_name):
    """The SDK's default model (Responses API): the agent is made to call get_weather,
    then get_time (its hooks move tool_choice on after each tool ran), then answer."""
    from agents import (
        Agent,
        AgentHooks,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # no trace upload anywhere
    seen: list[tuple[str, object]] = []

    @function_tool
    def get_weather(args: WeatherArgs) -> str:
        """The weather in a city."""
        seen.append(("get_weather", args))
        return f"sunny, 22 {args.unit} in {args.city}"

    @function_tool
    def get_time(args: TimeArgs) -> str:
        """The local time in a city, some hours ahead."""
        seen.append(("get_time", args))
        return f"{10 + args.hours_ahead}:00 in {args.city}"

    class NextTool(AgentHooks):
        async def on_tool_end(self, context, agent, tool, result):
            following = {"get_weather": "get_time", "get_time": "none"}[tool.name]
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice=following)

    client = openai.AsyncOpenAI(base_url=tool_server + "/v1", api_key=API_KEY, max_retries=0)
    agent = Agent(
        name="planner",
        instructions="Check the weather, then the time, then answer.",
        tools=[get_weather, get_time],
        # a typed answer: its JSON schema's grammar ends the tiny model's text (free text
        # would run to max_tokens, which the SDK takes as a failed turn)
        output_type=Forecast,
        model=OpenAIResponsesModel(model=model_name, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0.0, max_tokens=60),
        reset_tool_choice=False,
        hooks=NextTool(),
    )

    async def run(streamed: bool):
        question = "Weather and time in Paris?"
        if not streamed:
            return await Runner.run(agent, question, max_turns=4)
        result = Runner.run_streamed(agent, question, max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "raw_response_event" in kinds
        return result

    async def both():  # one event loop: the client's connections belong to it
        results = []
        for streamed in (False, True):
            seen.clear()
            agent.model_settings = dataclasses.replace(
                agent.model_settings, tool_choice="get_weather"
            )
            result = await run(streamed)
            results.append(([name for name, _ in seen], result))
        return results

    for called, result in asyncio.run(both()):
        assert called == ["get_weather", "get_time"]
        assert isinstance(result.final_output, Forecast)
        assert len(result.raw_responses) == 3  # two tool turns, one answer


def test_langchain_chat_openai_on_the_responses_api(tool_server, model_name):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool("get_weather", args_schema=WeatherArgs)
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        return f"22 degrees {unit} in {city}"

    llm = ChatOpenAI(
        base_url=tool_server + "/v1", api_key=API_KEY, model=model_name, temperature=0,
        max_tokens=40, use_responses_api=True, max_retries=0,
    )  # fmt: skip
    question = HumanMessage("What is the weather in Paris?")
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather"
    WeatherArgs(**call["args"])
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    # the answer sampled (greedy, the tiny model writes only newlines), seeded
    answer_llm = ChatOpenAI(
        base_url=tool_server + "/v1", api_key=API_KEY, model=model_name, temperature=1.0,
        extra_body={"seed": 7}, max_tokens=40, use_responses_api=True, max_retries=0,
    )  # fmt: skip
    final = answer_llm.bind_tools([get_weather]).invoke([question, reply, result])
    assert final.text.strip() and not final.tool_calls
    assert final.response_metadata["id"].startswith("resp_")
    # streamed, the chunks add up to the same call
    chunks = list(llm.bind_tools([get_weather], tool_choice="get_weather").stream([question]))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [c["name"] for c in whole.tool_calls] == ["get_weather"]
    assert whole.tool_calls[0]["args"] == call["args"]  # greedy: the same arguments


def test_langchain_chat_anthropic_bind_tools(tool_server, model_name):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool("get_weather", args_schema=WeatherArgs)
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        return f"22 degrees {unit} in {city}"

    llm = ChatAnthropic(
        base_url=tool_server, api_key=API_KEY, model=model_name, temperature=0,
        max_tokens=40, max_retries=0,
    )  # fmt: skip
    question = HumanMessage("What is the weather in Oslo?")
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
    WeatherArgs(**call["args"])
    assert reply.response_metadata["stop_reason"] == "tool_use"
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    # the answer sampled (greedy, the tiny model writes only newlines), seeded
    answer_llm = ChatAnthropic(
        base_url=tool_server, api_key=API_KEY, model=model_name, temperature=1.0,
        model_kwargs={"extra_body": {"seed": 7}}, max_tokens=40, max_retries=0,
    )  # fmt: skip
    final = answer_llm.bind_tools([get_weather]).invoke([question, reply, result])
    assert final.text.strip() and not final.tool_calls
    assert final.usage_metadata["output_tokens"] > 0


def test_pydantic_ai_agent_with_a_tool_and_structured_output(tool_server, model_name):
    """pydantic-ai's Responses model: its function tool forced on the first step, its
    output tool (the typed answer) on the next, each step's tool_choice set by a
    capability, as pydantic-ai documents for per-step forcing."""
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class ForceEachStep(AbstractCapability):
        def get_model_settings(self):
            def settings(ctx: RunContext[None]):
                return {"tool_choice": ["get_weather"] if ctx.run_step == 1 else ["final_result"]}

            return settings

    provider = OpenAIProvider(base_url=tool_server + "/v1", api_key=API_KEY)
    model = OpenAIResponsesModel(model_name, provider=provider)
    agent = Agent(
        model, output_type=Forecast, capabilities=[ForceEachStep()],
        model_settings={"temperature": 0.0, "max_tokens": 60},
    )  # fmt: skip
    seen: list[WeatherArgs] = []

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        seen.append(WeatherArgs(city=city, unit=unit))
        return f"sunny in {city}"

    result = agent.run_sync("Is it sunny in Paris?")
    assert len(seen) == 1
    assert isinstance(result.output, Forecast)
    kinds = [part.part_kind for message in result.all_messages() for part in message.parts]
    assert kinds.count("tool-call") == 2 and kinds.count("tool-return") == 2  # weather, output
