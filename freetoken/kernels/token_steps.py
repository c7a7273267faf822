"""The per-token elementwise steps of a layer as one GPU kernel each (Triton): at decode a
launch costs more than its arithmetic.

- RMSNorm instead of torch's five kernels (pow, mean, add, rsqrt, mul), two to four a layer.
  Its slow twin is ``layers/norm.py:RMSNorm.reference``; the sum of squares is taken in the
  kernel's own order, so the two agree to float32 rounding, not bit for bit.
- Rotary embedding (NeoX halves) instead of seven (two index_selects, casts, cat, neg, two
  muls, add), for q and for k. Its slow twin is ``layers/rotary.py:Rotary.reference``, and the
  kernel rounds where torch's ops round, so compiled the two agree bit for bit.
- The residual add and the RMSNorm after it (a layer's two norms) as one kernel: the sum
  rounded as torch's add rounds it, then the RMSNorm kernel's steps. Its slow twin is the add
  and the norm.
- q_norm, k_norm and rotary on both (Qwen3's attention) as one kernel instead of four: each
  head normalised, rounded as the RMSNorm kernel stores it, then rotated as the rotary kernel
  does. Its slow twin is the four calls; compiled without fused multiply-adds (rotary's
  need), the sums of squares may round apart from the RMSNorm kernel's.
- Routing (softmax, top-k, renormalise, cast) instead of five, from the router's logits. Its
  slow twin is ``models/blocks.py:MoEBlock.choose``: the same experts but where two
  probabilities tie to float32 rounding (the kernel takes the lower id, as the CPU's native
  router does), weights to float32 rounding (its exp is not torch's).
- At decode, the router's matmul and the routing as one kernel (``route_from_hidden``): each
  program sums a few router rows for a token, and the one that completes the token's logits
  routes them. Its slow twin is the matmul, then :func:`route`; the logits are summed in
  another order than the matmul's, so a near tie may pick the other expert.
"""

from __future__ import annotations

import torch

from freetoken import env
from freetoken.kernels.build import KernelSwitch, overlap

