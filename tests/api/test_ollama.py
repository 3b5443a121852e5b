"""`localpd serve`'s Ollama API through the official ollama client against a live server, real default model."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import pytest
from live_server import KEY, MODEL, LiveServer, at_once, idle

from localpd.engine.sampling import SamplingParams
from localpd.api.app import create_app

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def client(served):
    return ollama.Client(host=served[1].url, headers={"Authorization": f"Bearer {KEY}"})


def test_chat_answers_as_the_engine_does_streamed_or_not(served, client):
    engine = served[0]
    alone = "".join(ev.text for ev in engine.chat(ASK, SamplingParams(temperature=0, max_tokens=16)))
    r = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert r.message.role == "assistant" and r.message.content == alone and "Paris" in alone
    assert r.done and r.done_reason in ("stop", "length") and r.eval_count >= 2
    assert r.prompt_eval_count == len(engine.encode_chat(ASK))  # the cached tokens too, as Ollama counts them
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0
    raw = httpx.post(served[1].url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": MODEL, "messages": ASK, "options": GREEDY, "stream": False}).json()
    assert raw["message"]["content"] == alone and raw["timings"]["decode_bytes_per_s"] > 0  # localpd's own numbers
    assert raw["prompt_eval_count"] == r.prompt_eval_count  # served from the prefix cache this time
    parts = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == alone
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count == r.eval_count
    assert idle(engine)


def test_generate_applies_the_template_unless_raw_and_options_reach_the_sampler(served, client):
    engine = served[0]
    r = client.generate(model=MODEL, prompt="What is the capital of France?", options=GREEDY)
    assert "Paris" in r.response and r.done
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 3})
    assert raw.eval_count == 3 and raw.done_reason == "length"
    want = "".join(ev.text for ev in engine.generate(engine.tokenizer.encode("The capital of France is"),
                                                    SamplingParams(temperature=0, max_tokens=3)))
    assert raw.response == want
    stopped = client.generate(model=MODEL, prompt="Count: 1, 2, 3,", raw=True,
                              options={"temperature": 0, "num_predict": 24, "stop": [" 6"]})
    assert " 6" not in stopped.response and "5" in stopped.response and stopped.done_reason == "stop"
    seeded = [client.generate(model=MODEL, prompt="Name a colour.", options={"seed": 7, "num_predict": 8}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert client.generate(model=MODEL, prompt="").done_reason == "load"  # Ollama's way to preload a model
    plain = client.generate(model=MODEL, prompt="The capital of France is", raw=True, format="",
                            options={"temperature": 0, "num_predict": 3})  # "": no format, as clients send it
    assert plain.response == want


def test_a_final_assistant_message_is_continued(served, client):
    """As Ollama does: a conversation that ends with the assistant's words gets their continuation."""
    start = "Sure! The capital of France is"
    r = client.chat(model=MODEL, messages=ASK + [{"role": "assistant", "content": start}],
                    options={"temperature": 0, "num_predict": 6})
    engine = served[0]
    text = engine.tokenizer.render_chat(ASK + [{"role": "assistant", "content": start}], add_generation_prompt=False)
    prompt = engine.tokenizer.encode(text[:text.rindex(start) + len(start)], add_bos=False)
    want = "".join(ev.text for ev in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=6)))
    assert r.message.content == want and "Paris" in want


def test_format_holds_the_reply_to_json_or_a_schema(client):
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                    format="json", options={"temperature": 0, "num_predict": 64})
    assert isinstance(json.loads(r.message.content), dict)
    # bounded strings: sampled at temperature 1, an unbounded one can outrun num_predict (seen once in CI)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"]}
    for r in at_once(lambda seed: client.chat(model=MODEL, messages=ASK, format=schema,
                                              options={"temperature": 1, "seed": seed, "num_predict": 64}), range(2)):
        assert set(json.loads(r.message.content)) == {"city", "country"}


