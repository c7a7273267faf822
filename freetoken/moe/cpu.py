"""CPU strategy: every expert stays in host memory in its checkpoint format and the CPU MoE
executor computes the routed ones; the result goes back to the model's device.

The loader hands expert tensors over undequantised through :meth:`CpuExperts.load_expert_tensor`
(stacked ``E x out x in``, fused ``gate_up_proj``, or one expert at a time). All layers share one
executor (one pool of pinned workers), made on first use by :func:`shared_executor`.
"""

from __future__ import annotations

import threading

import torch

from freetoken.errors import ConfigError
from freetoken.moe import cpu_executor as cx
from freetoken.moe.strategy import Experts, ExpertShape, register
from freetoken.quant import QuantTensor, get_format

_EXECUTOR: cx.CpuMoeExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def shared_executor(threads: int | None = None, isa: str | None = None) -> cx.CpuMoeExecutor:
    """The process's CPU MoE executor; the first call's arguments make it (``--moe-cpu-threads``
    and the ISA cap), later calls return it as it is."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = cx.CpuMoeExecutor(threads=threads, isa=isa)
        return _EXECUTOR


@register("cpu")
class CpuExperts(Experts):
    """One MoE layer's experts in host memory; forward runs them on the CPU executor."""

    def __init__(self, shape: ExpertShape) -> None:
        super().__init__()
        reason = cx.available()
        if reason is not None:
            raise ConfigError(f"--moe-strategy cpu needs the CPU MoE library, but {reason}")
        self.shape = shape
        self._stacked: dict[str, QuantTensor] = {}
        self._per_expert: dict[str, list[QuantTensor | None]] = {}
        self._executor: cx.CpuMoeExecutor | None = None

    def load_expert_tensor(self, proj: str, qt: QuantTensor, expert: int | None = None) -> bool:
        """Keep one checkpoint tensor: ``proj`` is gate_proj, up_proj, down_proj or (stacked
        only) gate_up_proj; ``expert`` names the expert of a per-expert tensor. f32 and f16
        weights are kept as bf16."""
        E, I_ = self.shape.num_experts, self.shape.intermediate
        if qt.fmt in ("f32", "f16"):  # no kernel reads these: keep them as bf16
            qt = get_format("bf16").quantize(get_format(qt.fmt).dequantize(qt))
        if proj == "gate_up_proj" and expert is None:
            gate, up = _split_rows(qt, I_)
            return self.load_expert_tensor("gate_proj", gate) and self.load_expert_tensor(
                "up_proj", up)
        if proj not in cx.PROJECTIONS:
            raise ValueError(f"layer {self.shape.layer}: no expert projection {proj!r}")
        want = self._want(proj)
        if expert is None:
            if tuple(qt.shape) != (E, *want):
                raise ValueError(f"layer {self.shape.layer} {proj}: shape {qt.shape}, the config "
                                 f"implies {(E, *want)}")
            self._stacked[proj] = qt
        else:
            if tuple(qt.shape) != want or not 0 <= expert < E:
                raise ValueError(f"layer {self.shape.layer} {proj} expert {expert}: shape "
                                 f"{qt.shape}, the config implies {want} for {E} experts")
            self._per_expert.setdefault(proj, [None] * E)[expert] = qt
        return True

    def missing_expert_tensors(self) -> list[str]:
        """What the checkpoint has not provided yet, e.g. ``['down_proj', 'up_proj[3]']``."""
        missing = []
        for proj in cx.PROJECTIONS:
            if proj in self._stacked:
                continue
            per = self._per_expert.get(proj)
            if per is None:
                missing.append(proj)
            else:
                missing += [f"{proj}[{e}]" for e, t in enumerate(per) if t is None]
        return missing

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:  # x (T, H), ids/weights (T, A) -> (T, H)
        ex = self._executor or self._register()
        out = ex.run(x, topk_ids, topk_weights, self.shape.layer)
        return out.to(device=x.device, dtype=x.dtype)

    def _want(self, proj: str) -> tuple[int, int]:
        H, I_ = self.shape.hidden, self.shape.intermediate
        return (H, I_) if proj == "down_proj" else (I_, H)

    def _register(self) -> cx.CpuMoeExecutor:
        """Copy the banks to huge-page host memory and hand them to the executor."""
        missing = self.missing_expert_tensors()
        if missing:
            raise ConfigError(f"layer {self.shape.layer}: the cpu strategy was not given expert "
                              f"weights {', '.join(missing[:5])} (the checkpoint lacks them, or "
                              "the loader did not hand them over through load_expert_tensor)")
        stacks = []
        for proj in cx.PROJECTIONS:
            src = self._stacked.get(proj) or [t for t in self._per_expert[proj] if t is not None]
            stacks.append(cx.ExpertStack.from_quant(src, copy=True))
        ex = shared_executor()
        ex.add_layer(self.shape.layer, *stacks, activation=self.shape.activation)
        self._stacked.clear()
        self._per_expert.clear()
        self._executor = ex
        return ex


def _split_rows(qt: QuantTensor, rows: int) -> tuple[QuantTensor, QuantTensor]:
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
