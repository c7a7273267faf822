"""The one step every Triton kernel of a decode takes first when launched for programmatic
dependent launch (:func:`freetoken.kernels.build.overlap`; imported only when first used)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def inputs_ready(PDL: tl.constexpr):
    """With PDL, wait until the kernel before this one in the stream has ended and its writes
    are seen, then let the kernel after this one start (it waits the same way, so a kernel
    never runs ahead of one two launches back). Without PDL nothing: the stream's order
    holds."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
