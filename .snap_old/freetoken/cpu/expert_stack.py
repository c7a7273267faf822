"""Expert weights as the CPU kernels read them: one address per expert (and per scale tensor)
of each projection, built from checkpoint tensors without copying unless asked.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch

from freetoken.cpu.abi import FORMATS, ProjDesc
from freetoken.cpu.host_memory import to_host_bank
from freetoken.quant import QuantTensor, get_format


@dataclass
class ExpertStack:
    """One projection of all experts of a layer as the kernels read it: an address per expert.

    ``keep`` holds the tensors the addresses point into, so they outlive the executor's use.
    """

    fmt: str
    rows: int
    cols: int
    data: np.ndarray  # (E,) uint64 addresses
    row_bytes: int
    scale: np.ndarray | None = None  # (E,) uint64 addresses
    scale_row_bytes: int = 0
    scale2: np.ndarray | None = None  # (E,) float32
    expert_bytes: int = 0
    keep: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_experts(self) -> int:
        return len(self.data)

    @classmethod
    def from_quant(cls, qts: QuantTensor | list[QuantTensor], copy: bool = False) -> ExpertStack:
        """From one stacked (E, rows, cols) QuantTensor or a list of per-expert (rows, cols);
        one (rows, cols) QuantTensor is a stack of one (a dense matrix for ``add_linear``).

        ``copy`` puts the data in huge-page host memory of its own (else it is read in place).
        """
        if isinstance(qts, QuantTensor) and len(qts.shape) == 2:
            qts = [qts]
        stacked = isinstance(qts, QuantTensor)
        if isinstance(qts, QuantTensor):
            if len(qts.shape) != 3:
                raise ValueError(f"stacked experts need shape (E, rows, cols), got {qts.shape}")
            fmt, (E, rows, cols) = qts.fmt, qts.shape
            data = [_rows_contiguous(qts.data)]
            scales = {k: [v] for k, v in qts.scales.items()}
        else:
            if not qts:
                raise ValueError("no experts")
            fmt, E, (rows, cols) = qts[0].fmt, len(qts), qts[0].shape
            if any(q.fmt != fmt or q.shape != (rows, cols) for q in qts):
                raise ValueError("per-expert tensors differ in format or shape")
            data = [_rows_contiguous(q.data) for q in qts]
            scales = {k: [q.scales[k] for q in qts] for k in qts[0].scales}
        if fmt not in FORMATS:
            raise ValueError(f"no CPU kernel for format {fmt!r} (supported: {', '.join(FORMATS)})")
        if copy:
            data = [to_host_bank(d) for d in data]
        row_bytes = data[0].shape[-1] * data[0].element_size()
        if row_bytes != get_format(fmt).row_bytes(cols):
            raise ValueError(
                f"{fmt} rows of {cols} take {get_format(fmt).row_bytes(cols)} bytes, but the "
                f"data ({data[0].dtype}, last axis {data[0].shape[-1]}) has {row_bytes}"
            )
        stack = cls(fmt, rows, cols, _addresses(data, E, stacked), row_bytes)
        stack.keep = list(data)
        stack.expert_bytes = rows * stack.row_bytes
        if fmt == "nvfp4":
            ws = [_rows_contiguous(s.view(torch.uint8)) for s in scales["weight_scale"]]
            stack.scale, stack.scale_row_bytes = _addresses(ws, E, stacked), cols // 16
            ws2 = torch.stack([s.float().reshape(-1) for s in scales["weight_scale_2"]]).reshape(-1)
            stack.scale2 = (ws2.expand(E) if ws2.numel() == 1 else ws2).numpy().astype(np.float32)
            stack.keep += ws
            stack.expert_bytes += rows * (cols // 16)
        elif fmt == "fp8_block":
            si = [_rows_contiguous(s.float()) for s in scales["weight_scale_inv"]]
            stack.scale, stack.scale_row_bytes = _addresses(si, E, stacked), si[0].shape[-1] * 4
            stack.keep += si
            stack.expert_bytes += si[0].shape[-2] * si[0].shape[-1] * 4
        return stack

    def desc(self) -> ProjDesc:
        ptr = ctypes.c_void_p
        return ProjDesc(
            FORMATS.index(self.fmt),
            self.rows,
            self.cols,
            ptr(self.data.ctypes.data),
            self.row_bytes,
            ptr(self.scale.ctypes.data) if self.scale is not None else None,
            self.scale_row_bytes,
            ptr(self.scale2.ctypes.data) if self.scale2 is not None else None,
            self.expert_bytes,
        )


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose last two axes are contiguous (each expert a block of rows)."""
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dim() >= 2 and (t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]):
        t = t.contiguous()
    return t


def _addresses(tensors: list[torch.Tensor], E: int, stacked: bool) -> np.ndarray:
    """Address of each expert's first row: one stacked (E, ...) tensor, or E tensors."""
    if not stacked:
        return np.array([t.data_ptr() for t in tensors], dtype=np.uint64)
    t = tensors[0]
    step = t.stride(0) * t.element_size()
    return np.array([t.data_ptr() + e * step for e in range(E)], dtype=np.uint64)
