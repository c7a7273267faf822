"""An Anthropic stream's ``message_start`` goes out when the request is accepted, not with the
first token: on a live server that runs one request at a time, a message queued behind a
long generation gets its ``message_start`` while that generation still runs, and its first
content only after it ended. The start counts the whole prompt; ``message_delta`` carries
the final usage, read back by the official client's stream helper."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server import forced
from tests.server.conftest import Server
from tests.server.live import ASK, clients, serve

# The request ahead: choices of as many tokens as the context holds, run one after another
# (seconds here), so it is still running when the message is sent.
CHOICES, LONG = 4, 500


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("forced")
    server = serve(forced.qwen3_moe(d / "qwen3_moe", ["hi", " there"]), d / "serve.log",
                   "--max-running-requests", "1", "--max-seq-len", "512")
    yield server
    server.stop()


# How far the thread reading the request ahead may lag behind the one reading the message
# (both clients in this process, on two cores): the ordering is checked up to this.
LAG_S = 0.5


def run_ahead(url: str, started: threading.Event, ended: list[float]) -> None:
    """A streamed completion of ``CHOICES`` x ``LONG`` tokens; ``started`` at its first
    chunk, ``ended`` gets the time its last chunk was read."""
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": "m", "prompt": "go", "max_tokens": LONG, "n": CHOICES, "ignore_eos": True,
            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
    ended.append(time.monotonic())


def test_message_start_comes_before_the_engine_schedules_the_message(one_at_a_time):
    _, anth = clients(one_at_a_time)
    started, ended = threading.Event(), []
    ahead = threading.Thread(target=run_ahead, args=(one_at_a_time.url, started, ended))
    ahead.start()
    try:
        assert started.wait(60)
        seen: list[tuple[str, float]] = []  # event, when it was read
        for e in anth.messages.create(model="m", max_tokens=16, messages=ASK, stream=True):
            seen.append((e.type, time.monotonic()))
            if e.type == "message_start":
                start = e.message
    finally:
        ahead.join(120)
    assert ended, "the request ahead did not finish"
    kinds = [k for k, _ in seen]
    assert kinds[0] == "message_start"  # (the client drops the ping after it)
    # the start went out while the request ahead still ran; the first token waited for it
    # (up to the two reader threads' lag)
    assert seen[0][1] < ended[0] - 2 * LAG_S, (seen, ended)
    first = kinds.index("content_block_delta")
    assert seen[first][1] > ended[0] - LAG_S, (seen, ended)
    prompt = anth.messages.count_tokens(model="m", messages=ASK).input_tokens
    assert start.usage.input_tokens == prompt and start.usage.output_tokens == 0
    assert start.usage.cache_read_input_tokens == 0


def test_message_delta_usage_is_what_the_stream_helper_keeps(one_at_a_time):
    _, anth = clients(one_at_a_time)
    prompt = anth.messages.count_tokens(model="m", messages=ASK).input_tokens
    whole = anth.messages.create(model="m", max_tokens=16, messages=ASK)
    with anth.messages.stream(model="m", max_tokens=16, messages=ASK) as s:
        events = list(s)
        final = s.get_final_message()
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.usage.output_tokens == final.usage.output_tokens == whole.usage.output_tokens
    assert delta.usage.input_tokens == final.usage.input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert [b.text for b in final.content] == ["hi there"]
