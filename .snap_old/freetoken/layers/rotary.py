"""Rotary position embedding, NeoX layout (the two halves of each head rotate together)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from freetoken.config import RopeSpec
from freetoken.cpu.library import optional
from freetoken.kernels.token_steps import rotary, rotary_usable


def _native() -> Any:
    """The native library's rotary embedding, or None where it is not built (torch runs)."""
    return optional("ft_rotary_neox")


class Rotary(nn.Module):
    """cos/sin tables for positions ``0..max_position`` with base ``theta``.

    ``factor`` > 1 is linear position scaling (positions divided by factor). A ``spec``
    (:class:`RopeSpec`) gives the frequencies and the cos/sin scale instead (:func:`inv_freq`).
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, factor: float = 1.0,
                 spec: RopeSpec | None = None) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        freq, scale = 1.0 / (theta**exponents), 1.0
        if spec is not None:
            freq, scale = inv_freq(spec, head_dim)
        pos = torch.arange(max_position, dtype=torch.float32) / factor
        freqs = torch.outer(pos, freq)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (positions, 1, head_dim)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (T, heads, head_dim) at ``positions`` (T,). Float32 on the CPU is one
        native call, a GPU one Triton kernel (both the bits of :meth:`reference`, their slow
        twin)."""
        cos = self.cos
        if rotary_usable(x, cos, positions):  # one GPU kernel (kernels/token_steps.py)
            y = rotary(x, cos, self.sin, positions)
            if y is not None:
                return y
        if x.dtype is torch.float32 and x.is_cpu and cos.dtype is torch.float32 and cos.is_cpu \
                and x.dim() == 3 and x.shape[2] == cos.shape[-1] \
                and positions.numel() == x.shape[0]:
            fn = _native()
            if fn is not None:
                x = x.contiguous()
                pos = positions.long().contiguous()
                y = torch.empty_like(x)
                if fn(x.data_ptr(), cos.data_ptr(), self.sin.data_ptr(), cos.shape[0],
                      pos.data_ptr(), x.shape[0], x.shape[1], x.shape[2], y.data_ptr()) == 0:
                    return y
        return self.reference(x, positions)

    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = torch.index_select(self.cos, 0, positions)
        sin = torch.index_select(self.sin, 0, positions)
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def inv_freq(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """(head_dim / 2 inverse frequencies, cos/sin scale) of ``spec``, computed as
    ``transformers.modeling_rope_utils`` does for its rope types."""
    D = head_dim
    if spec.kind in ("default", "linear"):
        freq = 1.0 / spec.theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)
        return (freq / spec.factor if spec.kind == "linear" else freq), 1.0
    if spec.kind == "proportional":  # rotated pairs first, then pairs that never turn
        n = int(spec.fraction * D // 2)
        rot = 1.0 / spec.theta ** (torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / D)
        return torch.cat([rot, torch.zeros(D // 2 - n)]) / spec.factor, 1.0
    if spec.kind != "yarn":
        raise ValueError(f"unknown rope kind {spec.kind!r}")
    f, base, orig = spec.factor, spec.theta, spec.original_max_position
    scale = spec.attention_factor or (0.1 * math.log(f) + 1.0 if f > 1 else 1.0)

    def dim_of(rotations: float) -> float:  # the dim whose wavelength makes ``rotations``
        return D * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(spec.beta_fast), dim_of(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, D, 2).float() / D)
    extrapolate = 1 - ramp
    freq = (1.0 / (f * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return freq, scale
