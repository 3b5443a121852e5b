"""`localpd serve`'s Responses API through the official openai client's `client.responses` against a live server
on loopback, real default model."""

import json

import httpx
import openai
import pytest
from live_server import KEY, MODEL, idle

from localpd.engine.sampling import SamplingParams

Q = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0)


def test_a_response_streamed_or_not_is_the_engines_reply(served, client):
    engine = served[0]
    system = "You are a geography tutor."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": Q}]
    events = list(engine.chat(messages, SamplingParams(temperature=0, max_tokens=16)))
    alone = "".join(ev.text for ev in events)
    r = client.responses.create(model=MODEL, instructions=system, input=Q, max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and alone
    assert r.output_text == alone and [item.type for item in r.output] == ["message"]
    assert r.usage.input_tokens == len(engine.encode_chat(messages))
    assert r.usage.output_tokens == sum(ev.token_id is not None for ev in events)
    cut = r.usage.output_tokens == 16
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    items = [{"role": "system", "content": system},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": Q}]}]
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=16, temperature=0).output_text == alone
    stream = list(client.responses.create(model=MODEL, instructions=system, input=Q, max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [ev.type for ev in stream]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [ev.sequence_number for ev in stream] == list(range(len(stream)))
    assert "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta") == alone
    assert stream[-1].response.output_text == alone and stream[-1].response.usage.output_tokens == r.usage.output_tokens
    assert idle(engine)


def test_previous_response_id_goes_on_from_a_kept_response(served, client):
    engine = served[0]
    first = client.responses.create(model=MODEL, input=Q, max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="And Spain?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    history = [{"role": "user", "content": Q}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And Spain?"}]
    assert second.usage.input_tokens == len(engine.encode_chat(history))
    assert second.usage.input_tokens_details.cached_tokens > 0
    unkept = client.responses.create(model=MODEL, input=Q, max_output_tokens=2, store=False)
    for missing in (unkept.id, "resp_nothing"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="Go on", previous_response_id=missing)
        assert caught.value.body["param"] == "previous_response_id" and missing in caught.value.body["message"]


def test_function_calls_and_their_outputs(served, client):
    ask = "What is the weather in Paris?"
    r = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=48, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"} and call.call_id
    stream = list(client.responses.create(model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=48,
                                          temperature=0, tool_choice="required", stream=True))
    done = [ev.item for ev in stream if ev.type == "response.output_item.done" and ev.item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(call.name, call.arguments)]
    args = [ev.arguments for ev in stream if ev.type == "response.function_call_arguments.done"]
    assert args == [call.arguments]
    follow = [{"role": "user", "content": ask}, {"type": "function_call", "call_id": call.call_id,
                                                 "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees"}]
    answer = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], max_output_tokens=16, temperature=0)
    engine = served[0]
    conversation = [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 degrees"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    ids = engine.encode_chat(conversation, tools=tools)
    assert "Sunny, 24 degrees" in engine.tokenizer.decode(ids) and answer.usage.input_tokens == len(ids)
    assert idle(engine)


def test_text_format_holds_the_reply_to_a_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name a city and its country as JSON.", max_output_tokens=48,
                                temperature=0, text={"format": {"type": "json_schema", "name": "place",
                                                                "schema": schema, "strict": True}})
    if r.status == "completed":
        assert set(json.loads(r.output_text)) == {"city", "country"}
    else:
        from localpd.constrain.grammar import Reader as JsonPrefix
        assert JsonPrefix().feed(r.output_text)
    j = client.responses.create(model=MODEL, input="Give me a JSON object.", max_output_tokens=24, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert j.output_text.lstrip().startswith("{")


@pytest.mark.parametrize("payload, fragment", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "'input_image'"),
    ({"input": [{"type": "web_search_call"}]}, "web_search_call"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "needs tools"),
    ({"input": "hi", "max_output_tokens": 10**6}, "context"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a schema"),
    ({"input": "hi", "previous_response_id": "resp_x"}, "not kept"),
])
def test_bad_requests_get_openai_shaped_400s(served, payload, fragment):
    r = httpx.post(served[1].url + "/v1/responses", json=payload, headers={"Authorization": f"Bearer {KEY}"})
    body = r.json()
    assert r.status_code == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body
    assert idle(served[0])


def test_a_thinking_models_reasoning_is_a_reasoning_item(served, client, monkeypatch):
    from test_server import OPEN_THINK

    engine = served[0]
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK)
    ask = [{"role": "user", "content": Q}]
    raw = "".join(ev.text for ev in engine.generate(engine.encode_chat(ask), SamplingParams(temperature=0,
                                                                                            max_tokens=12)))
    r = client.responses.create(model=MODEL, input=Q, max_output_tokens=12, temperature=0)
    assert r.output[0].type == "reasoning" and r.output[0].summary[0].text == raw.strip()
    stream = list(client.responses.create(model=MODEL, input=Q, max_output_tokens=12, temperature=0, stream=True))
    assert "".join(ev.delta for ev in stream if ev.type == "response.reasoning_summary_text.delta") == raw.strip()
    assert stream[-1].response.output[0].summary[0].text == raw.strip()
