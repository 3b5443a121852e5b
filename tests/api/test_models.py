"""Several models behind one server, as `localpd serve A B C` serves them (localpd.api.models): the default model,
a Q8_0 copy of it that llama.cpp's llama-quantize makes, and a corrupt file. Each request goes to the model it names;
the first loads at start, the others on their first request, and idle ones unload by keep_alive or for room."""

import shutil
import subprocess
import time

import httpx
import ollama
import openai
import pytest
from live_server import KEY, LiveServer, idle

from localpd.api.app import create_app
from localpd.cli.main import build_parser
from localpd.cli.serve import model_pool
from localpd.engine.sampling import SamplingParams

ASKS = ["Write a haiku about a rusty bicycle.", "Name three uses of copper."]
TOKENS = 16


@pytest.fixture(scope="module")
def pool_server(default_gguf, llama_quantize, tmp_path_factory):
    """(pool, LiveServer): the default model (as the session's one-model server runs it: fp32, 1024 tokens), a Q8_0
    copy of it, and a corrupt file, each kept loaded once loaded (--keep-alive -1)."""
    folder = tmp_path_factory.mktemp("models")
    q8 = folder / "smol-q8.gguf"
    made = subprocess.run([str(llama_quantize), "--allow-requantize", str(default_gguf), str(q8), "Q8_0"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    broken = folder / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    args = build_parser().parse_args(["serve", str(default_gguf), str(q8), str(broken), "--device", "cpu",
                                      "--ctx", "1024", "--quant", "fp32", "--keep-alive", "-1"])
    pool = model_pool(args)
    live = LiveServer(create_app(pool, bandwidth=10e9))
    pool.load_now().result(timeout=300)  # the first model, as the server started it
    yield pool, live
    live.stop()
    pool.close()


def loaded(live) -> list[str]:
    return [m["name"] for m in httpx.get(live.url + "/api/ps").json()["models"]]


def test_requests_alternating_between_two_models_get_each_ones_own_reply(pool_server, served, default_gguf):
    """The openai and the ollama clients, alternating between the models: the default model's replies are the
    one-model server's (the session's), the Q8_0 copy's its own engine's, and the two differ."""
    pool, live = pool_server
    a, b = default_gguf.stem, "smol-q8"
    assert [m.id for m in openai.OpenAI(base_url=live.url + "/v1", api_key="-").models.list().data] == \
        [a, b, "broken"]
    oa = openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0)
    ol = ollama.Client(host=live.url)
    alone = openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0)
    got = {}
    for ask in ASKS:
        messages = [{"role": "user", "content": ask}]
        for model in (a, b, a, b):
            via_openai = oa.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=TOKENS)
            assert via_openai.model == model
            via_ollama = ol.chat(model=model, messages=messages, options={"temperature": 0, "num_predict": TOKENS})
            assert via_ollama.model == model and via_ollama.message.content == via_openai.choices[0].message.content
            got.setdefault((model, ask), set()).add(via_ollama.message.content)
    for ask in ASKS:
        messages = [{"role": "user", "content": ask}]
        one = alone.chat.completions.create(model=served[0].name, messages=messages, temperature=0,
                                            max_tokens=TOKENS)
        assert got[a, ask] == {one.choices[0].message.content}
        own = "".join(ev.text for ev in pool.models[b].engine.chat(messages, SamplingParams(temperature=0,
                                                                                               max_tokens=TOKENS)))
        assert got[b, ask] == {own}
    assert any(got[a, ask] != got[b, ask] for ask in ASKS)  # else the routing could not be told from the answers
    ps = httpx.get(live.url + "/api/ps").json()["models"]
    assert [m["name"] for m in ps] == [a, b]
    assert all(m["size"] > 100e6 and m["expires_at"].startswith("2318") and m["context_length"] == 1024 for m in ps)
    tags = httpx.get(live.url + "/api/tags").json()["models"]
    assert [m["name"] for m in tags] == [a, b, "broken"] and tags[0]["size"] == default_gguf.stat().st_size
    metrics = httpx.get(live.url + "/metrics").text
    assert f'localpd_kv_pages_total{{model="{b}"}}' in metrics and f'localpd_kv_pages_total{{model="{a}"}}' in metrics
    assert all(idle(m.engine) for m in pool.loaded())


