"""Server lifecycle: clean exit on SIGTERM/SIGINT, non-zero exit when the engine dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import GEMMA_TEMPLATE, start_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(tiny_model, tmp_path, sig):
    server = start_server(["--model", tiny_model, "--kv-tokens", "1024"], tmp_path / "log")
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 4},
                   timeout=60)
    assert r.status_code == 200
    engine_pid = httpx.get(f"{server.url}/v1/stats").json()["engine_info"]["pid"]
    server.proc.send_signal(sig)
    assert server.proc.wait(timeout=60) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(engine_pid, 0)  # the engine process went with it


def test_engine_death_is_reported_and_exits_nonzero(tiny_model, tmp_path):
    server = start_server(["--model", tiny_model, "--kv-tokens", "1024"], tmp_path / "log")
    engine_pid = httpx.get(f"{server.url}/v1/stats").json()["engine_info"]["pid"]
    os.kill(engine_pid, signal.SIGKILL)
    assert server.proc.wait(timeout=60) == 1
    assert "engine process failed" in (tmp_path / "log").read_text()


def test_chat_without_template_is_a_clear_400(tmp_path):
    # the Gemma-3 270M base GGUF carries no chat template
    server = start_server(["--kv-tokens", "1024", "--max-seq-len", "256"], tmp_path / "log")
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_port_in_use_is_a_one_line_error(tiny_model, tmp_path):
    server = start_server(["--model", tiny_model, "--kv-tokens", "1024"], tmp_path / "log")
    try:
        port = server.url.rsplit(":", 1)[1]
        r = subprocess.run([sys.executable, "-m", "freetoken.cli", "serve", "--device", "cpu",
                            "--model", tiny_model, "--kv-tokens", "1024", "--port", port],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
    finally:
        server.stop()


def test_ft_chat_streams_a_conversation(tiny_model, tmp_path):
    server = start_server(["--model", tiny_model, "--kv-tokens", "2048"], tmp_path / "log")
    try:
        r = subprocess.run([sys.executable, "-m", "freetoken.cli", "chat", "--url", server.url,
                            "--max-tokens", "5", "--temperature", "0"],
                           input="hello there\nand again\n\n", capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        replies = [line for line in r.stdout.split("> ") if line.strip()]
        assert len(replies) == 2 and all(len(x.strip()) > 0 for x in replies)
    finally:
        server.stop()


def test_ft_chat_without_a_server_says_how_to_start_one():
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "chat", "--url",
                        "http://127.0.0.1:9"], input="hi\n", capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "start one with `ft serve`" in r.stderr


def test_open_host_without_a_key_warns(tiny_model, tmp_path):
    log = tmp_path / "log"
    server = start_server(["--model", tiny_model, "--kv-tokens", "1024", "--host", "0.0.0.0"],
                          log)
    server.stop()
    assert "listening on 0.0.0.0 without an API key" in log.read_text()
    quiet = start_server(["--model", tiny_model, "--kv-tokens", "1024"], tmp_path / "quiet")
    quiet.stop()
    assert "without an API key" not in (tmp_path / "quiet").read_text()


def test_sigterm_lets_requests_finish_then_ends_the_rest(tmp_path):
    """Gemma-3 270M with torch's dense layers decodes about 10 tokens/s on two CPU cores: 4
    tokens finish inside the 10 s grace even on a loaded machine, 400 do not."""
    log = tmp_path / "log"
    (tmp_path / "t.jinja").write_text(GEMMA_TEMPLATE)
    server = start_server(["--kv-tokens", "4096", "--max-seq-len", "512", "--chat-template",
                           str(tmp_path / "t.jinja"), "--shutdown-timeout", "10",
                           "--cpu-dense", "torch"], log)
    model = "gemma-3-270m-q4_k_m.gguf"
    greedy = {"temperature": 0}
    long = {"max_tokens": 400, **greedy}
    msgs = [{"role": "user", "content": "Tell a long story."}]
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    an = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)

    def short() -> str | None:
        return oa.completions.create(model=model, prompt="Hello", max_tokens=4,
                                     temperature=0).choices[0].finish_reason

    def stream_openai() -> list[str]:
        return [c.choices[0].delta.content or "" for c in oa.chat.completions.create(
            model=model, messages=msgs, stream=True, extra_body={"ignore_eos": True},
            **long) if c.choices]

    def stream_anthropic() -> list[str]:
        return [e.type for e in an.messages.create(model=model, messages=msgs, stream=True,
                                                   max_tokens=400, extra_body=greedy)]

    def plain(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json=body | long, timeout=60)

    with ThreadPoolExecutor(5) as pool:
        jobs = {
            "short": pool.submit(short),
            "openai": pool.submit(plain, "/v1/completions",
                                  {"prompt": "Once upon a time", "ignore_eos": True}),
            "anthropic": pool.submit(plain, "/v1/messages", {"model": model, "messages": msgs}),
            "openai_stream": pool.submit(stream_openai),
            "anthropic_stream": pool.submit(stream_anthropic),
        }
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/v1/stats").json()["in_flight"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert jobs["short"].result() == "length"  # finished inside the grace period
        r = jobs["openai"].result()
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "shut down" in r.json()["error"]["message"]
        r = jobs["anthropic"].result()
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(openai.APIError, match="shut down"):
            jobs["openai_stream"].result()
        with pytest.raises(anthropic.APIStatusError, match="shut down"):
            jobs["anthropic_stream"].result()
        assert 9.5 < time.monotonic() - t0 < 30
    assert server.proc.wait(timeout=60) == 0
    text = log.read_text()
    assert "shutdown timeout: ending 4 requests" in text
    for bad in ("Traceback", "CancelledError", "Internal Server Error", "ERROR"):
        assert bad not in text, text
