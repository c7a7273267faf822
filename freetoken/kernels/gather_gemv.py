"""Experts kept as blocks (expert cache slots, resident layers) gathered and multiplied in one
pass on the GPU (Triton), for decode.

A decode call's (token, expert) pairs each read one expert's weights: in the expert cache those
are GGUF blocks in the slots. The slow twin (:func:`gathered_reference`) copies the pairs' slots
out, dequantises them to the compute dtype and runs batched matmuls: each weight byte is read,
widened, written and read again. The fused kernels read each weight byte once, straight from its
slot, and accumulate in float32: one program per pair and block of output rows, looping over the
row's blocks, the pair's activation row broadcast over them.

One kernel compiled per format, its launch choices in :mod:`.gemv_launch` (Q8_0, Q5_0, Q4_K, Q5_K,
Q6_K: the formats of Q8_0, Q4_K_M and Q5_K_M checkpoints' experts; MXFP4: GPT-OSS's and the
MXFP4 Gemma-4 files'; nvfp4: the NVFP4 Gemma-4 files' GGUF blocks as read into it, and ModelOpt
NVFP4 checkpoints'); a layer is fused when all three of its projections have one. Block
layouts are those of ``freetoken/quant`` (GGUF's); scales are read byte by byte, so any slot
or row stride works. nvfp4 keeps its scales apart from its codes (:data:`SCALED`): its kernel
takes them through pointers of their own (:func:`gather_gemv_scaled`).

Shapes: P pairs = T tokens x A active; pair p is token p // A's. Weights of a projection:
``data`` uint8 (S, R, K // block * block_bytes), S slots (or experts), R output rows, K inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.kernels.activation import ACTIVATIONS, glu
from freetoken.kernels.build import overlap
from freetoken.kernels.expert_matmul import ExpertBias, gathered
from freetoken.kernels.gemv_launch import FusedKernel, launch_on
from freetoken.quant import QuantTensor, dequantize_as

Act = Callable[[torch.Tensor], torch.Tensor]


def unavailable() -> str | None:
    """Why the fused kernels cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


SCALED = frozenset({"nvfp4"})  # formats whose scales are tensors apart from the codes

def gather_gemv(fmt: str, data: torch.Tensor, index: torch.Tensor, x: torch.Tensor,
                per: int, act: int = 0) -> torch.Tensor:
    """``out[p] = W[index[p]] @ x[p // per]`` for ``fmt`` blocks ``data`` (S, R, K // block *
    block_bytes) uint8 (any slot and row strides), ``index`` (P,) int64, ``x`` (N, K) with
    unit stride along K. Returns (P, R) in ``x``'s dtype. With ``act`` (:func:`glu_code`),
    ``data`` is gate's rows with up's R rows right after them in every slot, and
    ``out[p] = act(gate @ x) * (up @ x)``."""
    from freetoken.kernels import triton_gemv

    if fmt in SCALED:
        raise ValueError(f"{fmt} keeps scales apart from its codes: use gather_gemv_scaled")
    spec = launch_on(fmt, x.device)
    nb = _blocks_per_row(spec, data, x)
    R = data.shape[1]
    out, rows, grid = _launch_shape(spec, index, x, R, act)
    triton_gemv.gather_gemv[grid](
        data, index, x, out, R, per, data.stride(0), data.stride(1), x.stride(0), out.stride(0),
        FMT=fmt, NB=nb, BLOCK_R=rows, STEP=spec.step, ACT=act, BITS=spec.bits,
        SUMS=spec.sums, INT8_X=spec.int8_x, ASM=x.device.type == "cuda", num_warps=spec.warps,
        **overlap(x.device))
    return out