def test_an_unserved_model_is_a_404_in_each_apis_shape(pool_server):
    _, live = pool_server
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "no-such-model", "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "no-such-model" in r.json()["error"]["message"]
    assert httpx.get(live.url + "/v1/models/no-such-model").json()["error"]["code"] == "model_not_found"
    r = httpx.post(live.url + "/api/chat", json={"model": "no-such-model", "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json() == {"error": r.json()["error"]}
    assert r.json()["error"].startswith("model 'no-such-model' not found")
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=live.url).generate(model="no-such-model", prompt="hi")
    assert e.value.status_code == 404


def test_a_corrupt_model_fails_its_request_and_the_others_are_served(pool_server, default_gguf):
    _, live = pool_server
    r = httpx.post(live.url + "/v1/completions", json={"model": "broken", "prompt": "hi", "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 500 and "'broken' failed to load" in r.json()["error"]["message"]
    r = httpx.post(live.url + "/api/generate", json={"model": "broken", "prompt": "hi", "stream": False}, timeout=120)
    assert r.status_code == 500 and "'broken' failed to load" in r.json()["error"]
    assert httpx.get(live.url + "/health").status_code == 200
    r = httpx.post(live.url + "/v1/completions", json={"model": default_gguf.stem, "prompt": "hi", "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert "broken" not in loaded(live)


def test_keep_alive_0_unloads_and_one_that_is_not_a_duration_is_a_400(pool_server):
    pool, live = pool_server
    client = ollama.Client(host=live.url)
    client.generate(model="smol-q8", prompt="hi", options={"num_predict": 2}, keep_alive="10m")  # loaded, if not
    engine = pool.models["smol-q8"].engine
    assert "smol-q8" in loaded(live)
    for bad in ("soon", "5 minutes", True):
        r = httpx.post(live.url + "/api/generate", json={"model": "smol-q8", "prompt": "hi", "keep_alive": bad})
        assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    r = client.generate(model="smol-q8", prompt="hi", options={"num_predict": 2}, keep_alive=0)
    assert r.done and "smol-q8" not in loaded(live)  # gone as the response ends
    for _ in range(500):  # and its engine closed on the unload thread
        if not engine._thread.is_alive():
            break
        time.sleep(0.01)
    assert not engine._thread.is_alive()


def test_deleting_a_loaded_model_or_a_file_given_to_the_server_is_a_400(pool_server, default_gguf):
    _, live = pool_server
    for name, status, fragment in ((default_gguf.stem, 400, "is loaded"), ("broken", 400, "given to the server"),
                                   ("no-such-model", 404, "not found")):
        r = httpx.request("DELETE", live.url + "/api/delete", json={"model": name})
        assert r.status_code == status and fragment in r.json()["error"]
    assert default_gguf.exists() and default_gguf.stem in loaded(live)


def test_a_pulled_registry_model_is_served_and_deleted(pool_server, default_gguf, tmp_path, monkeypatch):
    """A registry model on disk (a copy of the default model where its PyPI source lands, in a LOCALPD_HOME of the
    test's own) pulled: Ollama's status lines, then served; deleted: its file gone, no longer served."""
    from localpd.load.registry import load_registry, parse_source

    pool, live = pool_server
    monkeypatch.setenv("LOCALPD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # the hub's copy, if this machine has one, unseen
    source = next(s for s in load_registry()[1]["smollm2-135m"].sources if s.startswith("pypi:"))
    _, package, version, member = parse_source(source)
    dest = tmp_path / "home" / "models" / f"{package}-{version}" / member.split("/")[-1]
    dest.parent.mkdir(parents=True)
    shutil.copy(default_gguf, dest)
    client = ollama.Client(host=live.url)
    statuses = [p.status for p in client.pull("smollm2-135m", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "smollm2-135m" in [m.model for m in client.list().models]
    client.delete("smollm2-135m")
    assert not dest.exists() and "smollm2-135m" not in [m.model for m in client.list().models]
    assert "smollm2-135m" not in pool.models


def test_a_model_past_the_memory_budget_unloads_the_idle_one_and_waits_for_a_busy_one(pool_server, default_gguf):
    """--memory for one model: loading the other unloads the least recently used idle one; while the loaded one runs
    a request, a request for the other gets a 503 after fit_timeout."""
    pool, live = pool_server
    a, b = default_gguf.stem, "smol-q8"
    saved = pool.memory, pool.fit_timeout
    pool.memory, pool.fit_timeout = max(pool.models[a].size, pool.models[b].size) + 1, 1.0
    if b in loaded(live):  # Ollama's way to unload a model
        httpx.post(live.url + "/api/generate", json={"model": b, "keep_alive": 0})
    try:
        oa = openai.OpenAI(base_url=live.url + "/v1", api_key="-", max_retries=0)
        oa.completions.create(model=a, prompt="hi", max_tokens=2)
        r = oa.completions.create(model=b, prompt="hi", max_tokens=2)
        assert r.model == b and loaded(live) == [b]
        with httpx.stream("POST", live.url + "/v1/completions", json={
                "model": b, "prompt": "Rivers", "max_tokens": 300, "min_tokens": 300, "stream": True}) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # b is running a request
            start = time.monotonic()
            r = httpx.post(live.url + "/api/generate", json={"model": a, "prompt": "hi"}, timeout=60)
            assert r.status_code == 503 and "no room to load" in r.json()["error"]
            assert time.monotonic() - start >= 1.0 and loaded(live) == [b]
    finally:
        pool.memory, pool.fit_timeout = saved