MODES = {"qwen": 0, "unit_offset": 1, "float_scale": 2}  # how the scale is applied
MAX_DIM = 16384  # one row per program, held in registers
# one switch for the three: a GPU whose compiler rejects one kernel rejects its kind
SWITCH = KernelSwitch("norms, rotary and routing take the torch path")


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` takes these: a GPU row of at most MAX_DIM, the weight in x's
    dtype (so the output dtype is the torch path's), and no earlier build failure."""
    return (x.is_cuda and SWITCH.on and x.dtype == w.dtype and x.shape[-1] == w.numel()
            <= MAX_DIM)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: str) -> torch.Tensor | None:
    """x (..., dim) normalised and scaled by w (dim,) as ``mode`` says; None when the kernel
    failed to build (logged once; the caller takes the torch path)."""
    import triton

    from freetoken.kernels import triton_token_steps

    dim = x.shape[-1]
    if x.dim() == 3 and x.stride(2) == 1:  # (T, heads, dim) at its strides: no copy
        rows, heads, tok, head = x, x.shape[1], x.stride(0), x.stride(1)
    else:
        rows = x.reshape(-1, dim)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        heads, tok, head = 1, rows.stride(0), 0
    n = x.numel() // dim
    out = torch.empty(n, dim, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(dim)

    def launch() -> None:
        triton_token_steps.rms_norm[(n,)](
            rows, w, out, dim, heads, tok, head, out.stride(0), eps, MODE=MODES[mode],
            BLOCK=block, num_warps=max(1, min(8, block // 256)), **overlap(x.device))

    return out.view(x.shape) if n == 0 or SWITCH.launch(launch, "RMSNorm") else None


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float,
                 mode: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """h = x + a and h normalised and scaled by w (:func:`rms_norm`), both (T, dim) in x's
    dtype, in one launch; None when the kernel failed to build (logged once). x and a:
    (T, dim) rows of unit stride, a in x's dtype."""
    import triton

    from freetoken.kernels import triton_token_steps

    T, dim = x.shape
    h = torch.empty_like(x)
    out = torch.empty_like(x)
    block = triton.next_power_of_2(dim)

    def launch() -> None:
        triton_token_steps.add_rms_norm[(T,)](
            x, a, w, h, out, dim, x.stride(0), a.stride(0), h.stride(0), out.stride(0), eps,
            MODE=MODES[mode], BLOCK=block, num_warps=max(1, min(8, block // 256)),
            **overlap(x.device))

    return (h, out) if T == 0 or SWITCH.launch(launch, "residual add and RMSNorm") else None


def add_usable(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`add_rms_norm` takes these: (T, dim) rows of unit stride in one dtype
    that :func:`rms_norm` would take."""
    return (usable(x, w) and x.dim() == 2 and a.shape == x.shape and a.dtype == x.dtype
            and a.is_cuda and x.stride(1) == 1 and a.stride(1) == 1)


def rotary_usable(x: torch.Tensor, cos: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether :func:`rotary` takes these: GPU (T, heads, D) rows, float32 tables of D
    columns, one position per token, no earlier build failure."""
    return (x.is_cuda and SWITCH.on and x.dim() == 3 and x.shape[2] % 2 == 0
            and cos.dtype is torch.float32 and cos.shape[-1] == x.shape[2]
            and positions.numel() == x.shape[0] and x.stride(2) == 1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor | None:
    """x (T, heads, D) rotated at ``positions`` by the (positions, 1, D) tables; None when the
    kernel failed to build (logged once)."""
    import triton

    from freetoken.kernels import triton_token_steps

    T, heads, D = x.shape
    out = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    pos = positions.reshape(-1)

    def launch() -> None:
        triton_token_steps.rotary_neox[(T, heads)](
            x, cos, sin, pos, out, heads, x.stride(0), x.stride(1), out.stride(0),
            HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2),
            ROUND=x.dtype != torch.float32, num_warps=1,
            enable_fp_fusion=False,  # torch's float32 path multiplies, rounds, then adds
            **overlap(x.device))

    return out if T == 0 or SWITCH.launch(launch, "rotary") else None


def norm_rotary_usable(qk: torch.Tensor, n_q: int, cos: torch.Tensor,
                       positions: torch.Tensor) -> bool:
    """Whether :func:`norm_rotary` takes these: GPU (T, heads, D) q-then-k heads, one position a
    token, float32 tables of D columns, no earlier build failure."""
    return (qk.is_cuda and SWITCH.on and qk.dim() == 3 and qk.stride(2) == 1
            and qk.stride(1) == qk.shape[2] and qk.shape[2] % 2 == 0 and 0 < n_q < qk.shape[1]
            and cos.dtype is torch.float32 and cos.shape[-1] == qk.shape[2]
            and positions.numel() == qk.shape[0])


def norm_rotary(qk: torch.Tensor, n_q: int, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
                mode: str, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q (the first ``n_q`` heads of ``qk`` (T, heads, D)) and k (the rest), each head
    normalised by its weight (``q_w``, ``k_w`` (D,)) and rotated at ``positions``: (T, n_q, D)
    and (T, heads - n_q, D); None when the kernel failed to build (logged once)."""
    import triton

    from freetoken.kernels import triton_token_steps

    T, heads, D = qk.shape
    q = torch.empty(T, n_q, D, dtype=qk.dtype, device=qk.device)
    k = torch.empty(T, heads - n_q, D, dtype=qk.dtype, device=qk.device)
    pos = positions.reshape(-1)

    def launch() -> None:
        triton_token_steps.norm_rotary[(T, heads)](
            qk, q_w, k_w, cos, sin, pos, q, k, n_q, qk.stride(0), q.stride(0), k.stride(0), eps,
            MODE=MODES[mode], HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2),
            ROUND=qk.dtype != torch.float32, num_warps=1, enable_fp_fusion=False,
            **overlap(qk.device))

    return (q, k) if T == 0 or SWITCH.launch(launch, "norm and rotary") else None


MAX_EXPERTS = 1024  # router logits of one token in one program


def route_usable(logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`route` takes these: GPU (T, E) logits, E at most MAX_EXPERTS, k <= E."""
    return (logits.is_cuda and SWITCH.on and logits.dim() == 2
            and top_k <= logits.shape[1] <= MAX_EXPERTS and logits.stride(1) == 1)


def route(logits: torch.Tensor, top_k: int, renormalise: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-k expert ids (T, k) int64 and weights (T, k) in ``dtype`` from router logits
    (T, E); None when the kernel failed to build (logged once)."""
    import triton

    from freetoken.kernels import triton_token_steps

    T, E = logits.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=dtype, device=logits.device)

    def launch() -> None:
        triton_token_steps.route_topk[(T,)](
            logits, ids, weights, E, logits.stride(0), K=top_k,
            KB=triton.next_power_of_2(top_k), BLOCK=triton.next_power_of_2(E),
            NORM=renormalise, num_warps=1 if E <= 256 else 4, **overlap(logits.device))

    return (ids, weights) if T == 0 or SWITCH.launch(launch, "routing") else None


ROUTE_TOKENS = 8  # tokens of a decode step whose router matmul runs in the routing kernel
ROUTE_ROWS = 4  # router rows a program sums
_COUNTS: dict[torch.device, torch.Tensor] = {}  # per GPU: programs done, per token


def route_from_hidden_usable(x: torch.Tensor, gate: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`route_from_hidden` takes these (FREETOKEN_GPU_ROUTER=fused): at most
    ROUTE_TOKENS GPU rows x (T, H) with unit stride, a router weight (E, H) contiguous in
    x's dtype, k <= E <= MAX_EXPERTS."""
    return (x.is_cuda and SWITCH.on and env.gpu_router() == "fused" and x.dim() == 2
            and 0 < x.shape[0] <= ROUTE_TOKENS
            and x.stride(1) == 1 and gate.dim() == 2 and gate.shape[1] == x.shape[1]
            and gate.dtype == x.dtype and gate.is_contiguous() and gate.device == x.device
            and top_k <= gate.shape[0] <= MAX_EXPERTS)


def _counts(device: torch.device) -> torch.Tensor | None:
    """The device's per-token counters (zero between launches: the last program of a token
    sets its counter back). Made outside a graph capture, so a capture finds them made (the
    eager warm-up before it routes first); None inside a capture that has none yet."""
    counts = _COUNTS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _COUNTS[device] = torch.zeros(ROUTE_TOKENS, dtype=torch.int32, device=device)
    return counts


def route_from_hidden(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalise: bool,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-k expert ids (T, k) int64 and weights (T, k) in ``dtype`` from hidden rows x (T, H)
    and the router's weight (E, H) in one launch; None when the kernel failed to build
    (logged once) or has no counters yet inside a capture (the caller takes the matmul and
    :func:`route`). The launches on a device run one after another (one stream): they share
    its counters."""
    import triton

    from freetoken.kernels import triton_token_steps

    T, H = x.shape
    E = gate.shape[0]
    counts = _counts(x.device)
    if counts is None:
        return None
    logits = torch.empty(T, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=dtype, device=x.device)

    def launch() -> None:
        triton_token_steps.route_hidden[(T, triton.cdiv(E, ROUTE_ROWS))](
            x, gate, logits, counts, ids, weights, H, E, x.stride(0), K=top_k,
            KB=triton.next_power_of_2(top_k), BLOCK=triton.next_power_of_2(E), ROWS=ROUTE_ROWS,
            BLOCK_H=min(512, triton.next_power_of_2(H)), NORM=renormalise, num_warps=4,
            **overlap(x.device))

    return (ids, weights) if SWITCH.launch(launch, "router and routing") else None
