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
