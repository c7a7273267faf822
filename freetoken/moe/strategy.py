"""The MoE strategy interface and its registry.

A model's MoE block routes tokens and hands ``(x, topk_ids, topk_weights)`` to its layer's
:class:`Experts`; the strategy decides where the expert weights live (GPU, host banks, a GPU
cache) and how a miss is served. Model files never name a strategy.

The strategies are listed in ``moe/registry.py``. Each declares what it needs
(:class:`Needs`); the runner makes what the model's layers need, once (the CPU pool, the
device expert cache), and each layer takes its share in :meth:`Experts.attach` after the
weights are loaded (``moe/attach.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from freetoken.kernels.expert_matmul import ExpertBias

if TYPE_CHECKING:
    from freetoken.cpu.executor import CpuMoeExecutor
    from freetoken.moe.pieces import Recorder
    from freetoken.moe.runtime import OffloadRuntime
    from freetoken.moe.split import SplitCosts

@dataclass(frozen=True)
class ExpertShape:
    """One MoE layer's geometry. E experts, H hidden, I intermediate per expert, A active."""

    layer: int
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    activation: str  # kernels/activation.py: expert_activation
    bias: bool = False  # gate/up/down carry biases (GPT-OSS)
    swiglu_alpha: float = 0.0  # activation swiglu_oai's parameters
    swiglu_limit: float = 0.0

    def swiglu(self) -> tuple[float, float] | None:
        """``swiglu_oai``'s (alpha, limit) as the CPU kernels take them, else None."""
        if self.activation != "swiglu_oai":
            return None
        return self.swiglu_alpha, self.swiglu_limit

    def native_missing(self) -> str | None:
        """Why the native CPU expert kernels cannot compute these experts, or None."""
        if self.activation == "swiglu_oai" and not (self.swiglu_alpha > 0
                                                    and self.swiglu_limit > 0):
            return (f"the clamped SwiGLU needs a positive alpha and limit (the config gives "
                    f"{self.swiglu_alpha} and {self.swiglu_limit})")
        return None


@dataclass(frozen=True)
class Needs:
    """What a strategy's layers need besides their own weights."""

    cpu_pool: bool = False  # the CPU pool computes (some of) their experts
    host_banks: bool = False  # their experts live in host memory (there must be room)
    device_cache: bool = False  # a device expert cache of slots, shared by all such layers

    def __or__(self, other: Needs) -> Needs:
        return Needs(*(getattr(self, f.name) or getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class LayerPlan:
    """What the plan decided for one layer (``moe/plan.py``); dense layers are resident.

    ``fetch_fraction`` and ``max_fetch`` are hybrid's split: the share of misses fetched
    (None: measured online before it is known) and the fetched experts per call at most (None:
    no cap); ``split_from`` names the bandwidth-profile row they came from ("" for none);
    ``start_fetch``: that row's decode check measured hybrid slower than offload at this
    cache, so the split starts holding all-fetch (offload's pace) until a wall check finds
    better.
    """

    strategy: str = "resident"
    fetch_fraction: float | None = None
    max_fetch: int | None = None
    online: bool = True
    split_from: str = ""
    start_fetch: bool = False


@dataclass(frozen=True)
class Shared:
    """What the runner made for the model's layers, by the union of their needs: the CPU pool
    (``pool``), the device expert cache with its copy stream and stats (``runtime``), and what
    host-planned layers share with the decode graph runner (``recorder``: the runtime where
    there is one; on a GPU without a cache, a bare :class:`~freetoken.moe.pieces.Recorder`);
    ``splits``: hybrid's fitted split costs (:class:`~freetoken.moe.split.SplitCosts`), one
    per layer kind."""

    pool: CpuMoeExecutor | None = None
    runtime: OffloadRuntime | None = None
    recorder: Recorder | None = None
    splits: dict[Any, SplitCosts] = field(default_factory=dict)  # LayerKind -> costs


class Experts(nn.Module):
    """The experts of one MoE layer.

    Invariants: ``forward`` is called from the engine's main thread only; it returns
    ``sum_a w[t, a] * expert_{ids[t, a]}(x[t])`` for every token t, in x's dtype.
    ``load`` receives each projection once (stacked E x out x in) or once per expert.
    :meth:`attach` is called once, after loading and before the first forward.
    """

    NEEDS: ClassVar[Needs] = Needs()
    shape: ExpertShape  # set by each strategy's constructor

    def make_bias(self) -> None:
        """Biased experts keep their biases on the model's device under every strategy (they
        are small): ``gate_proj_bias``/``up_proj_bias`` (E, I), ``down_proj_bias`` (E, H)."""
        s = self.shape
        for name, n in (("gate_proj_bias", s.intermediate), ("up_proj_bias", s.intermediate),
                        ("down_proj_bias", s.hidden)):
            p = nn.Parameter(torch.empty(s.num_experts, n), requires_grad=False) if s.bias else None
            self.register_parameter(name, p)

    def bias(self) -> ExpertBias | None:
        if not self.shape.bias:
            return None
        return ExpertBias(self.gate_proj_bias, self.up_proj_bias, self.down_proj_bias)

    def native_glu(self) -> dict[str, object]:
        """What the CPU pool's ``add_layer`` takes besides the weights: the activation, its
        clamped SwiGLU's parameters, the biases."""
        b = self.bias()
        return {"activation": self.shape.activation, "swiglu": self.shape.swiglu(),
                "bias": None if b is None else (b.gate, b.up, b.down)}

    def attach(self, plan: LayerPlan, shared: Shared) -> None:
        """Take this layer's plan and what :attr:`NEEDS` asked for from ``shared``."""

    def recorder(self) -> Recorder | None:
        """Where this layer learns that decode graphs are being captured, if the host plans
        its calls (offload, hybrid, cpu on a GPU); None for layers captured whole."""
        return None

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:  # x (T, H), ids/weights (T, A) -> (T, H)
        raise NotImplementedError


# What a model is built with: one strategy for every MoE layer, or one per layer
StrategyPlan = str | tuple[str, ...]
