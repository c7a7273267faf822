"""CPU MoE and gather bandwidth of one MoE layer kind, on synthetic expert banks.

A bank holds E synthetic experts in the kind's formats, laid out by :class:`BankBuilder` as the
serving banks are, with unit scales in block formats (a zero-filled scale is 0, or the denormal
2**-127 in e8m0, and denormal weights slow the CPU kernels several-fold). :class:`LayerBench`
measures, each over a wall-clock window:

- CPU MoE: decode-like calls (1..4 tokens, top-k distinct random experts per token) on the CPU
  executor, which reads the bank in place; GB/s = expert weight bytes the kernels read / time.
- Gather: the distinct experts of such calls copied bank row -> device slot by
  :meth:`OffloadRuntime.copy` (the copy stream on CUDA, memcpy on the CPU); GB/s = bytes / the
  copies' own time.
- Overlapped: both loops at once for the same window, the CPU one on a helper thread, so each
  rate is measured while the other side is busy throughout (in lockstep steps the faster side
  would idle at the end of each step and its rate would mix busy and idle time).
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.cores import usable_cores
from freetoken.errors import ConfigError
from freetoken.moe.expert_cache import ExpertCache, PoolPlan
from freetoken.moe.host_banks import (
    PROJECTIONS,
    BankBuilder,
    HostBank,
    allocate_bank,
    available_host_bytes,
)
from freetoken.moe.offload import OffloadRuntime
from freetoken.moe.profile import LayerKind
from freetoken.moe.stats import MoEStats
from freetoken.moe.strategy import ExpertShape
from freetoken.quant import QuantTensor, format_for_gguf_type, get_format
from freetoken.quant.floats import to_bf16

BATCHES = (1, 2, 3, 4)  # tokens per decode-like call, cycled
WORKING_SET_L3 = 8  # a bank is at least this many times the L3, so weights come from DRAM
DISTINCT = 4  # experts with their own random bytes; the rest of the bank repeats them
WARMUP_CALLS = 4
MIN_CALLS = 3
_F16_ONE = b"\x00\x3c"
# Byte offset and value of each scale field of one block, set to 1.0: with random bytes
# elsewhere every weight is then a small finite number.
UNIT_SCALES: dict[str, tuple[tuple[int, bytes], ...]] = {
    "q8_0": ((0, _F16_ONE),),
    "q4_0": ((0, _F16_ONE),),
    "q5_0": ((0, _F16_ONE),),
    "q4_k": ((0, _F16_ONE), (2, _F16_ONE)),  # d, dmin
    "q6_k": ((208, _F16_ONE),),
    "mxfp4": ((0, bytes([127])),),  # e8m0: 2**0
}


def kind_name(kind: LayerKind) -> str:
    """The kind's row key without the thread count, e.g. ``bf16:2048x768:top8``."""
    return kind.key(1).rsplit(":", 1)[0]


def projection_formats(kind: LayerKind) -> tuple[str, str, str]:
    """The weight format of gate_proj, up_proj and down_proj of a layer of this kind."""
    opts = dict(kind.options)
    if kind.fmt == "gguf":
        def name(key: str) -> str:
            return format_for_gguf_type(int(opts[key])).name

        gate = name("gate_up_type" if "gate_up_type" in opts else "gate_type")
        up = name("gate_up_type" if "gate_up_type" in opts else "up_type")
        return gate, up, name("down_type")
    if kind.fmt == "mixed":
        return opts["gate"], opts["up"], opts["down"]
    return kind.fmt, kind.fmt, kind.fmt


# GPT-OSS's clamped SwiGLU (alpha, limit) as its configs give it: what a biased, clamped
# kind is benched with (the kernels' time does not depend on the values)
BENCH_SWIGLU = (1.702, 7.0)


def cpu_kernel_missing(kind: LayerKind, activation: str, bias: bool = False) -> str | None:
    """Why the CPU executor cannot run layers of this kind with ``activation`` (and biases
    when ``bias``), or None when it can."""
    shape = ExpertShape(0, 1, kind.hidden, kind.moe_intermediate, kind.top_k, activation, bias,
                        *BENCH_SWIGLU)
    why = shape.native_missing()
    if why is not None:
        return f"there is no CPU rate to bench: {why}"
    try:
        formats = projection_formats(kind)
    except (KeyError, ValueError) as e:
        return f"its formats cannot be read from the key ({e})"
    absent = sorted({f for f in formats if f not in cx.FORMATS})
    if absent:
        return (f"no CPU kernel for {', '.join(absent)} (CPU kernels: "
                f"{', '.join(cx.FORMATS)})")
    if activation not in cx.EXPERT_ACTIVATIONS:
        return (f"no CPU kernel for the activation {activation!r} (CPU kernels: "
                f"{', '.join(cx.EXPERT_ACTIVATIONS)})")
    return None


