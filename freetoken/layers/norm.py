"""RMSNorm in float32, as both reference implementations compute it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from freetoken.cpu.library import optional
from freetoken.kernels.token_steps import add_rms_norm, add_usable, rms_norm, usable


def _native() -> Any:
    """The native library's RMSNorm, or None where it is not built (the torch path runs)."""
    return optional("ft_rms_norm")


class RMSNorm(nn.Module):
    """``x / rms(x) * w``; with ``unit_offset`` (Gemma) the scale is ``1 + w``.

    Qwen casts the normalised input back to the input dtype before scaling; Gemma (and, with
    ``float_scale``, Gemma-4 and GPT-OSS on a plain ``w``) scale in float32 and cast last. Both
    orders are kept so bf16 runs match their references. Float32
    rows on the CPU go through one native call, GPU rows through one Triton kernel (the slow
    twin of both is :meth:`reference`): at decode the torch path's dispatch and launches cost
    more than its arithmetic.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False,
                 float_scale: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset
        self.float_scale = float_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if usable(x, w):  # one GPU kernel (kernels/token_steps.py)
            y = rms_norm(x, w, self.eps, self.mode)
            if y is not None:
                return y
        if x.dtype is torch.float32 and x.is_cpu and w.dtype is torch.float32 and w.is_cpu \
                and x.shape[-1] == w.numel():
            fn = _native()
            if fn is not None:
                x = x.contiguous()
                y = torch.empty_like(x)
                dim = x.shape[-1]
                fn(x.data_ptr(), w.data_ptr(), x.numel() // dim, dim, self.eps,
                   self.unit_offset, y.data_ptr())
                return y
        return self.reference(x)

    def added(self, x: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
        """``(h, norm(h))`` for the residual sum h = x + a (a None: h = x), on a GPU in one
        kernel; its slow twin is the add, then :meth:`forward`."""
        if a is None:
            return x, self(x)
        if add_usable(x, a, self.weight):
            both = add_rms_norm(x, a, self.weight, self.eps, self.mode)
            if both is not None:
                return both
        h = x + a
        return h, self(h)

    @property
    def mode(self) -> str:
        """How the scale is applied (``kernels/token_steps.py:MODES``)."""
        return "unit_offset" if self.unit_offset else "float_scale" if self.float_scale \
            else "qwen"

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        if self.float_scale:
            return (h * self.weight.float()).to(x.dtype)
        return self.weight * h.to(x.dtype)
