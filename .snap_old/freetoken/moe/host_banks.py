"""Host expert banks: a layer's experts in host memory in their checkpoint format.

A bank is one contiguous region per layer, expert-major: row e holds expert e's gate_proj,
up_proj and down_proj (each its data and any scale tensors, 64-byte aligned), so one miss is one
copy of one row. On CUDA the region is pinned (page-locked) so the copy runs at full PCIe speed;
on the CPU it is huge-page host memory. Banks are filled straight from the checkpoint's mmap
views; no second full copy of the weights is held in RAM.

:class:`BankBuilder` collects a layer's expert tensors as the loader hands them over (stacked,
fused gate_up, or one expert at a time), :class:`ExpertLayout` says where each piece of an
expert lives inside a row and turns rows back into tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from freetoken.checkpoint.base import Checkpoint
from freetoken.cpu.host_memory import host_buffer
from freetoken.errors import ConfigError
from freetoken.moe.layer_kind import formats_in_words
from freetoken.quant import QuantTensor, dequantize_as

log = logging.getLogger(__name__)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ALIGN = 64
_FLOAT_FORMATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Part:
    """One tensor of one projection inside an expert's row: the data or a scale tensor."""

    proj: str
    key: str  # "data" or the scale's name
    dtype: torch.dtype
    shape: tuple[int, ...]  # per expert
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ExpertLayout:
    """Where each piece of one expert lives in a bank row (and in a cache slot)."""

    formats: tuple[str, str, str]  # per projection, in PROJECTIONS order
    shapes: tuple[tuple[int, int], ...]  # logical (rows, cols) per projection
    parts: tuple[Part, ...]
    row_bytes: int

    @property
    def kind(self) -> str:
        """The formats in words, e.g. ``q8_0`` or ``gate/up q4_k, down q6_k``."""
        return formats_in_words(*self.formats)

    def quant(self, rows: torch.Tensor, proj: str) -> QuantTensor:
        """Projection ``proj`` of the experts in ``rows`` (n, row_bytes) uint8, or of one
        expert when ``rows`` is a single row (row_bytes,), as a zero-copy QuantTensor."""
        i = PROJECTIONS.index(proj)
        lead = tuple(rows.shape[:-1])
        tensors = {}
        for p in self.parts:
            if p.proj == proj:
                raw = rows[..., p.offset : p.offset + p.nbytes]
                tensors[p.key] = raw.view(p.dtype).view(*lead, *p.shape)
        data = tensors.pop("data")
        return QuantTensor(self.formats[i], (*lead, *self.shapes[i]), data, tensors)

    def weight(self, rows: torch.Tensor, proj: str, dtype: torch.dtype) -> torch.Tensor:
        """Projection ``proj`` of ``rows`` in ``dtype``, the same values the resident strategy
        holds: plain floats are cast, block formats dequantised by their reference."""
        qt = self.quant(rows, proj)
        if qt.fmt in _FLOAT_FORMATS:
            return qt.data if qt.data.dtype == dtype else qt.data.to(dtype)
        return dequantize_as(qt, dtype)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def split_rows(qt: QuantTensor, rows: int) -> tuple[QuantTensor, QuantTensor]:
    """A fused (E, 2I, H) gate_up tensor as its gate (first I rows) and up halves."""
    E, both, cols = qt.shape
    if both != 2 * rows:
        raise ValueError(f"gate_up_proj has {both} rows per expert, want {2 * rows}")
    if qt.fmt == "fp8_block" and rows % 128:
        raise ValueError(f"fp8_block gate_up_proj: {rows} rows do not split on 128-row tiles")
    halves = []
    for lo, hi in ((0, rows), (rows, both)):
        scales = {}
        for k, s in qt.scales.items():
            if s.dim() == 3:
                cut = (lo // 128, -(-hi // 128)) if qt.fmt == "fp8_block" else (lo, hi)
                s = s[:, cut[0] : cut[1]]
            scales[k] = s
        halves.append(QuantTensor(qt.fmt, (E, hi - lo, cols), qt.data[:, lo:hi], scales))
    return halves[0], halves[1]


class BankBuilder:
    """Collects one layer's expert tensors as the loader hands them over, then builds its bank.

    Tensors are kept as the checkpoint's zero-copy views until :meth:`build`.
    """

    def __init__(self, layer: int, num_experts: int, hidden: int, intermediate: int) -> None:
        self.layer, self.E, self.H, self.I = layer, num_experts, hidden, intermediate
        self.stacked: dict[str, QuantTensor] = {}
        self.per_expert: dict[str, list[QuantTensor | None]] = {}

    def want(self, proj: str) -> tuple[int, int]:
        return (self.H, self.I) if proj == "down_proj" else (self.I, self.H)

    def add(self, proj: str, qt: QuantTensor, expert: int | None = None) -> bool:
        """Keep one checkpoint tensor: ``proj`` is gate_proj, up_proj, down_proj or (stacked
        only) gate_up_proj; ``expert`` names the expert of a per-expert tensor."""
        if proj == "gate_up_proj" and expert is None:
            gate, up = split_rows(qt, self.I)
            return self.add("gate_proj", gate) and self.add("up_proj", up)
        if proj not in PROJECTIONS:
            raise ValueError(f"layer {self.layer}: no expert projection {proj!r}")
        want = self.want(proj)
        if expert is None:
            if tuple(qt.shape) != (self.E, *want):
                raise ValueError(f"layer {self.layer} {proj}: shape {qt.shape}, the config "
                                 f"implies {(self.E, *want)}")
            self.stacked[proj] = qt
        else:
            if tuple(qt.shape) != want or not 0 <= expert < self.E:
                raise ValueError(f"layer {self.layer} {proj} expert {expert}: shape "
                                 f"{qt.shape}, the config implies {want} for {self.E} experts")
            self.per_expert.setdefault(proj, [None] * self.E)[expert] = qt
        return True

    def missing(self) -> list[str]:
        """What the checkpoint has not provided yet, e.g. ``['down_proj', 'up_proj[3]']``."""
        out = []
        for proj in PROJECTIONS:
            if proj in self.stacked:
                continue
            per = self.per_expert.get(proj)
            if per is None:
                out.append(proj)
            else:
                out += [f"{proj}[{e}]" for e, t in enumerate(per) if t is None]
        return out

    def expert(self, proj: str, e: int) -> QuantTensor:
        """Expert ``e``'s tensor of ``proj`` (a view), scales sliced or shared."""
        if proj in self.stacked:
            qt = self.stacked[proj]
            scales = {k: s[e] if s.dim() and s.shape[0] == self.E else s
                      for k, s in qt.scales.items()}
            return QuantTensor(qt.fmt, qt.shape[1:], qt.data[e], scales)
        qt = self.per_expert[proj][e]
        assert qt is not None
        return qt

    def layout(self) -> ExpertLayout:
        parts: list[Part] = []
        offset = 0
        formats, shapes = [], []
        for proj in PROJECTIONS:
            qt = self.expert(proj, 0)
            formats.append(qt.fmt)
            shapes.append(tuple(qt.shape))
            for key, t in (("data", qt.data), *sorted(qt.scales.items())):
                shape = tuple(t.shape) if t.numel() > 1 else (1, 1)
                nbytes = t.numel() * t.element_size()
                parts.append(Part(proj, key, t.dtype, shape, offset, nbytes))
                offset = _align(offset + nbytes)
        return ExpertLayout(tuple(formats), tuple(shapes), tuple(parts),  # type: ignore[arg-type]
                            offset)

    def build(self, pinned: bool, device: torch.device | None = None) -> HostBank:
        """Copy every expert into one new region: host memory (pinned for CUDA copies when
        ``pinned``), or on ``device`` when it is a GPU (resident experts kept as blocks)."""
        missing = self.missing()
        if missing:
            raise ConfigError(f"layer {self.layer}: the checkpoint lacks expert weights "
                              f"{', '.join(missing[:5])}")
        layout = self.layout()
        nbytes = self.E * layout.row_bytes
        rows = (torch.empty(nbytes, dtype=torch.uint8, device=device)
                if device is not None and device.type != "cpu"
                else allocate_bank(nbytes, pinned, self.layer)).view(self.E, layout.row_bytes)
        for e in range(self.E):
            for p in layout.parts:
                qt = self.expert(p.proj, e)
                src = qt.data if p.key == "data" else qt.scales[p.key]
                dst = rows[e, p.offset : p.offset + p.nbytes].view(p.dtype)
                dst.copy_(src.reshape(-1))
        self.stacked.clear()
        self.per_expert.clear()
        return HostBank(self.layer, layout, rows)


@dataclass
class HostBank:
    """One layer's experts in host memory: ``rows`` (E, row_bytes) uint8."""

    layer: int
    layout: ExpertLayout
    rows: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.rows.shape[0]

    @property
    def expert_bytes(self) -> int:
        return self.layout.row_bytes


def allocate_bank(nbytes: int, pinned: bool, layer: int) -> torch.Tensor:
    """``nbytes`` of host memory for one layer's bank; a clear error when memory is short."""
    try:
        if pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return host_buffer(nbytes)
    except (RuntimeError, MemoryError) as e:
        kind = "pinned (page-locked) host memory" if pinned else "host memory"
        raise ConfigError(
            f"could not allocate {nbytes / 1e9:.2f} GB of {kind} for the experts of layer "
            f"{layer} ({e}); free RAM, raise the locked-memory limit (ulimit -l), or keep more "
            "experts on the GPU (--moe-strategy resident)") from e


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (page cache counts as available), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(needed: int, available: int | None = None) -> None:
    """Refuse to start when the banks cannot fit in RAM, naming both sizes."""
    available = available_host_bytes() if available is None else available
    if needed > available:
        raise ConfigError(
            f"the expert banks need {needed / 1e9:.1f} GB of host RAM but only "
            f"{available / 1e9:.1f} GB is available; free memory or use a machine with more "
            "RAM (or --moe-strategy resident if the model fits on the GPU)")


def expert_bytes(ckpt: Checkpoint) -> int:
    """Bytes of every expert tensor of a checkpoint, read from its index, not its data."""
    return sum(t.nbytes for t in ckpt.tensor_infos() if ".experts." in t.name)
