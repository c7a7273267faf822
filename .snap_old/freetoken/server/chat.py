"""``ft chat``: a terminal chat client that streams from a running server.

With ``--model`` it first starts ``ft serve`` for that model on a free local port.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from freetoken.errors import FreeTokenError


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int,
                temperature: float) -> Iterator[str]:
    body = json.dumps({"messages": messages, "stream": True, "max_tokens": max_tokens,
                       "temperature": temperature}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise FreeTokenError(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    yield choice["delta"].get("content") or ""
    except urllib.error.HTTPError as e:
        raise FreeTokenError(json.loads(e.read()).get("error", {}).get("message", str(e))) from e
    except urllib.error.URLError as e:
        raise FreeTokenError(f"cannot reach the server at {url} ({e.reason}); start one with "
                             "`ft serve` or pass --model") from e


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "freetoken.cli", "serve", "--model", args.model,
           "--port", str(port), "--device", args.device]
    if args.chat_template:
        cmd += ["--chat-template", args.chat_template]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    print(f"starting ft serve for {args.model} ...", file=sys.stderr)
    while proc.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.5)
    raise FreeTokenError(f"ft serve exited with code {proc.returncode}; run it directly to "
                         "see why")


def chat_main(args: argparse.Namespace) -> int:
    proc, url = (_start_server(args) if args.model else (None, args.url.rstrip("/")))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    try:
        while True:
            try:
                text = input("> ")
            except EOFError:
                break
            if not text.strip():
                break
            messages.append({"role": "user", "content": text})
            reply = ""
            for delta in stream_chat(url, messages, args.max_tokens, args.temperature):
                reply += delta
                print(delta, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": reply})
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=30)
    return 0
