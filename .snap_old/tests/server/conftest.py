"""A live ``ft serve`` on loopback, driven by the official ``openai`` and ``anthropic``
clients."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<start_of_turn>user\nTools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}"
    "<end_of_turn>\n{% endif %}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    log: Path

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: list[str], log: Path, timeout: float = 300) -> Server:
    port = free_port()
    out = open(log, "w")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken.cli", "serve", "--device", "cpu", "--port", str(port),
         *args], stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(proc, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{log.read_text()}")


def start_tiny_chat(model: str, d: Path, *args: str) -> Server:
    """A server on ``ft synth``'s tiny model (``model``) with a one-line chat template, its
    files in ``d``."""
    template = d / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return start_server(["--model", model, "--chat-template", str(template), *args],
                        d / "server.log")


def openai_client(server: Server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    return str(out)


@pytest.fixture(scope="session")
def gemma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("serve")
    template = d / "template.jinja"
    template.write_text(GEMMA_TEMPLATE)
    server = start_server(["--chat-template", str(template), "--max-seq-len", "512",
                           "--kv-tokens", "8192", "--max-running-requests", "8",
                           "--max-prefill-length", "256"], d / "server.log")
    yield server
    server.stop()


@pytest.fixture()
def client(gemma_server: Server):
    from openai import OpenAI

    return OpenAI(base_url=f"{gemma_server.url}/v1", api_key="none", max_retries=0,
                  timeout=300)


@pytest.fixture()
def anthropic_client(gemma_server: Server):
    from anthropic import Anthropic

    return Anthropic(base_url=gemma_server.url, api_key="none", max_retries=0, timeout=300)
