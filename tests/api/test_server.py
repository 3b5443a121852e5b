"""`localpd serve` through the official openai client against a live server on loopback, real default model."""

import asyncio
import gc
import json
import re
import threading
import time

import httpx
import openai
import pytest
from live_server import KEY, MODEL, LiveServer, at_once, idle

from localpd.engine import Engine
from localpd.engine.sampling import SamplingParams
from localpd.api.app import create_app
from localpd.api.models import ModelPool, ServedModel

Q = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0)


def test_models_and_a_greedy_chat_completion(served, client):
    engine, _ = served
    assert [m.id for m in client.models.list().data] == [engine.name]
    r = client.chat.completions.create(model=engine.name, messages=Q, temperature=0, max_tokens=24)
    assert "Paris" in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(engine.encode_chat(Q)) and r.usage.completion_tokens > 3
    t = r.model_extra["timings"]
    assert t["decode_tokens_per_s"] > 0 and 0 < t["decode_mbu"] and t["ceiling_tokens_per_s"] > 0


def test_streaming_with_usage_equals_the_plain_answer(client):
    plain = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stop_strings_seed_and_a_plain_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=24, stop=["Paris"])
    assert "Paris" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"
    story = [{"role": "user", "content": "Tell me a story about a cat."}]
    a, b = (client.chat.completions.create(model=MODEL, messages=story, temperature=1.0, seed=7, max_tokens=16)
            for _ in range(2))
    assert a.choices[0].message.content == b.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert c.choices[0].text.strip() and c.choices[0].finish_reason == "length"


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=3, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].token == content[0].top_logprobs[0].token


def test_repeated_system_prompt_is_served_from_the_prefix_cache(client):
    system = {"role": "system", "content": "You are a geography tutor who answers briefly. " * 6}
    client.chat.completions.create(model=MODEL, messages=[system] + Q, temperature=0, max_tokens=4)
    r = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "And Spain?"}],
                                       temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens_details.cached_tokens >= 48


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_tool_choice_gets_a_call_streamed_or_not(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=48,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in calls] == [(0, "get_weather",
                                                                                call.function.arguments)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


def test_forced_calls_follow_the_tools_schemas_whatever_is_sampled(client):
    """tool_choice named or required: the call is decoded in JSON mode against the call's schema, so at any seed
    the reply is a call whose arguments are the named function's parameters (required with one tool: that one) or,
    with several tools, one of their names and that one's parameters, unless max_tokens cuts it (then it is a JSON
    prefix)."""
    from localpd.constrain.grammar import Reader as JsonPrefix

    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = []
    cases = [(seed, tools, choice) for seed in range(3)
             for tools, choice in (([WEATHER], named), ([WEATHER], "required"), ([WEATHER, clock], "required"))]
    replies = at_once(lambda case: client.chat.completions.create(
        model=MODEL, messages=ASK, tools=case[1], tool_choice=case[2], temperature=1.0, seed=case[0],
        max_tokens=64).choices[0], cases)
    for (seed, tools, choice), c in zip(cases, replies):
        if c.finish_reason == "length":
            assert JsonPrefix().feed(c.message.content.removeprefix("<tool_call>\n"))
            continue
        assert c.finish_reason == "tool_calls" and c.message.content is None
        call = c.message.tool_calls[0].function
        args = json.loads(call.arguments)
        assert call.name in ("get_weather", "get_time") and isinstance(args, dict)
        if len(tools) == 1:
            assert call.name == "get_weather"
        if call.name == "get_weather":
            assert set(args) == {"city"} and isinstance(args["city"], str)
        else:
            assert args in ({"zone": "UTC"}, {"zone": "CET"})
        calls.append(call.name)
    assert len(calls) >= 6


def test_a_json_schema_reply_parses_into_its_model(client):
    """response_format json_schema, as the openai client's parse() sends a pydantic model: the reply is an
    instance (the model's own answer is a sentence)."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str
        country: str
        population: int

    r = client.chat.completions.parse(model=MODEL, messages=Q, response_format=City, temperature=0, max_tokens=96)
    assert isinstance(r.choices[0].message.parsed, City) and r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) == {"name", "country", "population"}

    class Tower(BaseModel):  # pydantic's bounds: the parse would raise on a value outside them
        name: str = Field(min_length=3, max_length=14)
        year_built: int = Field(ge=1850, le=1950)
        height_m: int = Field(gt=100, lt=400)
        fame: float = Field(ge=0, lt=1)

    ask = [{"role": "user", "content": "Describe the Eiffel Tower: its name, the year it was built, its height."}]
    for t in at_once(lambda seed: client.chat.completions.parse(model=MODEL, messages=ask, response_format=Tower,
                                                                temperature=1.0, seed=seed, max_tokens=96).choices[0],
                     range(3)):
        assert t.finish_reason == "stop" and isinstance(t.message.parsed, Tower), t.message.content


def test_patterns_and_formats_of_a_model_are_held(client):
    """pydantic's Field(pattern=...) and a date: the parse, which checks both, succeeds at any seed."""
    import datetime

    from pydantic import BaseModel, Field

    class Flight(BaseModel):
        code: str = Field(pattern=r"^[A-Z]{2}\d{3,4}$")
        day: datetime.date
        gate: str = Field(pattern=r"^[A-H][1-9]$")

    ask = [{"role": "user", "content": "Book me a flight to Paris: its flight code, the day and the gate."}]
    for t in at_once(lambda seed: client.chat.completions.parse(model=MODEL, messages=ask, response_format=Flight,
                                                                temperature=1.0, seed=seed, max_tokens=96).choices[0],
                     range(3)):
        assert t.finish_reason == "stop" and isinstance(t.message.parsed, Flight), t.message.content


def test_vllms_structured_outputs_hold_the_reply_to_a_choice_a_pattern_or_a_schema(served, client):
    """structured_outputs (vLLM 0.10 on) and guided_choice / guided_regex / guided_json (before): at any seed the
    whole reply is one of the choices (characters outside ASCII included), matches the pattern, or parses; streamed
    as it is whole; on completions too."""
    import re

    ask = [{"role": "user", "content": "Is 'I loved this film' positive or negative?"}]
    kw = dict(model=MODEL, messages=ask, temperature=1.0, max_tokens=24)
    choices = ["positive", "negative"]
    drinks = ["☕ café crème", "🍵 thé", "🥛 lait"]  # the emoji come in tokens of a byte or two each
    drink = [{"role": "user", "content": "Name a French drink."}]
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    phone_ask = [{"role": "user", "content": "Give me a phone number."}]
    cases = ([("choice", seed, kw["messages"], body) for seed in range(2)
              for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}})]
             + [(what, seed, drink, body) for seed in range(3) for what, body in
                (("drink", {"guided_choice": drinks}), ("drink json", {"guided_json": {"enum": drinks}}))]
             + [("phone", seed, phone_ask, {"structured_outputs": {"regex": phone}}) for seed in range(3)])
    replies = at_once(lambda case: client.chat.completions.create(
        model=MODEL, messages=case[2], temperature=1.0, max_tokens=24, seed=case[1], extra_body=case[3]).choices[0],
        cases)
    for (what, _, _, _), c in zip(cases, replies):
        if what == "choice":
            assert c.message.content in choices and c.finish_reason == "stop"
        elif what == "drink":
            assert c.message.content in drinks and c.finish_reason == "stop"
        elif what == "drink json":
            assert json.loads(c.message.content) in drinks and c.finish_reason == "stop"  # JSON mode's texts too
        else:
            assert re.fullmatch(phone, c.message.content) and c.finish_reason == "stop", c.message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        **kw, seed=0, stream=True, extra_body={"guided_choice": choices}) if ch.choices)
    assert streamed == client.chat.completions.create(**kw, seed=0, extra_body={"guided_choice": choices}
                                                      ).choices[0].message.content
    schema = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}}, "required": ["label"]}
    c = client.chat.completions.create(**kw, seed=1, extra_body={"guided_json": schema}).choices[0]
    assert json.loads(c.message.content)["label"] in ("pos", "neg")
    done = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=1.0, seed=2,
                                     extra_body={"guided_regex": "(yes|no)\\."}).choices[0]
    assert done.text in ("yes.", "no.") and done.finish_reason == "stop"
    assert idle(served[0])


