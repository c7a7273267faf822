"""Server lifecycle: clean exit on SIGTERM/SIGINT, non-zero exit when the engine dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    return str(out)


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
