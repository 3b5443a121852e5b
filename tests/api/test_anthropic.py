"""`localpd serve`'s Anthropic Messages API through the official anthropic client against a live server on
loopback, real default model."""

import anthropic
import httpx
import pytest
from live_server import KEY, MODEL, idle

from localpd.engine.sampling import SamplingParams

Q = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the client's own signature no longer takes it; the API does
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served[1].url, api_key=KEY, max_retries=0)


def test_a_message_streamed_or_not_is_the_engines_reply(served, client):
    engine = served[0]
    events = list(engine.chat(Q, SamplingParams(temperature=0, max_tokens=16)))
    alone = "".join(ev.text for ev in events)
    r = client.messages.create(model=MODEL, messages=Q, max_tokens=16, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == alone and "Paris" in alone
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(engine.encode_chat(Q))
    assert r.usage.output_tokens == sum(ev.token_id is not None for ev in events)
    with client.messages.stream(model=MODEL, messages=Q, max_tokens=16, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == alone and final.content[0].text == alone and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens
    assert client.messages.count_tokens(model=MODEL, messages=Q).input_tokens == len(engine.encode_chat(Q))
    assert idle(engine)


def test_system_and_stop_sequences(served, client):
    engine = served[0]
    system = "You answer in one word."
    r = client.messages.create(model=MODEL, system=system, messages=Q, max_tokens=24, extra_body=GREEDY,
                               stop_sequences=["Paris"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris" and "Paris" not in r.content[0].text
    with_system = [{"role": "system", "content": system}] + Q
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(engine.encode_chat(with_system))
    blocks = client.messages.create(model=MODEL, system=[{"type": "text", "text": system}], messages=[
        {"role": "user", "content": [{"type": "text", "text": Q[0]["content"]}]}], max_tokens=24, extra_body=GREEDY,
        stop_sequences=["Paris"])
    assert blocks.content[0].text == r.content[0].text
    with client.messages.stream(model=MODEL, system=system, messages=Q, max_tokens=24, extra_body=GREEDY,
                                stop_sequences=["Paris"]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"


def test_a_forced_tool_use_and_its_result(served, client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.messages.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=48, extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use"
    [use] = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"} and use.id
    with client.messages.stream(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=48, extra_body=GREEDY,
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(use.name, use.input)]
    history = ask + [{"role": "assistant", "content": r.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "Sunny, 24 degrees"}]}]
    answer = client.messages.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=24, extra_body=GREEDY)
    prompt = served[0].tokenizer.decode(served[0].encode_chat([
        ask[0], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "Sunny, 24 degrees"}]))
    assert "Sunny, 24 degrees" in prompt and answer.content and answer.usage.input_tokens > 0
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens
    assert counted == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert idle(served[0])


def test_a_thinking_models_reasoning_is_a_thinking_block(served, client, monkeypatch):
    from test_server import OPEN_THINK

    engine = served[0]
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK)
    raw = "".join(ev.text for ev in engine.generate(engine.encode_chat(Q), SamplingParams(temperature=0,
                                                                                          max_tokens=12)))
    r = client.messages.create(model=MODEL, messages=Q, max_tokens=12, extra_body=GREEDY)
    assert r.content[0].type == "thinking" and r.content[0].thinking == raw.strip()
    with client.messages.stream(model=MODEL, messages=Q, max_tokens=12, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == raw.strip()


@pytest.mark.parametrize("payload, fragment", [
    ({"messages": Q}, "max_tokens"),
    ({"messages": Q, "max_tokens": 0}, "max_tokens"),
    ({"messages": [], "max_tokens": 4}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 4}, "role"),
    ({"messages": [{"role": "user", "content": ""}], "max_tokens": 4}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "'image'"),
    ({"messages": Q, "max_tokens": 10**6}, "context"),
    ({"messages": Q, "max_tokens": 4, "temperature": 1.5}, "temperature"),
    ({"messages": Q, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}},
     "not in tools"),
    ({"messages": Q, "max_tokens": 4, "tool_choice": {"type": "any"}}, "needs tools"),
])
def test_bad_requests_get_anthropics_error_shape(served, payload, fragment):
    r = httpx.post(served[1].url + "/v1/messages", json=payload, headers={"x-api-key": KEY})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and fragment in body["error"]["message"], body
    assert idle(served[0])


def test_a_missing_key_and_a_body_that_is_not_json(served):
    r = httpx.post(served[1].url + "/v1/messages", json={"messages": Q, "max_tokens": 4})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(served[1].url + "/v1/messages", content=b"{not json", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
