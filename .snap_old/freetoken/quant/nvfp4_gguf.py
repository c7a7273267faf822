"""GGUF NVFP4 (GGML type 40): llama.cpp's blocks, read into our nvfp4 layout and written from it.

Block (36 bytes, 64 weights): ``d: u8[4] | qs: u8[32]``. Sub-block ``s`` (weights
``16s .. 16s + 15``) has the unsigned e4m3 scale ``d[s]`` (bias 7, no sign; bit 7 is ignored
and ``0x7F`` decodes as 0) and the bytes ``qs[8s .. 8s + 7]``: byte ``j``'s low nibble is weight
``16s + j``, its high nibble weight ``16s + j + 8``. A nibble is an e2m1 code; weight =
``e2m1 * d[s]``. There is no global scale.

Our nvfp4 keeps the same codes and e4m3 scales apart (low nibble the even weight) with a global
scale; a GGUF tensor reads as one with ``weight_scale_2 = 1``, its codes reordered and its scale
bytes normalised, never dequantised, so every nvfp4 kernel reads it. The values are the gguf
package's bit for bit: code 8 (-0) becomes code 0, as ggml decodes it to +0. Scale byte
``0xFF`` decodes to 480 in ggml, past e4m3's 448, and no quantiser writes it: it is refused.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.nvfp4 import E2M1, GROUP

GGUF_TYPE = 40  # GGMLQuantizationType.NVFP4
BLOCK = 64
BLOCK_BYTES = 4 + BLOCK // 2
_SUBS = BLOCK // GROUP
_CHUNK = 4096  # blocks repacked at a time
_UNZIP = tuple((np.uint64(s), np.uint64(m)) for s, m in (
    (4, 0x00F000F000F000F0), (8, 0x0000FF000000FF00), (16, 0x00000000FFFF0000)))
_U3 = (np.uint64(1), np.uint64(2), np.uint64(3))


def _blocks(cols: int) -> int:
    if cols % BLOCK:
        raise ValueError(f"GGUF nvfp4: a row of {cols} elements is not a multiple of {BLOCK}; "
                         "pick another format for this tensor")
    return cols // BLOCK


def row_bytes(cols: int) -> int:
    """Bytes one GGUF row of ``cols`` weights takes."""
    return _blocks(cols) * BLOCK_BYTES


def read_nbytes(shape: tuple[int, ...]) -> int:
    """``QuantTensor.nbytes`` of what :func:`read` makes of a tensor of ``shape``: the codes,
    one e4m3 scale per 16 weights and the float32 global scale."""
    *lead, cols = shape
    _blocks(cols)
    return math.prod(lead) * (cols // 2 + cols // GROUP) + 4


def ue4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 scales -> unsigned e4m3 bytes, rounded as ggml's ``ggml_fp32_to_ue4m3``: half up
    on the first dropped bit, at least 256 saturating to 448 (``0x7E``), NaN and <= 0 to 0."""
    x = x.float().clamp(max=448.0)
    bits = x.contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    sub = (x * 512.0 + 0.5).to(torch.int32).clamp(max=7)
    man = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    exp_r, man_r = torch.where(man > 7, exp + 1, exp), torch.where(man > 7, 0, man)
    normal = torch.where(exp_r >= 15, 0x7E, (exp_r << 3) | man_r)
    out = torch.where(exp <= 0, sub, normal)
    return torch.where(x > 0, out, 0).to(torch.uint8)


