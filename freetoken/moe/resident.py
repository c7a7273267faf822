"""Resident strategy: every expert of the layer on the compute device.

Two ways to hold them:
- **blocks** (a GPU, every projection in a format with a fused kernel, triton present): the
  checkpoint's blocks as they are, one row per expert laid out as an expert cache slot
  (``moe/host_banks.py:ExpertLayout``). Decode reads the chosen experts' blocks in place
  through the fused gather-GEMV kernels (``kernels/gather_gemv.py``), prefill dequantises one
  expert at a time. That is offload's compute on its slots: same kernels, same bits, and the
  file's bytes on the device instead of twice them at bf16.
- **parameters** (the CPU, float checkpoints, formats without a kernel): gate_proj, up_proj
  (E, I, H) and down_proj (E, H, I) dequantised to the compute dtype at load, through the torch
  paths of ``kernels/expert_matmul.py`` that offload's dequantise path shares.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from freetoken import env
from freetoken.kernels.activation import expert_activation, glu
from freetoken.kernels.build import raised_by_triton
from freetoken.kernels.expert_matmul import Weights, gathered, grouped, use_gather
from freetoken.kernels.gather_gemv import gathered_fused, gathered_reference, unavailable
from freetoken.kernels.gemv_launch import fused
from freetoken.moe.host_banks import PROJECTIONS, BankBuilder, HostBank
from freetoken.moe.strategy import Experts, ExpertShape
from freetoken.quant import QuantTensor, dequantize_as
from freetoken.quant.q8_0x8 import regroup, regroups

log = logging.getLogger(__name__)


def keeps_blocks(device: torch.device) -> bool:
    """Whether resident experts built on ``device`` keep their checkpoint blocks (where the
    formats allow): on a GPU with triton, unless FREETOKEN_GPU_EXPERT_KERNEL=dequant."""
    return device.type == "cuda" and env.gpu_expert_kernel() != "dequant" \
        and unavailable() is None


class ResidentExperts(Experts):
    """The layer's experts on the model's device, as blocks or as parameters (module doc)."""

    def __init__(self, shape: ExpertShape) -> None:
        super().__init__()
        self.shape = shape
        self.act = expert_activation(shape.activation, shape.swiglu_alpha, shape.swiglu_limit)
        self.make_bias()
        self.device = torch.empty(0).device  # the device the model is being built on
        self.dtype = torch.get_default_dtype()
        self.blocks: HostBank | None = None  # (E, row_bytes) on the device, when kept as blocks
        self.gpu_kernel = "fused"  # "dequant" once a fused kernel failed to build
        self._views: dict[str, QuantTensor] = {}
        self._builder: BankBuilder | None = None
        if keeps_blocks(self.device):
            self._builder = BankBuilder(shape.layer, shape.num_experts, shape.hidden,
                                        shape.intermediate)
        else:
            self._make_parameters()

    def _make_parameters(self) -> None:
        E, H, I_ = self.shape.num_experts, self.shape.hidden, self.shape.intermediate
        for name, rows, cols in (("gate_proj", I_, H), ("up_proj", I_, H), ("down_proj", H, I_)):
            self.register_parameter(name, nn.Parameter(
                torch.empty(E, rows, cols, dtype=self.dtype, device=self.device),
                requires_grad=False))

    # -- loading (blocks only: with parameters the loader fills them) --

    def load_expert_tensor(self, proj: str, qt: QuantTensor, expert: int | None = None) -> bool:
        """Keep a checkpoint tensor for the blocks; once the last one is in, the layer's
        rows go to the device, or, where a format has no fused kernel, the tensors are
        dequantised into parameters instead. False (the loader's parameters) without blocks."""
        b = self._builder
        if b is None:
            return False
        b.add(proj, qt, expert)
        if b.missing():
            return True
        self._builder = None
        formats = tuple(b.expert(p, 0).fmt for p in PROJECTIONS)
        if fused(formats):
            self.blocks = b.build(pinned=False, device=self.device)
            if env.resident_blocks() == "regrouped":
                self.blocks = regrouped(self.blocks)
            return True
        self._make_parameters()
        with torch.no_grad():
            for p in PROJECTIONS:
                param = getattr(self, p)
                for e in range(self.shape.num_experts):
                    param[e].copy_(dequantize_as(_on(b.expert(p, e), self.device), self.dtype))
        return True

    def missing_expert_tensors(self) -> list[str]:
        return self._builder.missing() if self._builder is not None else []

    @property
    def in_blocks(self) -> str | None:
        """The blocks' formats in words, or None when the experts are parameters."""
        return self.blocks.layout.kind if self.blocks is not None else None

    # -- compute --

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        bias = self.bias()
        if self.blocks is not None:
            if use_gather(x, topk_ids):
                return self.from_blocks(x, topk_ids, topk_weights)
        elif use_gather(x, topk_ids):
            flat = topk_ids.reshape(-1)
            return gathered(x, topk_weights, self.gate_proj[flat], self.up_proj[flat],
                            self.down_proj[flat], self.act, bias and bias.rows(flat))
        return grouped(x, topk_ids, topk_weights, self.shape.num_experts, self._weights,
                       self.act, bias=bias)

    def from_blocks(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every pair from the blocks at once: the fused kernels, or where one failed to build
        (its first call is eager) the dequantise + matmul twin, with a warning."""
        flat = ids.reshape(-1)
        bias = self.bias()
        bias = bias and bias.rows(flat)
        views = [self._view(p) for p in PROJECTIONS]
        if self.gpu_kernel == "fused":
            try:
                return gathered_fused(x, w, flat, *views, self.act, bias)
            except Exception as e:  # noqa: BLE001 - only Triton's own failures are caught
                if not raised_by_triton(e):
                    raise
                log.warning("layer %d: the fused %s kernel failed to build (%s: %s); its "
                            "resident experts are dequantised per call instead",
                            self.shape.layer, self.in_blocks, type(e).__name__, e)
                self.gpu_kernel = "dequant"
        return gathered_reference(x, w, flat, *views, self.act, bias)

    def _view(self, proj: str) -> QuantTensor:
        assert self.blocks is not None
        qt = self._views.get(proj)
        if qt is None:
            qt = self._views[proj] = self.blocks.layout.quant(self.blocks.rows, proj)
        return qt

    def _weights(self, e: int) -> Weights:
        if self.blocks is None:
            return self.gate_proj[e], self.up_proj[e], self.down_proj[e]
        lay, row = self.blocks.layout, self.blocks.rows[e]
        return (lay.weight(row, "gate_proj", self.dtype), lay.weight(row, "up_proj", self.dtype),
                lay.weight(row, "down_proj", self.dtype))


def regrouped(bank: HostBank, chunk: int = 16) -> HostBank:
    """``bank`` with its Q8_0 projections of whole 256-weight groups regrouped as Q8_0x8 in
    place (``chunk`` experts at a time), the layout saying so; the same weights."""
    formats = list(bank.layout.formats)
    for i, proj in enumerate(PROJECTIONS):
        rows, cols = bank.layout.shapes[i]
        if formats[i] != "q8_0" or not regroups(cols):
            continue
        part = next(p for p in bank.layout.parts if p.proj == proj and p.key == "data")
        data = bank.rows[:, part.offset: part.offset + part.nbytes]
        for e in range(0, bank.num_experts, chunk):
            data[e: e + chunk] = regroup(data[e: e + chunk].reshape(-1, rows, part.nbytes // rows)
                                         ).reshape(-1, part.nbytes)
        formats[i] = "q8_0x8"
    layout = dataclasses.replace(bank.layout, formats=tuple(formats))
    return HostBank(bank.layer, layout, bank.rows)


def _on(qt: QuantTensor, device: torch.device) -> QuantTensor:
    return QuantTensor(qt.fmt, qt.shape, qt.data.to(device),
                       {k: s.to(device) for k, s in qt.scales.items()})


def reference_experts(
    experts: ResidentExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Slow twin: one (token, expert) pair at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    b = experts.bias()
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            gate, up, down = (m.float() for m in experts._weights(e))
            h = x[t].float()
            g = gate @ h
            u = up @ h
            if b is not None:
                g, u = g + b.gate[e].float(), u + b.up[e].float()
            y = down @ glu(experts.act, g, u)
            if b is not None:
                y = y + b.down[e].float()
            out[t] += float(w[t, a]) * y
    return out
