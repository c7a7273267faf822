"""NVIDIA ModelOpt NVFP4 (Hugging Face layout): e2m1 weights, an fp8 scale per 16, a global scale.

Data: uint8 ``(..., rows, cols // 2)``, two e2m1 codes per byte, the low nibble the even
element. ``scales["weight_scale"]``: float8_e4m3fn ``(..., rows, cols // 16)``;
``scales["weight_scale_2"]``: float32 scalar. An e2m1 code is ``s e e m``: subnormal
``0.5 * m`` when ``e == 0``, else ``2**(e - 1) * (1 + m / 2)``.
Weight = ``e2m1 * weight_scale[r, c // 16] * weight_scale_2``.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor, value_table

GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# midpoints between consecutive e2m1 magnitudes, for nearest rounding
E2M1_EDGES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MAX = 448.0


class NVFP4:
    name = "nvfp4"
    block_size = GROUP
    block_bytes = GROUP // 2  # data only; weight_scale is kept apart
    gguf_type: int | None = None

    def row_bytes(self, cols: int) -> int:
        if cols % GROUP:
            raise ValueError(f"nvfp4: a row of {cols} elements is not a multiple of {GROUP}")
        return cols // 2

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        *lead, cols = t.shape
        ws, ws2 = t.scales["weight_scale"], t.scales["weight_scale_2"]
        want = (*lead, self.row_bytes(cols))
        if t.data.dtype != torch.uint8 or tuple(t.data.shape) != want:
            raise ValueError(f"nvfp4: expected uint8 data {want}, got {tuple(t.data.shape)}")
        if tuple(ws.shape) != (*lead, cols // GROUP):
            raise ValueError(f"nvfp4: weight_scale {tuple(ws.shape)} does not match {t.shape}")
        codes = torch.stack([t.data & 0x0F, t.data >> 4], dim=-1).flatten(-2).long()
        values = value_table(E2M1, codes.device)[codes]
        # e2m1 * e4m3 is exact in float32, so only the global scale rounds.
        scaled = values * ws.float().repeat_interleave(GROUP, -1)
        return scaled * ws2.float()

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        self.row_bytes(x.shape[-1])
        xg = x.float().unflatten(-1, (-1, GROUP))  # (..., rows, groups, 16)
        amax = xg.abs().amax()
        ws2 = amax / (6 * E4M3_MAX) if amax > 0 else torch.tensor(1.0, device=x.device)
        group_scale = (xg.abs().amax(-1) / 6 / ws2).clamp(max=E4M3_MAX)
        ws = group_scale.to(torch.float8_e4m3fn)
        step = (ws.float() * ws2).unsqueeze(-1)
        v = torch.where(step > 0, xg / step, torch.zeros_like(xg))
        mag = torch.bucketize(v.abs(), torch.tensor(E2M1_EDGES, device=v.device))
        codes = (mag | (v < 0).long() << 3).to(torch.uint8).flatten(-2)
        data = codes[..., 0::2] | (codes[..., 1::2] << 4)
        scales = {"weight_scale": ws, "weight_scale_2": ws2.reshape(()).float()}
        return QuantTensor(self.name, tuple(x.shape), data.contiguous(), scales)