def test_a_grammar_holds_each_reply_gbnf_or_lark(served, client):
    """llama.cpp's grammar (GBNF), vLLM's structured_outputs.grammar and guided_grammar (Lark or GBNF): each reply
    is a sentence of the grammar, or the start of one where it ran out of tokens; on completions too."""
    from pathlib import Path

    from localpd.constrain.grammar import Reader, text_grammar

    grammars = Path(__file__).parent.parent / "constrain" / "grammars"
    asks = {"json": "Describe a cat as JSON.", "arithmetic": "Write two sums and their results.",
            "list": "List three fruits."}
    cases = [(name, text, ask, seed, body) for name, ask in asks.items()
             for text in [(grammars / f"{name}.gbnf").read_text()]
             for seed, body in enumerate(({"grammar": text}, {"structured_outputs": {"grammar": text}},
                                          {"guided_grammar": text}))]
    replies = at_once(lambda case: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": case[2]}], seed=case[3], temperature=1.0, max_tokens=48,
        extra_body=case[4]).choices[0], cases)
    for (name, text, _, _, _), c in zip(cases, replies):
        reader = Reader(text_grammar(text))
        assert reader.feed(c.message.content) and (reader.done or c.finish_reason == "length"), c.message.content
        if name == "json" and c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    done = client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"grammar": lark}}).choices[0]
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", done.text) and done.finish_reason == "stop"
    assert idle(served[0])


def test_continue_final_message_goes_on_with_the_assistants_start(served, client):
    """vLLM's continue_final_message: the prompt ends where the assistant's text does (the template's end of turn
    left off), so the reply is what a plain completion of that text gives; the content is the new text alone."""
    engine = served[0]
    start = "Sure! The capital of France is"
    messages = Q + [{"role": "assistant", "content": start}]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = engine.tokenizer.render_chat(messages, add_generation_prompt=False)
    prompt = text[:text.rindex(start) + len(start)]
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, add_bos=False))
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    assert r.choices[0].message.content == plain.choices[0].text and "Paris" in plain.choices[0].text
    bad = httpx.post(served[1].url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"messages": Q, "continue_final_message": True})
    assert bad.status_code == 400 and "last message from the assistant" in bad.json()["error"]["message"]


