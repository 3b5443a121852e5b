"""`localpd serve` stopped with requests running, as docker and systemd stop it: SIGTERM (or a first Ctrl+C) lets
them run --shutdown-timeout seconds, then ends each with a proper final event and the process exits non-zero; a
second signal exits at once. A real server process on the default model."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

GRACE = 1.0


def start(default_gguf, grace: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "localpd.cli", "serve", str(default_gguf), "--port", str(port),
                             "--ctx", "4096", "--shutdown-timeout", str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not come up")


class Stream(threading.Thread):
    """A long streamed reply read line by line until the server ends it; `started` once its tokens flow (past
    the prefill, which a step of the engine does not stop in)."""

    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.lines: list[str] = []
        self.started, self.error = threading.Event(), None

    def run(self):
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        if len(self.lines) == 4:
                            self.started.set()
        except Exception as e:  # noqa: BLE001 - what the test asserts did not happen
            self.error = e
        self.started.set()


LONG = [{"role": "user", "content": "Write a very long essay about rivers."}]


def test_sigterm_cuts_running_streams_after_the_grace_with_a_final_event(default_gguf):
    """Four streams of 2000 tokens, one in each API's shape (issue 34's case): gone within the grace plus 2 s, each
    stream ended by its API's own final event."""
    proc, url = start(default_gguf, GRACE)
    try:
        streams = [Stream(url, "/v1/chat/completions", {"messages": LONG, "max_tokens": 2000, "min_tokens": 2000,
                                                        "stream": True, "stream_options": {"include_usage": True}}),
                   Stream(url, "/v1/completions", {"prompt": "Rivers", "max_tokens": 2000, "min_tokens": 2000,
                                                   "stream": True}),
                   Stream(url, "/api/chat", {"model": default_gguf.stem, "messages": LONG,  # greedy: 2700 words
                                              "options": {"num_predict": 2000, "temperature": 0}}),
                   Stream(url, "/v1/responses", {"model": default_gguf.stem, "input": LONG[0]["content"],
                                                 "max_output_tokens": 2000, "temperature": 0, "stream": True}),
                   Stream(url, "/v1/messages", {"model": default_gguf.stem, "messages": LONG, "max_tokens": 2000,
                                                "temperature": 0, "stream": True})]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(60) and s.error is None, s.error
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no longer listening
            httpx.post(url + "/v1/chat/completions", json={"messages": LONG, "max_tokens": 2})
        proc.wait(timeout=GRACE + 10)
        gone = time.monotonic() - signalled
        for s in streams:
            s.join(5)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert gone < GRACE + 2, (gone, err[-3000:].splitlines())
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert "cut 5 running requests" in err
    assert all(s.error is None and not s.is_alive() for s in streams), [s.error for s in streams]
    for s in streams[:2]:  # OpenAI's: the choice's finish_reason, the usage, [DONE]
        assert s.lines[-1] == "data: [DONE]", s.lines[-3:]
        chunks = [json.loads(line.removeprefix("data: ")) for line in s.lines[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"
    assert streams[0].lines[-2].count('"usage"') == 1
    last = json.loads(streams[2].lines[-1])  # Ollama's: a last line with done_reason
    assert last["done"] is True and last["done_reason"] == "abort" and last["eval_count"] > 1
    events = [json.loads(line.removeprefix("data: ")) for line in streams[3].lines if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"  # Responses': the response, incomplete for the shutdown
    assert events[-1]["response"]["incomplete_details"] == {"reason": "server_shutdown"}
    assert events[-1]["response"]["usage"]["output_tokens"] > 1
    events = [json.loads(line.removeprefix("data: ")) for line in streams[4].lines if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]  # Anthropic's: the turn ends
    assert events[-2]["usage"]["output_tokens"] > 1


def test_a_second_signal_exits_at_once(default_gguf):
    proc, url = start(default_gguf, 60.0)
    try:
        # min_tokens holds the end-of-sequence token back: a reply that ended by itself left nothing to wait for
        stream = Stream(url, "/v1/completions", {"prompt": "Rivers", "max_tokens": 3000, "min_tokens": 3000,
                                                 "stream": True})
        stream.start()
        assert stream.started.wait(60) and stream.is_alive() and stream.error is None, stream.error
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # the stream has a minute to finish
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        proc.wait(timeout=10)
        gone = time.monotonic() - signalled
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert gone < 2 and proc.returncode != 0 and "Traceback" not in err, err[-3000:]
