"""A Triton kernel that fails to build: which errors are Triton's own, and a switch that turns
a step's kernels off at the first such failure, logged once, so its torch twin runs from then
on (a GPU or driver the compiler rejects must not take the server down). And the launch
arguments every kernel takes for programmatic dependent launch (:func:`overlap`)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from freetoken import env

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


@functools.cache
def _capability(index: int) -> int:
    major, _ = torch.cuda.get_device_capability(index)
    return major


def overlap(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel that may start while the kernel before it in the stream
    ends (programmatic dependent launch: FREETOKEN_GPU_PDL=on, a GPU of compute capability 9
    or above, not Triton's interpreter): ``launch_pdl`` for Triton and the kernel's own
    ``PDL``, with which it waits for the kernel before (``triton_overlap.inputs_ready``)
    before it reads anything another kernel wrote. Else none: the kernel's PDL stays False."""
    if device.type != "cuda" or env.gpu_pdl() != "on" or os.environ.get("TRITON_INTERPRET") == "1":
        return {}
    if _capability(device.index if device.index is not None else torch.cuda.current_device()) < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}