def test_a_union_of_models_parses_into_the_one_begun(client):
    """A list of Cat | Dog (anyOf two object schemas): each item holds to the model its first key chose, so the
    parse, which would raise on a cat with a dog's key or a cat's bounds broken, succeeds at any seed."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int = Field(ge=0, le=9)

    class Dog(BaseModel):
        kind: Literal["dog"]
        breed: str = Field(max_length=12)
        good: bool

    class Pets(BaseModel):
        pets: list[Cat | Dog] = Field(min_length=2, max_length=3)

    ask = [{"role": "user", "content": "List a cat and a dog as JSON, with the cat's lives and the dog's breed."}]
    kinds = set()
    for seed in range(16):  # every reply parses; seeds go on until both kinds have come (which seeds bring a dog
        t = client.chat.completions.parse(model=MODEL, messages=ask, response_format=Pets, temperature=1.0,
                                          seed=seed, max_tokens=128).choices[0]  # is the random stream's luck)
        assert t.finish_reason == "stop" and isinstance(t.message.parsed, Pets), t.message.content
        kinds |= {type(p) for p in t.message.parsed.pets}
        if kinds == {Cat, Dog}:
            break
    assert kinds == {Cat, Dog}


def test_json_object_mode_streamed_or_not(client):
    kw = dict(model=MODEL, messages=Q, temperature=0, max_tokens=64, response_format={"type": "json_object"})
    r = client.chat.completions.create(**kw)
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=64)
    with pytest.raises(json.JSONDecodeError):  # the model's own answer is prose
        json.loads(plain.choices[0].message.content)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="A JSON object with keys name and age for a 30 year old called "
                                  "Ann:", temperature=0.7, seed=3, max_tokens=64,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert json.loads(c.choices[0].text) == {"name": "Ann", "age": 30}


def test_tools_the_model_does_not_call_leave_a_plain_answer(served, client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=24)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    streamed = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == r.choices[0].message.content
    none = client.chat.completions.create(**{**kw, "tool_choice": "none"})
    assert none.usage.prompt_tokens == len(served[0].encode_chat(ASK)) < r.usage.prompt_tokens


def test_a_tool_result_reaches_the_model(served, client):
    engine = served[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 18 degrees Celsius."}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=24)
    expected = engine.encode_chat([{**m, "content": m["content"] or ""} for m in history], tools=[WEATHER])
    assert r.usage.prompt_tokens == len(expected)
    assert "18" in r.choices[0].message.content
    assert idle(engine)


# A template that opens the <think> block in the prompt, as the DeepSeek-R1 distills' do, and shows an earlier
# reply's reasoning as Qwen3's does.
OPEN_THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
              "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
              "<|im_start|>assistant\n<think>\n")


def test_a_thinking_models_reasoning_is_split_from_its_content(served, client, monkeypatch):
    engine = served[0]
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK)
    raw = "".join(ev.text for ev in engine.generate(engine.encode_chat(Q), SamplingParams(temperature=0,
                                                                                          max_tokens=12)))
    r = client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=12)
    message = r.choices[0].message  # cut off before </think>: all of it is reasoning
    assert message.reasoning_content == raw.strip() and message.content is None
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=Q, temperature=0, max_tokens=12,
                                                         stream=True) if c.choices]
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == raw.strip()
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    inline = LiveServer(create_app(engine, split_reasoning=False))
    try:
        plain = openai.OpenAI(base_url=inline.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=Q, temperature=0, max_tokens=12).choices[0].message
        assert plain.content == raw and getattr(plain, "reasoning_content", None) is None
    finally:
        inline.stop()
    history = Q + [{"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital."},
                   {"role": "user", "content": "And Spain?"}]
    again = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=1)
    assert again.usage.prompt_tokens == len(engine.encode_chat(history))
    assert "France's capital." in engine.tokenizer.decode(engine.encode_chat(history))


def test_json_mode_leaves_a_thinking_models_reasoning_free(served, client, monkeypatch):
    """response_format with a thinking model: the reasoning is the model's own, and the JSON is held to from
    </think> on, as vLLM's structured outputs with a reasoning parser do. The default model, inside a <think> block
    it never closes, ends its reply there; in JSON mode it may not, so it reasons on."""
    engine = served[0]
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK)
    kw = dict(model=MODEL, messages=Q, temperature=0, max_tokens=24)
    free = client.chat.completions.create(**kw).choices[0]
    held = client.chat.completions.create(**kw, response_format={"type": "json_object"}).choices[0]
    assert free.finish_reason == "stop" and free.message.content is None and held.finish_reason == "length"
    reasoning = free.message.reasoning_content
    assert held.message.reasoning_content.startswith(reasoning) and len(held.message.reasoning_content) > len(reasoning)
    assert not reasoning.startswith("{") and held.message.content is None


def test_n_choices_share_one_prefill_and_each_samples_its_own(served, client):
    """n > 1: choice i is what one request with seed + i gives, streamed or not; the prompt is counted once and its
    full pages are computed once, the other choices taking them from the prefix cache; no page is left behind."""
    engine = served[0]
    messages = [{"role": "user", "content": "Write a line about the number 837562243 and the sea, "
                                            "then one about the mountains."}]
    kw = dict(model=MODEL, messages=messages, temperature=1.0, max_tokens=12, seed=5)
    prompt = len(engine.encode_chat(messages))
    before = engine.stats().prefix_hit_tokens
    r = client.chat.completions.create(**kw, n=3)
    full_pages = (prompt - 1) // engine.pages.page_size * engine.pages.page_size
    first_hit = r.usage.prompt_tokens_details.cached_tokens  # the chat template's system prompt, from earlier tests
    assert engine.stats().prefix_hit_tokens - before == first_hit + 2 * full_pages and full_pages > first_hit
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1
    alone = [client.chat.completions.create(**{**kw, "seed": 5 + i}).choices[0] for i in range(3)]
    assert [c.message.content for c in r.choices] == [c.message.content for c in alone]
    assert r.usage.prompt_tokens == prompt and r.usage.completion_tokens == sum(
        len(engine.tokenizer.encode(c.message.content, add_bos=False)) for c in r.choices) > 12
    each = [c.model_extra["timings"] for c in r.choices]  # each choice's own; the response's is the first one's
    assert r.model_extra["timings"] == each[0] and all(t["ttft_ms"] > 0 and t["decode_tokens_per_s"] > 0 for t in each)
    texts, last = {0: "", 1: "", 2: ""}, None
    for c in client.chat.completions.create(**kw, n=3, stream=True, stream_options={"include_usage": True}):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
        last = c
    assert list(texts.values()) == [c.message.content for c in r.choices]
    assert last.usage.completion_tokens == r.usage.completion_tokens and len(last.model_extra["choice_timings"]) == 3
    assert last.model_extra["timings"] == last.model_extra["choice_timings"][0]
    greedy = client.completions.create(model=MODEL, prompt="The sea is", temperature=0, max_tokens=8, n=2)
    assert [c.index for c in greedy.choices] == [0, 1] and greedy.choices[0].text == greedy.choices[1].text
    assert idle(engine)


def test_completions_take_several_prompts_and_echo_them(served, client):
    """A list of prompts (texts or token ids) gets n choices each, indexed prompt by prompt, each what the prompt
    alone gives; echo puts the prompt before each choice's text, streamed or not; each prompt is counted once."""
    engine = served[0]
    prompts = ["The sea is", "Mountains are"]
    kw = dict(model=MODEL, temperature=0, max_tokens=6)
    alone = [client.completions.create(**kw, prompt=p).choices[0].text for p in prompts]
    r = client.completions.create(**kw, prompt=prompts, n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [p + a for p, a in zip(prompts, alone) for _ in range(2)]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    by_ids = client.completions.create(**kw, prompt=ids)
    assert [c.text for c in by_ids.choices] == alone
    texts = ["", "", "", ""]
    for c in client.completions.create(**kw, prompt=prompts, n=2, echo=True, stream=True):
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in r.choices]
    assert idle(engine)


