"""Host memory for expert banks: 2 MiB-aligned buffers advised to use transparent huge pages."""

from __future__ import annotations

import ctypes

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def host_buffer(nbytes: int) -> torch.Tensor:
    """Uninitialised uint8 host memory for expert banks, 2 MiB-aligned and advised to use
    transparent huge pages (fewer TLB misses when the kernels stream it).

    The advice only holds for pages first touched after it, so fill the buffer afterwards.
    """
    if nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % HUGE_PAGE
    buf = raw[skip : skip + nbytes]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE),
                 _MADV_HUGEPAGE)  # a failure only costs speed
    return buf


def to_host_bank(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in :func:`host_buffer` memory (same dtype and shape)."""
    nbytes = t.numel() * t.element_size()
    out = host_buffer(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
