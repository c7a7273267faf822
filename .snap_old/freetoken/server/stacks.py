"""Every thread's Python stack of a process, on demand and without ptrace.

:func:`thread_stacks` formats them (thread names included); :func:`dump_on_signal` makes
SIGUSR1 write them to stderr at the C level (``faulthandler``: it works while the interpreter
is stuck in a native call); :class:`StackResponder` answers requests on a pipe from a thread of
its own, blocked until asked, so the engine process's stacks can be fetched while its main
thread is busy or stuck (``GET /debug/stacks``, ``ft ctl stacks``).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection


def thread_stacks(process: str) -> str:
    """``process`` (pid N): each thread's name and its stack, innermost call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"{process} (pid {os.getpid()}), {len(names)} threads"]
    for ident, frame in sorted(sys._current_frames().items()):
        parts.append(f"--- thread {names.get(ident, '?')} ({ident})")
        parts.append("".join(traceback.format_stack(frame)).rstrip())
    return "\n".join(parts)


def dump_on_signal() -> None:
    """SIGUSR1 writes every thread's stack to stderr (where the server logs)."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)


class StackResponder:
    """A daemon thread that answers each request on ``conn`` with :func:`thread_stacks`, and
    with what ``native`` says (the CPU pool's workers, which have no Python stack) once set."""

    def __init__(self, conn: Connection, process: str) -> None:
        self.conn, self.process = conn, process
        self.native: Callable[[], str] | None = None
        threading.Thread(target=self._serve, name="stack-responder", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.conn.recv()  # blocks until asked
                text = thread_stacks(self.process)
                if self.native is not None:
                    text += "\n" + self.native()
                self.conn.send(text)
            except (EOFError, OSError):
                return