def status_and_error(response):
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return response.status_code, body["error"]


@pytest.mark.parametrize("payload, status, fragment", [
    ({"messages": Q, "n": 17}, 400, "n: Input should be less than or equal to 16"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400,
     "text only; a 'image_url' content part"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": Q, "max_tokens": -5}, 400, "max_tokens"),
    ({"messages": Q, "max_tokens": 10**9}, 400, "context"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "context"),
    ({"messages": Q, "temperature": "hot"}, 400, "temperature"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": Q, "chat_template_kwargs": {"messages": []}}, 400, "set by localpd"),
    ({"messages": Q, "chat_template_kwargs": ["enable_thinking"]}, 400, "chat_template_kwargs"),
    ({"messages": Q, "chat_template_kwargs": {"tools": []}}, 400, "set by localpd"),
    ({"messages": Q, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "send_mail"}}},
     400, "not in tools"),
    ({"messages": Q, "tool_choice": "required"}, 400, "needs tools"),
    ({"messages": Q, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"messages": Q, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "json_schema"),
    ({"messages": Q, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}}}}, 400, "$defs"),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "tuple"}}}],
      "tool_choice": "required"}, 400, "unknown JSON schema type"),
    ({"messages": Q, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ({"messages": Q, "tools": [{"type": "code_interpreter"}]}, 400, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{city"}}]}]}, 400, "not valid JSON"),
    ({"messages": Q, "guided_regex": "(?=a)b"}, 400, "guided_regex: pattern '(?=a)b' uses lookaround"),
    ({"messages": Q, "guided_choice": []}, 400, "non-empty list"),
    ({"messages": Q, "guided_choice": ["a"], "guided_regex": "a"}, 400, "give one of guided_regex, guided_choice"),
    ({"messages": Q, "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, 400,
     "structured_outputs.regex cannot be combined"),
    ({"messages": Q, "structured_outputs": {"json": {"type": "tuple"}}}, 400, "unknown JSON schema type"),
    ({"messages": Q, "grammar": 'root ::= "a" missing'}, 400, "grammar: the GBNF grammar does not parse"),
    ({"messages": Q, "structured_outputs": {"grammar": 'root ::= "a" root'}}, 400, "admits no string"),
    ({"messages": Q, "guided_grammar": "start: /(?=a)b/"}, 400, "lookaround"),
    ({"messages": Q, "grammar": "root ::= [a-z]", "guided_regex": "a"}, 400, "give one of"),
    ({"messages": [{"role": "user"}]}, 400, "a user message needs content"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "a user message needs content"),
])
def test_bad_requests_get_openai_shaped_4xx(served, payload, status, fragment):
    r = httpx.post(served[1].url + "/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {KEY}"})
    code, err = status_and_error(r)
    assert code == status and fragment in err["message"]


@pytest.mark.parametrize("payload, fragment", [
    ({"prompt": []}, "the prompt is empty"),
    ({"prompt": ["a", ""]}, "the prompt is empty"),
    ({"prompt": ["a"] * 5, "n": 4}, "at most 16 choices in all"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo with logprobs"),
    ({"prompt": ["a", "word " * 2000]}, "context"),
    ({"prompt": [[1, 2], "a"]}, "prompt"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "b"}, "no fill-in-the-middle tokens"),
    ({"prompt": "a", "grammar": "start: missing"}, "unknown name"),
])
def test_bad_completion_requests_are_400s(served, payload, fragment):
    r = httpx.post(served[1].url + "/v1/completions", json={"max_tokens": 2, **payload},
                   headers={"Authorization": f"Bearer {KEY}"})
    status, error = status_and_error(r)
    assert status == 400 and fragment in error["message"], error
    assert idle(served[0])


def test_a_suffix_fills_in_the_middle_with_the_models_fim_tokens(served, client, monkeypatch):
    """suffix on /v1/completions: the prompt becomes prefix token, prompt, suffix token, suffix, middle token, and
    the reply is what the engine generates from exactly those tokens. SmolLM2 has no FIM tokens (a 400, see
    test_bad_completion_requests_are_400s), so three of its special tokens stand in for a code model's."""
    from localpd.text.tokenizer import Tokenizer

    engine = served[0]
    monkeypatch.setattr(Tokenizer, "fim_ids", property(lambda self: (3, 4, 5)))
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
    ids = [3, *engine.tokenizer.encode(prefix), 4, *engine.tokenizer.encode(suffix), 5]
    want = "".join(ev.text for ev in engine.generate(ids, SamplingParams(temperature=0, max_tokens=12)))
    r = client.completions.create(model=MODEL, prompt=prefix, suffix=suffix, temperature=0, max_tokens=12)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(ids)
    bad = httpx.post(served[1].url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"prompt": [1, 2], "suffix": "x"})
    assert bad.status_code == 400 and "suffix takes prompts as text" in bad.json()["error"]["message"]
    assert idle(engine)


def test_embeddings_are_the_engines_vectors_as_floats_or_base64(served, client):
    """/v1/embeddings through the openai client (which asks for base64 and decodes it) and as floats: each input's
    vector is the engine's (Engine.embedding), in order, unit length; token ids embed as their text does."""
    engine = served[0]
    texts = ["Paris is the capital of France.", "Bananas are yellow.", "Paris is the capital of France."]
    want = [engine.embedding(engine.tokenizer.encode(t)) for t in texts[:2]]
    r = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens == r.usage.total_tokens > 10
    for d, ref in zip(r.data, want + want[:1]):
        assert len(d.embedding) == engine.config.dim and max(abs(a - b) for a, b in zip(d.embedding, ref)) < 1e-5
    floats = httpx.post(served[1].url + "/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                        json={"input": engine.tokenizer.encode(texts[1]), "encoding_format": "float"}).json()
    assert max(abs(a - b) for a, b in zip(floats["data"][0]["embedding"], want[1])) < 1e-5
    assert idle(engine)


@pytest.mark.parametrize("payload, fragment", [
    ({"input": []}, "the input is empty"), ({"input": ["a", ""]}, "input 1 is empty"),
    ({"input": "word " * 2000}, "context"), ({"input": "a", "dimensions": 64}, "576 dimensions"),
    ({"input": [[1, 2], [10**9]]}, "vocabulary"), ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
])
def test_bad_embedding_requests_are_400s(served, payload, fragment):
    r = httpx.post(served[1].url + "/v1/embeddings", json=payload, headers={"Authorization": f"Bearer {KEY}"})
    status, error = status_and_error(r)
    assert status == 400 and fragment in error["message"], error
    assert idle(served[0])


def test_logit_bias_bans_and_forces_tokens(served, client):
    """OpenAI's logit_bias: -100 keeps a token out of the reply, +100 makes it the only one; ids outside the
    vocabulary and values outside [-100, 100] are 400s naming logit_bias."""
    tok = served[0].tokenizer
    kw = dict(model=MODEL, messages=Q, temperature=0, max_tokens=12)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    paris = tok.encode(" Paris", add_bos=False)
    assert len(paris) == 1 and " Paris" in plain
    banned = client.chat.completions.create(**kw, logit_bias={str(paris[0]): -100}).choices[0].message.content
    assert " Paris" not in banned and banned != plain
    word = tok.encode(" yes", add_bos=False)[0]
    forced = client.chat.completions.create(**{**kw, "max_tokens": 4}, logit_bias={str(word): 100})
    assert forced.choices[0].message.content == " yes" * 4
    for bias, fragment in (({"99999999": 1}, "outside the vocabulary"), ({"5": 200}, "less than or equal to 100")):
        r = httpx.post(served[1].url + "/v1/chat/completions", json={"messages": Q, "logit_bias": bias},
                       headers={"Authorization": f"Bearer {KEY}"})
        status, error = status_and_error(r)
        assert status == 400 and fragment in error["message"] and "logit_bias" in (error["param"] or error["message"])


def test_cors_lets_the_named_origins_call_from_a_browser(served):
    """serve --cors ORIGIN: a browser's preflight (which carries no API key) is answered for that origin, and its
    requests get the header that lets the page read the reply; another origin, or a server without --cors, gets
    no such header."""
    engine, plain = served
    page, stranger = "http://localhost:3000", "http://evil.example"
    live = LiveServer(create_app(engine, api_key=KEY, cors_origins=[page]))
    try:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = httpx.options(live.url + "/v1/chat/completions", headers={"Origin": page, **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == page
        assert httpx.options(live.url + "/v1/chat/completions",
                             headers={"Origin": stranger, **preflight}).status_code == 400
        body = {"messages": Q, "max_tokens": 2}
        auth = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(live.url + "/v1/chat/completions", json=body, headers={**auth, "Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert httpx.post(live.url + "/v1/chat/completions", json=body, headers={"Origin": page}).status_code == 401
        r = httpx.post(live.url + "/v1/chat/completions", json=body, headers={**auth, "Origin": stranger})
        assert "access-control-allow-origin" not in r.headers
    finally:
        live.stop()
    r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 2},
                   headers={"Authorization": f"Bearer {KEY}", "Origin": page})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_tokenize_and_detokenize(served, client):
    """/tokenize counts a prompt's tokens, or a conversation's in the chat template (what a chat request's usage
    counts), /detokenize turns ids back into text; /v1/models gives the context length."""
    engine, live = served
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "The sea is wide."
    t = httpx.post(live.url + "/tokenize", json={"prompt": text}, headers=auth).json()
    assert t["tokens"] == engine.tokenizer.encode(text) and t["count"] == len(t["tokens"])
    assert t["max_model_len"] == 1024
    d = httpx.post(live.url + "/detokenize", json={"tokens": t["tokens"]}, headers=auth).json()
    assert d["prompt"] == text
    chat = httpx.post(live.url + "/tokenize", json={"messages": Q}, headers=auth).json()
    usage = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=1).usage
    assert chat["tokens"] == engine.encode_chat(Q) and chat["count"] == usage.prompt_tokens
    assert client.models.list().data[0].model_extra["max_model_len"] == 1024
    for path, body, fragment in (("/tokenize", {}, "either prompt or messages"),
                                 ("/tokenize", {"prompt": "a", "messages": Q}, "either prompt or messages"),
                                 ("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
                                 ("/detokenize", {"tokens": "abc"}, "tokens")):
        status, error = status_and_error(httpx.post(live.url + path, json=body, headers=auth))
        assert status == 400 and fragment in error["message"], error


def test_stop_token_ids_and_min_tokens(served, client):
    """vLLM's stop_token_ids end the reply where the token comes, and min_tokens holds the end back until the
    reply has that many tokens; a token id outside the vocabulary, or min_tokens over max_tokens, is a 400 naming
    its field."""
    engine, live = served
    tok = engine.tokenizer
    kw = dict(model=MODEL, messages=Q, temperature=0, max_tokens=24)
    plain = client.chat.completions.create(**kw).choices[0]
    paris = tok.encode(" Paris", add_bos=False)[0]
    cut = client.chat.completions.create(**kw, extra_body={"stop_token_ids": [paris]}).choices[0]
    assert cut.finish_reason == "stop" and plain.message.content.startswith(cut.message.content)
    assert " Paris" in plain.message.content and " Paris" not in cut.message.content
    n = len(tok.encode(plain.message.content, add_bos=False))
    assert plain.finish_reason == "stop" and n < 20
    longer = client.chat.completions.create(**kw, extra_body={"min_tokens": n + 4}).choices[0]
    assert longer.message.content.startswith(plain.message.content)
    assert len(tok.encode(longer.message.content, add_bos=False)) >= n + 4
    auth = {"Authorization": f"Bearer {KEY}"}
    for extra, param in (({"stop_token_ids": [10**9]}, "stop_token_ids"), ({"min_tokens": 30}, "min_tokens")):
        r = httpx.post(live.url + "/v1/chat/completions", json={"messages": Q, "max_tokens": 24, **extra},
                       headers=auth)
        status, error = status_and_error(r)
        assert status == 400 and error["param"] == param, error


def test_speculative_n_max_bounds_a_requests_drafts(served):
    """llama.cpp server's per-request speculative.n_max: 0 turns a request's drafts off under a server that drafts
    (its timings report none); over the bound it is a 400 naming the field."""
    from localpd.engine.speculate import MAX_DRAFT, SpeculateConfig

    engine, live = served
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "the red fox jumps over the lazy dog and the red fox runs into the woods"
    body = {"messages": [{"role": "user", "content": f"Repeat exactly: {text}. {text}."}], "max_tokens": 24,
            "temperature": 0}
    plain = httpx.post(live.url + "/v1/chat/completions", json=body, headers=auth).json()
    # drafts wherever the text has a match (the repeated text: tests/engine/test_speculate_engine.py); a request
    # that drafted would count in /metrics' drafted tokens, which test_metrics_parse... holds at 0
    engine.set_speculate(SpeculateConfig("ngram", 8, adaptive=False))
    try:
        off = httpx.post(live.url + "/v1/chat/completions", json={**body, "speculative.n_max": 0}, headers=auth).json()
        r = httpx.post(live.url + "/v1/chat/completions", json={**body, "speculative.n_max": MAX_DRAFT + 1},
                       headers=auth)
    finally:
        engine.set_speculate(SpeculateConfig())
    assert "draft_tokens" not in off["timings"]
    assert off["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    status, error = status_and_error(r)
    assert status == 400 and "speculative.n_max" in error["message"], error


def test_transport_level_errors(served):
    url, auth = served[1].url, {"Authorization": f"Bearer {KEY}"}
    assert status_and_error(httpx.get(url + "/v1/models"))[0] == 401
    assert status_and_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}))[0] == 401
    assert httpx.get(url + "/health").status_code == 200  # no key needed
    assert status_and_error(httpx.get(url + "/v1/nothing", headers=auth))[0] == 404
    bad_json = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=auth)
    assert status_and_error(bad_json)[0] == 400
    not_utf8 = httpx.post(url + "/v1/chat/completions", content=b'{"messages": "\xff\xfe"}',
                          headers={**auth, "content-type": "application/json"})
    assert status_and_error(not_utf8)[0] == 400
    huge = httpx.post(url + "/v1/chat/completions", content=b" " * (11 * 2**20), headers=auth)
    assert status_and_error(huge)[0] == 413
    assert httpx.get(url + "/health").status_code == 200  # still serving


def test_a_model_is_retrieved_by_its_id(served, client):
    engine = served[0]
    m = client.models.retrieve(engine.name)
    assert m.id == engine.name and m.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-5")
    assert caught.value.body["code"] == "model_not_found" and "gpt-5" in caught.value.body["message"]


def test_bodies_whatever_their_content_type_seeds_of_any_size_and_lone_surrogates(served, client):
    """JSON is read as JSON without its Content-Type (what curl -d sends); a body that is not JSON is a 400; any
    integer seed is taken (reduced modulo 2^64, so 2^64 + 7 samples as 7); a lone surrogate is replaced, not a
    500."""
    url, auth = served[1].url, {"Authorization": f"Bearer {KEY}"}
    body = {"messages": Q, "temperature": 0, "max_tokens": 8}
    texts = []
    for content_type in (None, "application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        headers = {**auth, **({"Content-Type": content_type} if content_type else {})}
        r = httpx.post(url + "/v1/chat/completions", content=json.dumps(body), headers=headers)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert len(set(texts)) == 1
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(url + "/v1/chat/completions", content=b"messages=hi", headers={**auth, "Content-Type":
                                                                                        content_type})
        assert status_and_error(r)[0] == 400
    story = [{"role": "user", "content": "Tell me a story about a cat."}]
    seeded = [client.chat.completions.create(model=MODEL, messages=story, seed=seed, max_tokens=8)
              .choices[0].message.content for seed in (7, 2**64 + 7)]
    assert seeded[0] == seeded[1]
    for seed in (-1, -(2**80), 2**64):
        assert client.completions.create(model=MODEL, prompt="Once", seed=seed, max_tokens=2).choices[0].text
    for raw in (b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 2}',
                b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], "max_tokens": 2,'
                b' "stop": ["\\ud800"]}'):
        r = httpx.post(url + "/v1/chat/completions", content=raw, headers=auth)
        assert r.status_code == 200, r.text
    r = httpx.post(url + "/tokenize", content=b'{"prompt": "a\\ud800b"}', headers=auth)
    assert r.json()["tokens"] == served[0].tokenizer.encode("a\ufffdb")
    assert idle(served[0])