def unit_weights(fmt: str, experts: int, rows: int, cols: int,
                 gen: torch.Generator) -> QuantTensor:
    """Random (experts, rows, cols) weights in ``fmt``, written as bytes: GGUF blocks are random
    bytes with every scale 1.0, nvfp4 random codes with unit scales, floats and fp8 a normal
    draw; any other format quantises a normal draw."""
    shape = (experts, rows, cols)
    q = get_format(fmt)
    if fmt in UNIT_SCALES:
        data = torch.randint(0, 256, (experts, rows, q.row_bytes(cols)), dtype=torch.uint8,
                             generator=gen)
        blocks = data.view(experts, rows, -1, q.block_bytes)
        for offset, value in UNIT_SCALES[fmt]:
            blocks[..., offset:offset + len(value)] = torch.tensor(list(value), dtype=torch.uint8)
        return QuantTensor(fmt, shape, data)
    normal = torch.randn(shape, generator=gen) / math.sqrt(cols)
    if fmt == "bf16":
        return QuantTensor(fmt, shape, to_bf16(normal))
    if fmt == "nvfp4":
        data = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8, generator=gen)
        scale = torch.ones(experts, rows, cols // 16).to(torch.float8_e4m3fn)
        return QuantTensor(fmt, shape, data, {"weight_scale": scale,
                                              "weight_scale_2": torch.tensor(1.0)})
    if fmt == "fp8_block":
        tiles = torch.ones(experts, -(-rows // 128), -(-cols // 128))
        return QuantTensor(fmt, shape, (normal * 64).to(torch.float8_e4m3fn),
                           {"weight_scale_inv": tiles})
    return q.quantize(normal)


def l3_bytes() -> int:
    """Size of cpu0's largest cache level (sysfs); 32 MiB when it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=32 << 20)


def working_set_experts(row_bytes: int, at_least: int, l3: int | None = None) -> int:
    """Experts in a bank: the layer's own count, or more so the bank is WORKING_SET_L3 x L3."""
    l3 = l3_bytes() if l3 is None else l3
    return max(at_least, math.ceil(WORKING_SET_L3 * l3 / row_bytes))


def synthetic_bank(kind: LayerKind, experts: int | None, layer_experts: int, pinned: bool,
                   seed: int = 0) -> HostBank:
    """A bank of synthetic experts of ``kind``: ``experts`` of them, or (None) the
    :func:`working_set_experts` count. Pinned for CUDA copies when ``pinned``.

    DISTINCT experts get their own random bytes through :class:`BankBuilder`; the bank repeats
    them, so every expert has its own memory without drawing random numbers for all of them.
    """
    gen = torch.Generator().manual_seed(seed)
    few = DISTINCT if experts is None else min(DISTINCT, experts)
    builder = BankBuilder(0, few, kind.hidden, kind.moe_intermediate)
    for proj, fmt in zip(PROJECTIONS, projection_formats(kind), strict=True):
        builder.add(proj, unit_weights(fmt, few, *builder.want(proj), gen))
    seed_bank = builder.build(pinned=False)
    row = seed_bank.expert_bytes
    n = working_set_experts(row, layer_experts) if experts is None else experts
    needed, available = n * row, available_host_bytes()
    if needed > available:
        raise ConfigError(f"{kind_name(kind)}: a bank of {n} experts needs "
                          f"{needed / 1e9:.1f} GB of host RAM but {available / 1e9:.1f} GB is "
                          "available; pass --experts with fewer experts")
    rows = allocate_bank(n * row, pinned, 0).view(n, row)
    whole = n // few * few
    rows[:whole].view(-1, few, row).copy_(seed_bank.rows.expand(n // few, few, row))
    rows[whole:].copy_(seed_bank.rows[: n - whole])
    return HostBank(0, seed_bank.layout, rows)


class Call(NamedTuple):
    """One decode-like call: hidden (T, H), ids and weights (T, A), the distinct experts."""

    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    experts: list[int]


def draw_calls(experts: int, top_k: int, hidden: int, n: int = 64, seed: int = 0) -> list[Call]:
    """``n`` calls cycling over BATCHES tokens, each token on top_k distinct random experts;
    drawn up front so the loops time the work, not the draws."""
    gen = torch.Generator().manual_seed(seed)
    calls = []
    for i in range(n):
        T = BATCHES[i % len(BATCHES)]
        ids = torch.rand(T, experts, generator=gen).topk(top_k, -1).indices
        weights = torch.softmax(torch.randn(T, top_k, generator=gen), -1)
        x = torch.randn(T, hidden, generator=gen)
        calls.append(Call(x, ids, weights, sorted(set(ids.flatten().tolist()))))
    return calls


@dataclass(frozen=True)
class Bandwidth:
    """GB/s of one layer kind: each side alone and both at once."""

    cpu_gbps: float
    pcie_gbps: float
    cpu_overlapped_gbps: float
    pcie_overlapped_gbps: float


class LayerBench:
    """One synthetic bank on the CPU executor (as layer ``layer``) and behind a gather runtime
    on ``device``. Methods run on the calling thread; the executor stays the caller's."""

    def __init__(self, kind: LayerKind, bank: HostBank, executor: cx.CpuMoeExecutor,
                 device: torch.device, activation: str = "silu", layer: int = 0,
                 bias: bool = False) -> None:
        self.bank, self.ex, self.layer = bank, executor, layer
        lay = bank.layout
        gate, up, down = (cx.ExpertStack.from_quant(lay.quant(bank.rows, p)) for p in PROJECTIONS)
        E, H, I_ = bank.num_experts, kind.hidden, kind.moe_intermediate
        biases = (torch.zeros(E, I_), torch.zeros(E, I_), torch.zeros(E, H)) if bias else None
        self.kernels = executor.add_layer(
            layer, gate, up, down, activation=activation, bias=biases,
            swiglu=BENCH_SWIGLU if activation == "swiglu_oai" else None).kernels
        self.calls = draw_calls(E, kind.top_k, kind.hidden)
        slots = min(E, kind.top_k * max(BATCHES))
        cache = ExpertCache([PoolPlan(lay.row_bytes, slots, (layer,))], {layer: E}, device)
        self.slots = cache.pool(layer).data
        stats = MoEStats([layer], device.type == "cuda")
        self.runtime = OffloadRuntime(cache, stats, device)

    def cpu(self, seconds: float) -> float:
        """CPU MoE GB/s alone."""
        self._cpu_loop(0.0, WARMUP_CALLS)
        nbytes, dt = self._cpu_loop(seconds)
        return nbytes / dt / 1e9

    def gather(self, seconds: float) -> float:
        """Gather GB/s alone."""
        self._gather_loop(0.0, WARMUP_CALLS)
        nbytes, dt = self._gather_loop(seconds)
        return nbytes / dt / 1e9

    def overlapped(self, seconds: float) -> tuple[float, float]:
        """(CPU MoE, gather) GB/s, both running for the same window."""
        go = threading.Event()
        out: dict[str, tuple[int, float] | BaseException] = {}
        spare = sorted(set(usable_cores()) - set(self.ex.cores))

        def cpu_side() -> None:
            go.wait()
            try:
                if spare:  # its waits spin briefly: keep them off the workers' cores
                    os.sched_setaffinity(0, spare)
                out["cpu"] = self._cpu_loop(seconds)
            except BaseException as e:  # re-raised on the caller's thread
                out["cpu"] = e

        helper = threading.Thread(target=cpu_side, name="bench-bw-cpu", daemon=True)
        helper.start()
        go.set()
        try:
            gbytes, gdt = self._gather_loop(seconds)
        finally:
            helper.join()
        cpu = out["cpu"]
        if isinstance(cpu, BaseException):
            raise cpu
        return cpu[0] / cpu[1] / 1e9, gbytes / gdt / 1e9

    def measure(self, seconds: float) -> Bandwidth:
        """All three measurements, ``seconds`` each."""
        return Bandwidth(self.cpu(seconds), self.gather(seconds), *self.overlapped(seconds))

    def _cpu_loop(self, seconds: float, min_calls: int = MIN_CALLS) -> tuple[int, float]:
        """(weight bytes read, seconds) of back-to-back calls for ``seconds``."""
        nbytes = n = 0
        t0 = time.perf_counter()
        while n < min_calls or time.perf_counter() - t0 < seconds:
            call = self.calls[n % len(self.calls)]
            fut = self.ex.submit(call.hidden, call.ids, call.weights, self.layer)
            fut.wait()
            nbytes += fut.weight_bytes
            n += 1
        return nbytes, time.perf_counter() - t0

    def _gather_loop(self, seconds: float, min_calls: int = MIN_CALLS) -> tuple[int, float]:
        """(bytes copied, seconds the copies took) of back-to-back gathers for ``seconds``."""
        rt, stream = self.runtime, self.runtime.copy_stream
        nbytes, busy, n = 0, 0.0, 0
        t0 = time.perf_counter()
        while n < min_calls or time.perf_counter() - t0 < seconds:
            experts = self.calls[n % len(self.calls)].experts
            span, _ = rt.copy(self.slots, list(range(len(experts))), self.bank, experts)
            if stream is not None:
                done = torch.cuda.Event(blocking=True)  # the host sleeps, it does not spin
                done.record(stream)
                done.synchronize()
            busy += span.done() or 0.0
            nbytes += len(experts) * self.bank.expert_bytes
            n += 1
        return nbytes, max(busy, 1e-9)