def test_tools_come_back_as_calls_with_object_arguments(served, client):
    """Earlier calls (arguments as objects) and results (role tool, tool_name) go into the template; a call the
    reply makes comes back in message.tool_calls with its arguments as an object, streamed or not."""
    engine = served[0]
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                "parameters": {"type": "object", "required": ["city"],
                                                               "properties": {"city": {"type": "string"}}}}}
    history = []
    for city, report in (("London", "12 C and rain"), ("Rome", "25 C and sun")):  # two turns the model imitates
        history += [{"role": "user", "content": f"What is the weather in {city}?"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": city}}}]},
                    {"role": "tool", "content": report, "tool_name": "get_weather"},
                    {"role": "assistant", "content": f"It is {report} in {city}."}]
    ask = history + [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {"temperature": 1, "top_p": 1, "top_k": 0, "num_predict": 40}

    def reply(seed):
        return client.chat(model=MODEL, messages=ask, tools=[weather], options={**options, "seed": seed})

    calls = []
    # eight seeds at a time, which the engine batches (a seeded reply is the same alone or batched: test_server's n
    # choices hold that), read in seed order as one at a time. At temperature 1 the small model calls the tool at
    # about one seed in ten (7 of 80), not always well: the first right call will do
    pool = ThreadPoolExecutor(8)
    for seed, r in zip(range(64), pool.map(reply, range(64))):
        calls += [(seed, r)] if r.message.tool_calls else []
        if any(c.function.name == "get_weather" and c.function.arguments == {"city": "Paris"}
               for c in r.message.tool_calls or []):
            break
    pool.shutdown(cancel_futures=True)  # the later seeds are not asked
    assert calls, "no seed made a call"
    assert all(isinstance(c.function.arguments, dict) for _, r in calls for c in r.message.tool_calls)
    seed, r = calls[-1]
    [call] = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert not r.message.content and r.done
    parts = list(client.chat(model=MODEL, messages=ask, tools=[weather], options={**options, "seed": seed},
                             stream=True))
    assert [c.function for p in parts for c in p.message.tool_calls or []] == [call.function]
    assert "".join(p.message.content for p in parts) == ""
    assert idle(engine)


def test_listing_showing_and_version(served, client, default_gguf):
    engine = served[0]
    [m] = client.list().models
    assert m.model == engine.name and m.size == default_gguf.stat().st_size and m.details.family == "llama"
    assert m.details.parameter_size == "134M"  # SmolLM2-135M's matrices, its tied head counted once
    shown = client.show(engine.name)
    assert shown.modelinfo["llama.context_length"] == 1024 and "completion" in shown.capabilities
    assert client.ps().models[0].model == engine.name
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(served[1].url + "/api/version", headers=headers).json()["version"]
    root = httpx.get(served[1].url + "/")  # what clients probe to see a server is up: no key needed, as /health
    assert root.status_code == 200 and "running" in root.text
    assert client.pull(engine.name).status == "success"  # scripts pull before they chat: it is here already
    assert [p.status for p in client.pull(engine.name + ":latest", stream=True)] == ["success"]
    with pytest.raises(ollama.ResponseError, match="not found in localpd's registry") as e:
        client.pull("llama3.2")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="is loaded") as e:  # Ollama's clients delete what they pulled
        client.delete(engine.name)
    assert e.value.status_code == 400 and client.list().models[0].model == engine.name


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}, 400, "temperature"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "options": {"top_p": 7}}, 400, "top_p"),
    ("/api/chat", {"model": MODEL, "messages": ASK, "format": {"type": "tuple"}}, 400, "JSON schema type"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "context": [1, 2]}, 400, "/api/chat"),
    ("/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "no fill-in-the-middle tokens"),
    ("/api/generate", {"model": MODEL, "prompt": "word " * 2000}, 400, "context is 1024 tokens"),
    ("/api/embed", {"model": MODEL, "input": ["hi", ""]}, 400, "empty"),
    ("/api/embed", {"model": MODEL, "input": "word " * 2000, "truncate": False}, 400, "truncate"),
    ("/api/embed", {"model": MODEL, "input": "hi", "dimensions": 8}, 400, "576 dimensions"),
    ("/api/nothing", {}, 404, "Not Found"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "needs content"),
])
def test_bad_requests_get_ollamas_error_shape(served, path, body, status, fragment):
    r = httpx.post(served[1].url + path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status and set(r.json()) == {"error"} and fragment in r.json()["error"], r.text
    assert idle(served[0])


def test_generate_with_a_suffix_fills_in_the_middle(served, client, monkeypatch):
    """Ollama's suffix (what editors' code completion sends): the model's FIM tokens around prompt and suffix, no
    template; three of SmolLM2's special tokens stand in for a code model's (SmolLM2 has none: a 400)."""
    from localpd.text.tokenizer import Tokenizer

    engine = served[0]
    monkeypatch.setattr(Tokenizer, "fim_ids", property(lambda self: (3, 4, 5)))
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
    ids = [3, *engine.tokenizer.encode(prefix), 4, *engine.tokenizer.encode(suffix), 5]
    want = "".join(ev.text for ev in engine.generate(ids, SamplingParams(temperature=0, max_tokens=12)))
    r = client.generate(model=MODEL, prompt=prefix, suffix=suffix, options={"temperature": 0, "num_predict": 12})
    assert r.response == want and r.prompt_eval_count == len(ids)
    assert idle(engine)


def test_embed_gives_the_engines_vectors_and_truncates_a_long_input(served, client):
    """/api/embed: one vector per input, the engine's (Engine.embedding), unit length; an input past the context
    keeps its start (truncate, Ollama's default); /api/embeddings, the older endpoint, one prompt's vector."""
    engine = served[0]
    texts = ["Paris is the capital of France.", "The cat sat on the mat."]
    want = [engine.embedding(engine.tokenizer.encode(t)) for t in texts]
    r = client.embed(model=MODEL, input=texts)
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == engine.config.dim
    for got, ref in zip(r.embeddings, want):
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5
    assert r.prompt_eval_count == sum(len(engine.tokenizer.encode(t)) for t in texts) and r.total_duration > 0
    alone = client.embed(model=MODEL, input=texts[0]).embeddings[0]  # a step of its own: other GEMM shapes
    assert max(abs(a - b) for a, b in zip(alone, r.embeddings[0])) < 1e-5
    long = "word " * 2000
    start = engine.tokenizer.encode(long)[:engine.max_context - 1]
    got = client.embed(model=MODEL, input=long).embeddings[0]
    assert max(abs(a - b) for a, b in zip(got, engine.embedding(start))) < 1e-5
    legacy = client.embeddings(model=MODEL, prompt=texts[1]).embedding
    assert max(abs(a - b) for a, b in zip(legacy, r.embeddings[1])) < 1e-5
    assert client.embeddings(model=MODEL, prompt="").embedding == []
    assert idle(engine)


def test_a_client_that_goes_away_mid_stream_frees_its_pages(served):
    engine = served[0]
    with httpx.stream("POST", served[1].url + "/api/chat", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": ASK, "options": {"num_predict": 400}}) as r:
        first = json.loads(next(r.iter_lines()))
        assert first["done"] is False
    assert idle(engine)


def test_a_thinking_models_reasoning_comes_back_as_thinking(served, client, monkeypatch):
    """Ollama's `thinking`: the <think> block the template opens is the reply's reasoning, streamed or not, and an
    earlier reply's thinking goes back into the template."""
    from test_server import OPEN_THINK

    engine = served[0]
    monkeypatch.setattr(engine.tokenizer, "chat_template", OPEN_THINK)
    raw = "".join(ev.text for ev in engine.chat(ASK, SamplingParams(temperature=0, max_tokens=12)))
    r = client.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 12})
    assert r.message.thinking == raw.strip() and r.message.content == ""  # cut off before </think>
    parts = list(client.chat(model=MODEL, messages=ASK, options={"temperature": 0, "num_predict": 12}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == raw.strip()
    g = client.generate(model=MODEL, prompt=ASK[0]["content"], options={"temperature": 0, "num_predict": 12})
    assert g.thinking == raw.strip() and g.response == ""
    from localpd.api.ollama import OllamaMessage, template_message

    history = ASK + [{"role": "assistant", "content": "Paris.", "thinking": "France's capital."},
                     {"role": "user", "content": "And Spain?"}]
    assert client.chat(model=MODEL, messages=history, options={"temperature": 0, "num_predict": 1}).done
    ids = engine.encode_chat([template_message(OllamaMessage(**m)) for m in history])
    assert "<think>France's capital.</think>Paris." in engine.tokenizer.decode(ids)


def test_a_missing_key_is_a_401_in_ollamas_shape(served):
    r = httpx.post(served[1].url + "/api/chat", json={"model": MODEL, "messages": ASK})
    assert r.status_code == 401 and "API key" in r.json()["error"]


def test_a_full_queue_is_a_503_in_ollamas_shape(served):
    busy = LiveServer(create_app(served[0], max_waiting=0))
    try:
        r = httpx.post(busy.url + "/api/generate", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and "busy" in r.json()["error"]
    finally:
        busy.stop()


def test_bodies_without_a_json_content_type_odd_seeds_and_lone_surrogates_are_answered(served):
    """What `curl -d` and litellm's ollama providers send: JSON labelled as a form or not at all; seeds past 64
    bits or negative (random); a string cut inside an emoji (a lone surrogate, replaced)."""
    url, auth = served[1].url, {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": ASK, "options": GREEDY, "stream": False}
    answers = []
    for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
        headers = {**auth, **({"Content-Type": content_type} if content_type else {})}
        r = httpx.post(url + "/api/chat", content=json.dumps(body), headers=headers)
        assert r.status_code == 200, r.text
        answers.append(r.json()["message"]["content"])
    assert len(set(answers)) == 1 and "Paris" in answers[0]
    r = httpx.post(url + "/api/chat", content=b"model=x&prompt=hi", headers=auth)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(url + "/api/generate", content=b'{"prompt": "hi", "options": {"seed": 1e400}}', headers=auth)
    assert r.status_code == 400 and "option seed must be a number" in r.json()["error"]
    for seed in (2**64 + 5, -1, -(2**70)):
        r = httpx.post(url + "/api/generate", headers=auth, json={
            "model": MODEL, "prompt": "hi", "stream": False, "options": {"seed": seed, "num_predict": 2}})
        assert r.status_code == 200, r.text
    cut = httpx.post(url + "/api/generate", headers=auth, content=b'{"prompt": "smile \\ud83d", "stream": false, '
                     b'"options": {"num_predict": 2}, "system": "\\udc00"}')
    assert cut.status_code == 200 and cut.json()["done"], cut.text
    assert idle(served[0])


@pytest.fixture(scope="module")
def litellm():
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    import litellm

    return litellm


@pytest.mark.parametrize("provider", ["ollama", "ollama_chat"])
def test_litellms_ollama_providers_chat_and_stream(served, litellm, provider):
    """litellm's providers send their JSON without a Content-Type; ollama/ goes through /api/generate,
    ollama_chat/ through /api/chat."""
    kw = dict(model=f"{provider}/{MODEL}", api_base=served[1].url, extra_headers={"Authorization": f"Bearer {KEY}"},
              temperature=0, max_tokens=16)
    r = litellm.completion(messages=ASK, **kw)
    assert "Paris" in r.choices[0].message.content
    chunks = litellm.completion(messages=ASK, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert idle(served[0])



WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def asked_weather(cities: list[str], results: bool) -> list[dict]:
    """Turns in OpenAI's shape (what litellm takes) where the user asks a city's weather and the assistant calls."""
    turns = []
    for i, city in enumerate(cities):
        turns += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                      "name": "get_weather", "arguments": json.dumps({"city": city})}}]}]
        turns += [{"role": "tool", "tool_call_id": f"c{i}", "content": "12 C and rain"},
                  {"role": "assistant", "content": f"It is 12 C and rain in {city}."}] if results else []
    return turns + [{"role": "user", "content": "What is the weather in Paris?"}]


def test_litellms_ollama_providers_call_tools(served, litellm):
    """ollama_chat/ sends tools, earlier calls (arguments turned into objects) and results to /api/chat, which the
    template reads as the same conversation in OpenAI's shape, and reads a call back from message.tool_calls;
    ollama/ writes its own tool prompt to /api/generate in JSON mode and reads a call from the JSON reply. Greedy:
    the small model, shown calls for three cities, calls for the fourth."""
    engine = served[0]
    kw = dict(api_base=served[1].url, extra_headers={"Authorization": f"Bearer {KEY}"}, tools=[WEATHER],
              temperature=0, max_tokens=40)
    r = litellm.completion(model=f"ollama_chat/{MODEL}", messages=asked_weather(["London", "Rome", "Oslo"], False),
                           **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls"
    conversation = asked_weather(["London", "Rome"], True)
    r = litellm.completion(model=f"ollama_chat/{MODEL}", messages=conversation, **kw)
    assert r.usage.prompt_tokens == len(engine.encode_chat(conversation, tools=[WEATHER]))
    r = litellm.completion(model=f"ollama/{MODEL}", messages=conversation, **kw)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert idle(engine)