def test_sixteen_concurrent_streams_match_their_single_answers(served, client):
    engine, _ = served
    prompts = [[{"role": "user", "content": f"Name {n} animals."}] for n in range(2, 18)]
    alone = [client.chat.completions.create(model=MODEL, messages=p, temperature=0, max_tokens=12)
             .choices[0].message.content for p in prompts]
    results = [None] * len(prompts)

    def go(i):
        stream = client.chat.completions.create(model=MODEL, messages=prompts[i], temperature=0, max_tokens=12,
                                                stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
    assert idle(engine)


@pytest.mark.parametrize("n", [1, 3])
def test_a_dropped_stream_frees_its_pages(served, client, n):
    """A client that goes away mid-stream frees its pages, every choice's when it asked for n."""
    engine, live = served
    with httpx.stream("POST", live.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "Write a long essay about rivers."}],
                            "max_tokens": 500, "stream": True, "temperature": 0, "n": n}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6 * n:
                break  # the client goes away mid-stream
        assert engine.stats().running + engine.stats().waiting == n
    assert idle(engine)
    metrics = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert f'localpd_kv_pages_used{{model="{engine.name}"}} 0' in metrics
    assert "localpd_time_to_first_token_seconds_count" in metrics
    assert 'localpd_requests_total{finish_reason="cancelled",model="' in metrics and '"None"' not in metrics


