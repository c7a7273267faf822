"""``ft ctl``: ask a running ``ft serve`` how it is, over its own HTTP API.

``health`` (``/health``), ``stats`` (``/v1/stats``), ``stacks`` (``/debug/stacks``: every
thread's Python stack of the API and the engine process, no ptrace needed). The server is
found by ``--host`` and ``--port``, the serve defaults.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from freetoken.errors import FreeTokenError
from freetoken.server.serve import HOST, PORT

ROUTES = {"health": "/health", "stats": "/v1/stats", "stacks": "/debug/stacks"}


def add_ctl_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=sorted(ROUTES), help="what to ask the server")
    p.add_argument("--host", default=HOST, help="the server's address (as ft serve)")
    p.add_argument("--port", type=int, default=PORT, help="the server's port (as ft serve)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer")


def fetch(host: str, port: int, route: str, timeout: float) -> tuple[int, Any]:
    """(HTTP status, parsed JSON) of GET ``route``; FreeTokenError when nothing answers."""
    url = f"http://{host}:{port}{route}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (our own server)
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError) as e:
        raise FreeTokenError(f"no ft serve answers at {host}:{port} ({e}); start one, or pass "
                             "--host/--port") from None


def ctl_main(args: argparse.Namespace) -> int:
    status, body = fetch(args.host, args.port, ROUTES[args.what], args.timeout)
    if args.what == "stacks" and status == 200:
        print(body.get("api", ""), body.get("engine", ""), sep="\n\n")
    else:
        print(json.dumps(body, indent=1))
    return 0 if status == 200 else 1
