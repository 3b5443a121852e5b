import functools

import httpx
import pytest


@pytest.fixture(autouse=True)
def patient_requests(monkeypatch):
    """The API tests' plain httpx calls wait up to 60 s for an answer where they name no timeout: httpx's default of
    5 s timed out once on the 2-core VM while other suites loaded it (a request queued behind a busy engine), a
    failure of the machine's load, not of the server. A call that names its own timeout keeps it."""
    for name in ("get", "post", "options", "put", "delete", "stream"):
        monkeypatch.setattr(httpx, name, functools.partial(getattr(httpx, name), timeout=60))


@pytest.fixture(scope="session")
def served(default_gguf):
    """(engine, LiveServer): the default model served on loopback with the API key live_server.KEY, one server for
    the whole session: the API modules share it rather than each loading the model again."""
    from live_server import KEY, LiveServer

    from localpd.engine import Engine
    from localpd.api.app import create_app

    # the reference path, as the engine fixture: the API tests hold batched requests to lone ones token for token,
    # which the CPU's native path keeps only to ~1e-3 in the logits (a prefill of 16 rows or more multiplies in
    # float32, fewer rows in int32; tests/model/test_cpu_fidelity.py)
    engine = Engine(default_gguf, device="cpu", max_context=1024, quant="fp32")
    live = LiveServer(create_app(engine, api_key=KEY, bandwidth=10e9))
    yield engine, live
    live.stop()
    engine.close()
