"""schemathesis against the server's own /openapi.json: generated requests never get a 5xx.

The engine has a tiny context so that whatever max_tokens the fuzzer picks, a reply stays short on the CPU.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from localpd.engine import Engine
from localpd.api.app import create_app


@pytest.fixture(scope="module")
def app(default_gguf):
    engine = Engine(default_gguf, device="cpu", max_context=48)
    yield create_app(engine)
    engine.close()


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case):
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])


def test_every_post_route_takes_any_body_without_a_5xx(app):
    """Each POST route (the OpenAI, Anthropic and Ollama ones alike): a body that is not JSON is a 400 whatever its
    Content-Type; JSON of the wrong shape a 4xx; lone surrogates in every text field an answer or a 4xx."""
    from starlette.testclient import TestClient

    paths = sorted(path for path, operations in app.openapi()["paths"].items() if "post" in operations)
    assert {"/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat"} <= set(paths)
    cut = (b'{"messages": [{"role": "user", "content": "\\udfff"}], "prompt": "a\\ud83d", "input": "\\ud800", '
           b'"system": "\\udc00", "max_tokens": 2, "options": {"num_predict": 2}, "stream": false}')
    with TestClient(app) as client:
        for path in paths:
            for body, content_type in ((b"{not json", "text/plain"), (b"{not json", None), (b"[]", "text/plain"),
                                       (cut, "application/x-www-form-urlencoded")):
                headers = {"content-type": content_type} if content_type else {}
                r = client.post(path, content=body, headers=headers)
                assert r.status_code < 500, (path, body, r.text[:300])
                if body == b"{not json":
                    assert r.status_code == 400, (path, r.text[:300])
