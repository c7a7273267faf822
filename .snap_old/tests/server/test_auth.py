"""API keys on a live server: every endpoint but /health refuses a missing or wrong key with a
401 in its API's shape, and serves with a right one in either header."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import GEMMA_TEMPLATE, Server, start_server

KEYS = ("sk-first", "sk-from-file")
ENDPOINTS = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/stats", None),
    ("GET", "/metrics", None),
    ("GET", "/debug/stacks", None),
    ("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 2}),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 2}),
    ("POST", "/v1/messages",
     {"model": "tiny", "messages": [{"role": "user", "content": "abc"}], "max_tokens": 2}),
    ("POST", "/v1/messages/count_tokens",
     {"model": "tiny", "messages": [{"role": "user", "content": "abc"}]}),
]


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("keyed")
    (d / "keys").write_text(f"# one key a line\n\n{KEYS[1]}\n")
    (d / "template.jinja").write_text(GEMMA_TEMPLATE)
    server = start_server(["--model", tiny_model, "--kv-tokens", "1024", "--served-model-name",
                           "tiny", "--chat-template", str(d / "template.jinja"),
                           "--api-key", KEYS[0], "--api-key-file", str(d / "keys")],
                          d / "log")
    yield server
    server.stop()


@pytest.mark.parametrize("method, path, body", ENDPOINTS)
def test_every_endpoint_needs_a_key(keyed_server: Server, method, path, body):
    url = f"{keyed_server.url}{path}"
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-firs"},
                    {"authorization": f"Basic {KEYS[0]}"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["type"] == "authentication_error"
        else:
            assert err["error"]["type"] == "authentication_error" and err["error"]["code"] == 401
    for headers in ({"authorization": f"Bearer {KEYS[0]}"}, {"x-api-key": KEYS[1]}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, (headers, r.text)


def test_health_is_open(keyed_server: Server):
    assert httpx.get(f"{keyed_server.url}/health", timeout=10).status_code == 200


def test_official_clients_with_and_without_the_key(keyed_server: Server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-wrong",
                      max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEYS[1], max_retries=0)
    assert ok.completions.create(model="tiny", prompt="abc", max_tokens=2).usage
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed_server.url, api_key="sk-wrong",
                            max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "abc"}])
    good = anthropic.Anthropic(base_url=keyed_server.url, api_key=KEYS[0], max_retries=0)
    m = good.messages.create(model="tiny", max_tokens=2,
                             messages=[{"role": "user", "content": "abc"}])
    assert m.usage.output_tokens >= 1
