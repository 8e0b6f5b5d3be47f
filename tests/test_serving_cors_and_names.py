"""CORS (`--allowed-origins`) and the model names a server answers to (`--served-model-name`), on the real app
without a model loaded (its lifespan does not run: routes that need the model answer 503), and the options'
validation through the real command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from starlette.testclient import TestClient
from test_serving import SERVER_ENV

from perfx_core.errors import InvalidArgumentError
from perfx_core.serving import ServerConfig, create_app

ORIGIN = "http://app.example:3000"
KEY = "secret"


def _client(model_path, **options) -> TestClient:
    app = create_app(ServerConfig(model_path=model_path, api_key=KEY, **options))
    return TestClient(app, base_url="http://127.0.0.1:8000")  # not entered: no lifespan, no model load


def _preflight(client: TestClient, origin: str):
    return client.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
        },
    )


def test_allowed_origin_gets_its_preflight_answered_without_the_key(smollm2_path):
    client = _client(smollm2_path, allowed_origins=(ORIGIN,))
    answer = _preflight(client, ORIGIN)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "x-stainless-os" in answer.headers["access-control-allow-headers"]
    refused = _preflight(client, "http://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def test_cors_headers_only_for_allowed_origins_and_on_errors_too(smollm2_path):
    client = _client(smollm2_path, allowed_origins=(ORIGIN,))
    auth = {"Authorization": f"Bearer {KEY}"}
    listed = client.get("/v1/models", headers={"Origin": ORIGIN, **auth})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == ORIGIN
    no_key = client.get("/v1/models", headers={"Origin": ORIGIN})  # the page can read why it failed
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == ORIGIN
    other = client.get("/v1/models", headers={"Origin": "http://evil.example", **auth})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_no_origin_is_allowed_by_default(smollm2_path):
    client = _client(smollm2_path)
    answer = _preflight(client, ORIGIN)
    assert answer.status_code == 401 and "access-control-allow-origin" not in answer.headers
    listed = client.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert "access-control-allow-origin" not in listed.headers


def test_a_star_allows_any_origin(smollm2_path):
    answer = _preflight(_client(smollm2_path, allowed_origins=("*",)), "http://anywhere.example")
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] in (
        "*",
        "http://anywhere.example",
    )


def test_model_names_without_and_with_served_names(smollm2_path):
    plain = ServerConfig(model_path=smollm2_path)
    assert plain.model_names == ("SmolLM2-135M-Instruct.Q4_1",)
    assert plain.response_model_name("gpt-4o") == plain.response_model_name(None) == plain.model_names[0]
    named = ServerConfig(model_path=smollm2_path, served_model_names=("small", "gpt-4o"))
    assert named.model_names == ("small", "gpt-4o")
    assert named.response_model_name("gpt-4o") == "gpt-4o" and named.response_model_name(None) == "small"
    assert named.response_model_name("SmolLM2-135M-Instruct.Q4_1") is None  # only the listed names
    client = _client(smollm2_path, served_model_names=("small", "gpt-4o"))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert [m["id"] for m in client.get("/v1/models", headers=auth).json()["data"]] == ["small", "gpt-4o"]
    assert client.get("/v1/models/gpt-4o", headers=auth).status_code == 200
    assert client.get("/v1/models/SmolLM2-135M-Instruct.Q4_1", headers=auth).status_code == 404


@pytest.mark.parametrize(
    "options",
    [
        {"allowed_origins": ("http://app.example/",)},  # a path: not an origin
        {"allowed_origins": ("app.example",)},  # no scheme
        {"served_model_names": ("a", "a")},
        {"served_model_names": (" a",)},
    ],
)
def test_bad_options_are_clear_errors(smollm2_path, options):
    with pytest.raises(InvalidArgumentError):
        ServerConfig(model_path=smollm2_path, **options)


def test_cli_checks_the_options_before_loading():
    run = subprocess.run(
        [sys.executable, "-m", "perfx_core.serving", "--allowed-origins", "http://a.example,localhost:3000"],
        env=SERVER_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "allowed-origins: 'localhost:3000' is not an origin" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "perfx_core.serving", "--served-model-name", "a", "b,a"],
        env=SERVER_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "served-model-name lists a name twice: a, b, a" in run.stderr
