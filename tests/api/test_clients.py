"""Agent and app frameworks people point at an OpenAI-compatible server, unmodified, against `localpd serve`'s
live server on loopback, real default model: openai-agents on its default model (the Responses API),
pydantic-ai's Responses and chat models, langchain-openai's structured output. Each answers as the engine does
or is held to the schema it asked for."""

import asyncio
import json

import pytest
from live_server import KEY, MODEL, idle
from pydantic import BaseModel

from localpd.engine.sampling import SamplingParams

ASK = "What is the capital of France?"
SHORT = "Answer in one short sentence."


class City(BaseModel):
    """A plain int field: the case that looped on digits until max_tokens before numbers were bounded."""
    city: str
    population: int


def engine_reply(engine, messages: list[dict], max_tokens: int) -> str:
    return "".join(ev.text for ev in engine.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens)))


def test_openai_agents_default_model_answers_streams_and_calls_a_tool(served):
    """The SDK's default model provider (its default API is Responses) pointed at the server, tracing off (it would
    upload to OpenAI); one event loop for the run, as an app has (the provider's client keeps its connections)."""
    agents = pytest.importorskip("agents")
    engine = served[0]
    config = agents.RunConfig(tracing_disabled=True, model_provider=agents.OpenAIProvider(
        base_url=served[1].url + "/v1", api_key=KEY))
    assert isinstance(config.model_provider.get_model(MODEL), agents.OpenAIResponsesModel)  # the default
    agent = agents.Agent(name="tutor", instructions=SHORT, model=MODEL,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
    asked = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return "Sunny, 24 degrees"

    caller = agents.Agent(name="weather", instructions="You report the weather.", model=MODEL, tools=[get_weather],
                          model_settings=agents.ModelSettings(temperature=0, max_tokens=48, tool_choice="get_weather"),
                          tool_use_behavior="stop_on_first_tool")

    async def session():
        plain = await agents.Runner.run(agent, ASK, run_config=config)
        run = agents.Runner.run_streamed(agent, ASK, run_config=config)
        deltas = [ev.data.delta async for ev in run.stream_events()
                  if ev.type == "raw_response_event" and ev.data.type == "response.output_text.delta"]
        called = await agents.Runner.run(caller, "What is the weather in Paris?", run_config=config)
        return plain.final_output, "".join(deltas), run.final_output, called.final_output

    plain, streamed, streamed_final, called = asyncio.run(session())
    alone = engine_reply(engine, [{"role": "system", "content": SHORT}, {"role": "user", "content": ASK}], 64)
    assert plain == streamed == streamed_final == alone and "Paris" in alone
    assert called == "Sunny, 24 degrees" and len(asked) == 1 and asked[0]
    assert idle(engine)


@pytest.mark.parametrize("kind", ["OpenAIResponsesModel", "OpenAIChatModel"])
def test_pydantic_ai_models_answer_stream_and_fill_an_output_type(served, kind):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models import openai as models
    from pydantic_ai.providers.openai import OpenAIProvider

    engine = served[0]
    model = getattr(models, kind)(MODEL, provider=OpenAIProvider(base_url=served[1].url + "/v1", api_key=KEY))
    agent = Agent(model, instructions=SHORT, model_settings={"temperature": 0, "max_tokens": 32})
    alone = engine_reply(engine, [{"role": "system", "content": SHORT}, {"role": "user", "content": ASK}], 32)
    assert agent.run_sync(ASK).output == alone

    async def streamed():
        async with agent.run_stream(ASK) as run:
            return "".join([delta async for delta in run.stream_text(delta=True)])

    assert asyncio.run(streamed()) == alone
    typed = Agent(model, output_type=City, model_settings={"temperature": 0, "max_tokens": 96})
    out = typed.run_sync("Name the capital of France and its population.").output
    assert isinstance(out, City) and isinstance(out.population, int)  # a forced call held to the output's schema
    assert idle(engine)


@pytest.mark.parametrize("method, strict", [(None, None), ("json_schema", None), ("json_schema", True)])
def test_langchain_structured_output_with_an_int_field_ends_before_max_tokens(served, method, strict):
    """with_structured_output(City) as langchain-openai sends it (its default is json_schema): the reply opens with
    the object (a space at most before it), its number is bounded, and it ends with the object, well before
    max_tokens."""
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=served[1].url + "/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=256,
                     max_retries=0)
    kw = {k: v for k, v in (("method", method), ("strict", strict)) if v is not None}
    out = llm.with_structured_output(City, include_raw=True, **kw).invoke(
        "Name the capital of France and its population.")
    raw = out["raw"]
    assert out["parsing_error"] is None and isinstance(out["parsed"], City), out
    assert raw.response_metadata["finish_reason"] == "stop" and raw.usage_metadata["output_tokens"] < 256
    assert raw.content.removeprefix(" ").startswith("{") and json.loads(raw.content) == out["parsed"].model_dump()
    assert idle(served[0])