def test_a_client_gone_during_a_write_cancels_its_choices(served):
    """A client that stops reading and then goes away leaves its stream waiting in a write (uvicorn's flow.drain(),
    which the disconnect releases), the stream's generator at a yield with more events queued; starlette cancels
    the wait and the response closes the generator, so every choice ends cancelled at once, not when the garbage
    collector (off here) finds the generator: test_a_dropped_stream_frees_its_pages[3] found 3 still running after
    15 s on CI's busy cores. Driven over ASGI, so that the disconnect comes in the write for certain."""
    engine, _ = served
    app, n = create_app(engine, api_key=KEY, bandwidth=10e9), 3
    body = json.dumps({"messages": [{"role": "user", "content": "Write a long essay about rivers."}],
                       "max_tokens": 500, "stream": True, "temperature": 0, "n": n}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
             "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
    handles, sent = [], []

    async def drop():
        gone, asked = asyncio.Event(), False

        async def receive():
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if gone.is_set():
                return  # as uvicorn: what is sent after the disconnect goes nowhere
            sent.append(message)
            if len(sent) == 8:  # the headers, each choice's role and first token: then the client stops reading
                handles.extend(app.state.service.running)
                written = sum(h.stats.output_tokens for h in handles)
                while (sum(h.stats.output_tokens for h in handles) < written + 3 * n  # events left unwritten
                       and not all(h.finished for h in handles)):
                    await asyncio.sleep(0.01)
                gone.set()

        await app(scope, receive, send)
        waited = time.monotonic()
        while not all(h.finished for h in handles) and time.monotonic() - waited < 15:
            await asyncio.sleep(0.01)

    gc.disable()
    try:
        asyncio.run(drop())
        reasons = [h.stats.finish_reason for h in handles]
    finally:
        gc.enable()
        for h in handles:
            h.cancel()  # a failure's requests, not left running into the next tests
    assert len(handles) == n and reasons == ["cancelled"] * n
    assert idle(engine)


def test_metrics_parse_and_are_labelled_by_model_and_finish_reason(served, client):
    """/metrics as prometheus_client writes it: requests counted by model and finish reason, TTFT a histogram, the
    engine's pages read as scraped."""
    from prometheus_client.parser import text_string_to_metric_families

    engine, live = served
    client.chat.completions.create(model=MODEL, messages=Q, max_tokens=2, temperature=0)
    text = httpx.get(live.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ended = [s for s in families["localpd_requests"].samples if s.name == "localpd_requests_total"]
    assert any(s.labels == {"finish_reason": "length", "model": engine.name} and s.value >= 1 for s in ended)
    assert families["localpd_time_to_first_token_seconds"].type == "histogram"
    assert families["localpd_kv_pages_total"].samples[0].value == engine.stats().kv_pages_total
    total = {f: sum(s.value for s in families[f].samples if s.name == f + "_total")
             for f in ("localpd_decode_steps", "localpd_decode_tokens", "localpd_draft_tokens")}
    assert total["localpd_decode_tokens"] >= total["localpd_decode_steps"] >= 1  # no drafts: one token a step
    assert total["localpd_draft_tokens"] == 0 and "localpd_draft_accepted_tokens" in families


def test_health_is_503_while_loading_then_200(default_gguf):
    gate = threading.Event()

    def slow_load():
        gate.wait(10)
        return Engine(default_gguf, device="cpu", max_context=256)

    pool = ModelPool([ServedModel("slow", slow_load)])
    live = LiveServer(create_app(pool))
    try:
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]] == ["slow"]  # listed already
        gate.set()
        for _ in range(200):
            if httpx.get(live.url + "/health").status_code == 200:
                break
            time.sleep(0.05)
        assert httpx.get(live.url + "/v1/models").json()["data"][0]["max_model_len"] == 256
    finally:
        live.stop()
        pool.close()


def test_a_full_waiting_queue_answers_503(served):
    engine, _ = served
    live = LiveServer(create_app(engine, max_waiting=0))  # every request finds the queue full
    try:
        r = httpx.post(live.url + "/v1/chat/completions", json={"messages": Q})
        code, err = status_and_error(r)
        assert code == 503 and err["code"] == "overloaded"
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        live.stop()


def test_chat_template_kwargs_reach_the_template(served, client, monkeypatch):
    """vLLM's chat_template_kwargs ({"enable_thinking": false} for Qwen3) are the template's variables."""
    from tests.engine.test_engine import THINKING_TEMPLATE

    engine = served[0]
    monkeypatch.setattr(engine.tokenizer, "chat_template", THINKING_TEMPLATE)
    off = {"enable_thinking": False}
    plain = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=1)
    direct = client.chat.completions.create(model=MODEL, messages=Q, max_tokens=1,
                                            extra_body={"chat_template_kwargs": off})
    assert plain.usage.prompt_tokens == len(engine.encode_chat(Q))
    assert direct.usage.prompt_tokens == len(engine.encode_chat(Q, template_vars=off)) > plain.usage.prompt_tokens
