"""A real localpd server on loopback for the API tests (test_server, test_ollama): the `served` fixture in
conftest.py starts one for the session, on the default model with an API key."""

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn

from localpd.load.registry import resolve_model

KEY = "test-key"
# the name the session's server serves the default model under: its file's stem, as for any model file
MODEL = Path(os.environ.get("LOCALPD_TEST_GGUF") or resolve_model("smollm2-135m", progress=False).path).stem


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def at_once(ask, cases) -> list:
    """ask(case) for every case, the requests sent together so that the engine batches them (one step's weight read
    serves them all, where one request at a time reads the weights once per token each); the replies in the cases'
    order. A seeded reply is the same alone or batched (test_server's n choices and sixteen streams hold that)."""
    cases = list(cases)
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(ask, cases))


def idle(engine) -> bool:
    """Whether the engine settles with nothing running or waiting and no KV page in use (none leaked), within 15 s
    (room for the engine's steps on CI's two cores, shared with the other test process). A dropped stream's
    requests are cancelled as the disconnect comes; where test_a_dropped_stream_frees_its_pages[3] found them still
    running, its generator had been left open in a write (localpd.api.service.ClosingStream)."""
    for _ in range(1500):
        s = engine.stats()
        if s.running == 0 and s.waiting == 0 and s.kv_pages_used == 0:
            return True
        time.sleep(0.01)
    print(f"not idle after 15 s: {s}")  # shown with the failure: what was still running, waiting or held
    return False