def int8_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slow twin of the kernels' x as int8 blocks (``triton_q8_0x8.int8_blocks``): x (N, K) as
    int8 values (N, K) and float32 scales (N, K // 32), ``d = max |x| / 127`` a block,
    ``q = round(x * (127 / max |x|))`` half to even, 0 for a block of zeros."""
    xb = x.float().unflatten(-1, (-1, 32))
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    q = torch.round(xb * inv[..., None]).to(torch.int8)
    return q.flatten(-2), amax / 127.0


def _launch_shape(spec: FusedKernel, index: torch.Tensor, x: torch.Tensor, R: int,
                  act: int) -> tuple[torch.Tensor, int, tuple[int, int]]:
    """A gather-GEMV launch's output (P, R) in ``x``'s dtype, the output rows a program takes
    (half of ``spec``'s with ``act``: it reads gate's and up's) and the grid."""
    import triton

    out = torch.empty(index.numel(), R, dtype=x.dtype, device=x.device)
    rows = max(1, spec.rows // 2) if act else spec.rows
    return out, rows, (index.numel(), triton.cdiv(R, rows))


def _blocks_per_row(spec: FusedKernel, data: torch.Tensor, x: torch.Tensor) -> int:
    """Blocks in a row of ``data`` (S, R, row bytes), checked against ``x``'s width."""
    row_bytes = data.shape[2]
    nb = row_bytes // spec.block_bytes
    if data.dtype != torch.uint8 or row_bytes % spec.block_bytes or data.stride(2) != 1:
        raise ValueError(f"{spec.fmt} data must be uint8 rows of {spec.block_bytes}-byte blocks, "
                         f"got {data.dtype} {tuple(data.shape)} strides {data.stride()}")
    if x.dim() != 2 or x.shape[1] != nb * spec.block or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not fit {nb * spec.block} inputs")
    return nb


def _scale_views(qt: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """nvfp4 ``qt``'s per-block scales as uint8 (S, R, K // 16), unit stride along a row, its
    global scales and their stride between slots (0: one for every slot)."""
    S, R, K = qt.shape
    ws, ws2 = qt.scales.get("weight_scale"), qt.scales.get("weight_scale_2")
    if ws is None or ws2 is None or ws.dtype != torch.float8_e4m3fn or \
            tuple(ws.shape) != (S, R, K // 16) or ws.stride(2) != 1:
        raise ValueError(f"{qt.fmt} {qt.shape}: want scales weight_scale float8_e4m3fn "
                         f"{(S, R, K // 16)} with unit stride along a row and weight_scale_2, "
                         f"got {({k: (s.dtype, tuple(s.shape)) for k, s in qt.scales.items()})}")
    if ws2.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not (
            ws2.numel() == 1 or (ws2.dim() and ws2.shape[0] == S and ws2[0].numel() == 1)):
        raise ValueError(f"{qt.fmt}: weight_scale_2 must be floats, one for all slots or one "
                         f"per slot, got {ws2.dtype} {tuple(ws2.shape)}")
    g_stride = 0 if ws2.numel() == 1 else ws2.stride(0)
    return ws.view(torch.uint8), ws2, g_stride


def gather_gemv_scaled(w: QuantTensor, index: torch.Tensor, x: torch.Tensor, per: int,
                       act: int = 0, up: QuantTensor | None = None) -> torch.Tensor:
    """:func:`gather_gemv` for a format of :data:`SCALED`: ``w`` (S, R, K) with its codes
    (S, R, K // block * block_bytes) and scales (any slot and row strides). With ``act``, up's
    tensor ``up`` (its codes and scales strided as ``w``'s, anywhere) and
    ``out[p] = act(w @ x) * (up @ x)``."""
    from freetoken.kernels import triton_gemv

    if w.fmt not in SCALED:
        raise ValueError(f"{w.fmt} keeps no scales apart: use gather_gemv")
    spec = launch_on(w.fmt, x.device)
    nb = _blocks_per_row(spec, w.data, x)
    ws, ws2, g_stride = _scale_views(w)
    wu, su, gu = w.data, ws, ws2
    if act:
        if up is None or not paired(w, up):
            raise ValueError("act needs up's tensor, of gate's format, shape and strides")
        wu, su, gu = up.data, *_scale_views(up)[:2]
    elif up is not None:
        raise ValueError("up is read only with act")
    R = w.data.shape[1]
    out, rows, grid = _launch_shape(spec, index, x, R, act)
    triton_gemv.gather_gemv_scaled[grid](
        w.data, ws, ws2, wu, su, gu, index, x, out, R, per, w.data.stride(0), w.data.stride(1),
        ws.stride(0), ws.stride(1), g_stride, x.stride(0), out.stride(0), FMT=w.fmt, NB=nb,
        BLOCK_R=rows, STEP=spec.step, ACT=act, BITS=spec.bits, num_warps=spec.warps,
        **overlap(x.device))
    return out


def paired(gate: QuantTensor, up: QuantTensor) -> bool:
    """Whether ``gate`` and ``up`` (a format of :data:`SCALED`) can share one launch: the same
    format and shape, their codes and scales alike strided."""
    if gate.fmt != up.fmt or gate.fmt not in SCALED or gate.shape != up.shape:
        return False
    if gate.data.stride() != up.data.stride() or gate.scales.keys() != up.scales.keys():
        return False
    return all(s.stride() == up.scales[k].stride() and s.shape == up.scales[k].shape
               for k, s in gate.scales.items())


def gemv(qt: QuantTensor, index: torch.Tensor, x: torch.Tensor, per: int) -> torch.Tensor:
    """``out[p] = W[index[p]] @ x[p // per]`` for the stack ``qt``: its format's kernel."""
    if qt.fmt in SCALED:
        return gather_gemv_scaled(qt, index, x, per)
    return gather_gemv(qt.fmt, qt.data, index, x, per)


DENSE_TOKENS = 8  # rows of x a dense Q8_0x8 product takes through its kernel (decode)


def dense_gemv(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for one Q8_0x8 matrix ``data`` (R, K // 256 * 272) uint8 (unit stride along
    a row) and ``x`` (T, K), T <= :data:`DENSE_TOKENS`, unit stride along K: W read once for
    every row of x. Returns (T, R) in ``x``'s dtype."""
    import triton

    from freetoken.kernels import triton_gemv

    spec = launch_on("q8_0x8", x.device)
    R, row_bytes = data.shape
    T, K = x.shape
    if data.dtype != torch.uint8 or data.stride(1) != 1 or row_bytes * 256 != K * 272 \
            or x.stride(1) != 1 or not 0 < T <= DENSE_TOKENS:
        raise ValueError(f"dense q8_0x8 product of {data.dtype} {tuple(data.shape)} and x "
                         f"{tuple(x.shape)}: want uint8 rows of K // 256 * 272 bytes and at "
                         f"most {DENSE_TOKENS} rows of x with unit strides")
    out = torch.empty(T, R, dtype=x.dtype, device=x.device)
    triton_gemv.dense_gemv[(triton.cdiv(R, spec.rows),)](
        data, x, out, R, T, data.stride(0), x.stride(0), out.stride(0),
        NB=row_bytes // 272, BLOCK_R=spec.rows, STEP=spec.step, TOK=triton.next_power_of_2(T),
        BITS=spec.bits, SUMS=spec.sums, INT8_X=spec.int8_x, ASM=x.device.type == "cuda",
        num_warps=spec.warps, **overlap(x.device))
    return out


def glu_code(act: Act) -> int:
    """The kernels' code for an activation they apply to a gate/up stack themselves (1 silu,
    2 tanh-approximated gelu: ``kernels/activation.py``'s functions), else 0: act(g) * u in
    torch."""
    if act is ACTIVATIONS["silu"]:
        return 1
    if act is ACTIVATIONS["gelu_pytorch_tanh"]:
        return 2
    return 0


def gathered_fused(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, gate: QuantTensor,
                   up: QuantTensor, down: QuantTensor, act: Act,
                   bias: ExpertBias | None = None,
                   table: torch.Tensor | None = None) -> torch.Tensor:
    """Pairs at once, as ``expert_matmul.gathered``, with pair p's expert ``index[p]`` read from the
    stacks gate/up (S, I, H) and down (S, H, I); ``bias`` per pair; with ``table`` (int64), from
    slot ``table[index[p]]`` (-1: the pair adds nothing). x (T, H), w (T, A) -> (T, H). One
    program per pair and block of rows, then the weighted sum (:func:`weighed`)."""
    T, A = w.shape
    both = stacked(gate, up)
    code = glu_code(act)
    slot = None
    if table is not None:
        slot = table[index]
        index = slot.clamp(min=0)  # a pair without a slot reads slot 0, weighed 0
    if both is not None and bias is None and code:  # gate, up and act(g) * u in one launch
        h = gather_gemv(gate.fmt, gate.data, index, x, A, act=code)
    elif paired(gate, up) and bias is None and code:  # the same, up through its own pointers
        h = gather_gemv_scaled(gate, index, x, A, act=code, up=up)
    else:
        if both is not None:  # one launch for both: each row's sum is the same either way
            gu = gather_gemv(gate.fmt, both, index, x, A)
            g, u = gu[:, : gate.data.shape[1]], gu[:, gate.data.shape[1]:]
        else:
            g, u = gemv(gate, index, x, A), gemv(up, index, x, A)
        if bias is not None:
            g, u = g + bias.gate.to(g.dtype), u + bias.up.to(u.dtype)
        h = glu(act, g, u)
    y = gemv(down, index, h, 1)  # (T*A, H)
    if bias is not None:
        y = y + bias.down.to(y.dtype)
    return weighed(y, w, slot)


BLOCK_H = 1024  # output columns a program of :func:`weighed` sums


def weighed(y: torch.Tensor, w: torch.Tensor, slot: torch.Tensor | None = None) -> torch.Tensor:
    """``expert_matmul.weigh_pairs(y, w)`` in one launch (``triton_gemv.weigh_sum``; torch's
    multiply and sum are its slow twin, whose roundings it keeps; the pairs are summed in
    order), pairs whose ``slot`` is negative weighed 0. y (T*A, H) with unit stride along H,
    w (T, A) -> (T, H) in y's dtype."""
    import triton

    from freetoken.kernels import triton_gemv

    T, A = w.shape
    H = y.shape[1]
    if y.stride(1) != 1 or y.shape[0] != T * A:
        raise ValueError(f"pair outputs {tuple(y.shape)} do not fit weights {tuple(w.shape)}")
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    block = min(BLOCK_H, triton.next_power_of_2(H))
    triton_gemv.weigh_sum[(T, triton.cdiv(H, block))](
        y, w.contiguous(), y if slot is None else slot.contiguous(), out, H, y.stride(0),
        out.stride(0), A=A, BLOCK=block, MASK=slot is not None, num_warps=4,
        enable_fp_fusion=False,  # torch rounds each product before the sum: no fused add
        **overlap(y.device))
    return out


def stacked(gate: QuantTensor, up: QuantTensor) -> torch.Tensor | None:
    """gate's and up's blocks as one (S, 2I, row bytes) stack where up's rows follow gate's in
    every slot (as an expert row lays them out: same format, no gap), else None (also for a
    format whose scales are apart: its codes alone do not make a stack)."""
    g, u = gate.data, up.data
    if gate.fmt in SCALED:
        return None
    if gate.fmt != up.fmt or g.shape != u.shape or g.stride() != u.stride() or g.dim() != 3:
        return None
    if g.stride(1) != g.shape[2] or u.data_ptr() != g.data_ptr() + g.shape[1] * g.stride(1):
        return None
    return torch.as_strided(g, (g.shape[0], 2 * g.shape[1], g.shape[2]), g.stride())


def gathered_reference(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor,
                       gate: QuantTensor, up: QuantTensor, down: QuantTensor,
                       act: Act, bias: ExpertBias | None = None,
                       table: torch.Tensor | None = None) -> torch.Tensor:
    """Slow twin, and the path of layers without a fused kernel: the pairs' experts copied
    out, dequantised to ``x``'s dtype, batched matmuls (``expert_matmul.gathered``, so resident's
    bits); ``table`` as :func:`gathered_fused`'s (a pair without a slot weighed 0)."""
    if table is not None:
        slot = table[index]
        w = torch.where((slot >= 0).view(w.shape), w, torch.zeros_like(w))
        index = slot.clamp(min=0)

    def picked(qt: QuantTensor) -> torch.Tensor:
        sub = QuantTensor(qt.fmt, (index.numel(), *qt.shape[1:]), qt.data[index],
                          {k: s[index] for k, s in qt.scales.items()})
        return dequantize_as(sub, x.dtype)

    return gathered(x, w, picked(gate), picked(up), picked(down), act, bias)