def read(data: torch.Tensor, shape: tuple[int, ...]) -> QuantTensor:
    """GGUF blocks uint8 ``(..., rows, cols // 64 * 36)`` as an nvfp4 tensor of ``shape``."""
    *lead, cols = shape
    want = (*lead, _blocks(cols) * BLOCK_BYTES)
    if data.dtype != torch.uint8 or tuple(data.shape) != tuple(want):
        raise ValueError(f"GGUF nvfp4: expected uint8 blocks {tuple(want)} for shape {shape}, "
                         f"got {data.dtype} {tuple(data.shape)}")
    codes, d = _repack(data.reshape(-1, BLOCK_BYTES))
    scales = {"weight_scale": d.reshape(*lead, cols // GROUP).view(torch.float8_e4m3fn),
              "weight_scale_2": torch.tensor(1.0)}
    return QuantTensor("nvfp4", tuple(shape), codes.reshape(*lead, cols // 2), scales)


def _repack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``(n, 36)`` -> our codes ``(n, 32)`` and e4m3 scale bytes ``(n, 4)``.

    Each sub-block's 8 code bytes are one 64-bit word: its nibbles ``e0 e8 e1 e9 .. e7 e15``
    are unzipped to ``e0 .. e15`` by three delta swaps, code 8 (-0) cleared to 0 first. In
    chunks that stay in cache, on one thread (numpy): a thread pool per small op only waits on
    a busy host."""
    src = blocks.cpu().numpy()
    out = np.empty((src.shape[0], BLOCK // 2), dtype=np.uint8)
    d = np.empty((src.shape[0], _SUBS), dtype=np.uint8)
    for i in range(0, src.shape[0], _CHUNK):
        s = d[i:i + _CHUNK]
        s[...] = src[i:i + _CHUNK, :_SUBS]
        if (s == 0xFF).any():
            raise ValueError("GGUF nvfp4: scale byte 0xFF (480, beyond e4m3's 448) is not "
                             "written by any quantiser; the file is corrupt, convert it again")
        s &= 0x7F
        s[s == 0x7F] = 0
        o = out[i:i + _CHUNK]
        o[...] = src[i:i + _CHUNK, _SUBS:]
        x = o.view(np.uint64)
        low = x & np.uint64(0x7777777777777777)
        nonzero = (low | (low >> _U3[0]) | (low >> _U3[1])) & np.uint64(0x1111111111111111)
        x &= nonzero << _U3[2]  # a sign bit stays on a nonzero code
        x |= low
        for shift, mask in _UNZIP:
            t = (x ^ (x >> shift)) & mask
            x ^= t ^ (t << shift)
    return torch.from_numpy(out), torch.from_numpy(d)


def write(t: QuantTensor) -> torch.Tensor:
    """An nvfp4 tensor with ``weight_scale_2 == 1`` and finite non-negative scales as GGUF
    blocks uint8 ``(..., rows, cols // 64 * 36)``, the inverse of :func:`read`."""
    *lead, cols = t.shape
    n = _blocks(cols)
    ws = t.scales["weight_scale"].contiguous().view(torch.uint8)
    if float(t.scales["weight_scale_2"]) != 1.0 or bool((ws > 0x7E).any()):
        raise ValueError("GGUF nvfp4 has no global scale and no negative or NaN scales; "
                         "quantise the weights with nvfp4_gguf.quantize")
    codes = torch.stack([t.data & 0x0F, t.data >> 4], dim=-1).reshape(*lead, n, _SUBS, GROUP)
    qs = codes[..., : GROUP // 2] | (codes[..., GROUP // 2:] << 4)
    blocks = torch.cat([ws.reshape(*lead, n, _SUBS), qs.reshape(*lead, n, BLOCK // 2)], dim=-1)
    return blocks.reshape(*lead, n * BLOCK_BYTES)


def quantize(x: torch.Tensor) -> QuantTensor:
    """``x`` as nvfp4 with ``weight_scale_2 == 1``, the codes and scales ggml's reference
    quantiser picks: scale ``ue4m3(amax / 6)`` per 16, each code the nearest (first of ties)."""
    _blocks(x.shape[-1])
    xg = x.float().unflatten(-1, (-1, GROUP))
    d = ue4m3(xg.abs().amax(-1) / 6.0)
    step = d.view(torch.float8_e4m3fn).float().unsqueeze(-1).unsqueeze(-1)
    grid = step * torch.tensor(E2M1, dtype=torch.float32, device=x.device)
    codes = (grid - xg.unsqueeze(-1)).abs().argmin(-1).to(torch.uint8).flatten(-2)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = {"weight_scale": d.view(torch.float8_e4m3fn),
              "weight_scale_2": torch.tensor(1.0, device=x.device)}
    return QuantTensor("nvfp4", tuple(x.shape), data.contiguous(), scales)
