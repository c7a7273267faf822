"""A Triton kernel that fails to build: which errors are Triton's own, and a switch that turns
a step's kernels off at the first such failure, logged once, so its torch twin runs from then
on (a GPU or driver the compiler rejects must not take the server down)."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def raised_by_triton(e: BaseException) -> bool:
    """Whether ``e`` is Triton's (its own error types, or raised from inside triton: a launcher
    stub that will not compile, an assembler that rejects the GPU)."""
    if type(e).__module__.startswith("triton"):
        return True
    tb = e.__traceback__
    while tb is not None:
        if "/triton/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            return True
        tb = tb.tb_next
    return False


class KernelSwitch:
    """On until one of its kernels fails to build; ``instead`` says what runs from then on."""

    def __init__(self, instead: str) -> None:
        self.instead = instead
        self.failure: str | None = None

    @property
    def on(self) -> bool:
        return self.failure is None

    def launch(self, fn: Callable[[], object], what: str) -> bool:
        """Run the launch ``fn``; False (and the switch off, logged) where Triton failed to
        build the ``what`` kernel; any other error is raised."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - only Triton's own failures are caught
            if not raised_by_triton(e):
                raise
            self.failure = f"{type(e).__name__}: {e}"
            log.warning("the fused %s kernel failed to build (%s); %s", what, self.failure,
                        self.instead)
            return False
        return True
