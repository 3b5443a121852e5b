import pytest


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
