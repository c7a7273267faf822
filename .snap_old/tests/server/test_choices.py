"""``n`` choices on both OpenAI endpoints through the official client: choice i of a seeded
request is the single request with seed + i, streamed the same as whole, usage summed; a
client that leaves takes every choice with it."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import Server, openai_client, start_tiny_chat

PROMPT = [300, 301, 302, 303]
SAMPLED = dict(model="tiny", temperature=1.0, seed=7, max_tokens=12,
               extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    s = start_tiny_chat(tiny_model, tmp_path_factory.mktemp("choices"), "--kv-tokens", "4096")
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai_client(server)


def test_choice_i_is_the_request_with_seed_plus_i(client):
    r = client.completions.create(prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.completions.create(prompt=PROMPT, **SAMPLED | {"seed": 7 + i})
               for i in range(3)]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in r.choices}) > 1  # sampled: the choices differ
    assert r.usage.completion_tokens == 3 * 12
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens


def test_completion_choices_streamed_as_whole(client):
    whole = client.completions.create(prompt=PROMPT, n=2, **SAMPLED)
    texts, finish = defaultdict(str), {}
    usage = None
    for chunk in client.completions.create(prompt=PROMPT, n=2, stream=True,
                                           stream_options={"include_usage": True}, **SAMPLED):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert [texts[i] for i in range(2)] == [c.text for c in whole.choices]
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 24


def test_chat_choices_whole_and_streamed(client):
    kwargs = SAMPLED | dict(messages=[{"role": "user", "content": "hello"}], n=2)
    kwargs.pop("model")
    whole = client.chat.completions.create(model="tiny", **kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 24
    texts, roles = defaultdict(str), set()
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for c in chunk.choices:
            roles |= {c.index} if c.delta.role == "assistant" else set()
            texts[c.index] += c.delta.content or ""
    assert roles == {0, 1}
    assert [texts[i] for i in range(2)] == [c.message.content for c in whole.choices]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_takes_every_choice(server, stream):
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 3000, "ignore_eos": True,
            "temperature": 1.0, "stream": stream}
    if stream:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=30) as r:
            lines = r.iter_lines()
            assert all(next(lines) is not None for _ in range(6))  # some chunks came
    else:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        engine = httpx.get(f"{server.url}/v1/stats").json()["engine"]
        if engine["running"] == 0 and engine["waiting"] == 0:
            break
        time.sleep(0.2)
    assert engine["running"] == 0 and engine["waiting"] == 0, engine
