"""A dense linear layer whose weight stays in its checkpoint format and is multiplied on the
CPU MoE pool (``--cpu-dense pool``): the attention projections and the head read q8_0 bytes
with the experts' row kernels, on every pool worker plus the engine thread, instead of
float32 weights in torch on the engine thread alone.

Layers that read the same input in turn (an attention's q, k and v; an MLP's gate and up) form
an :class:`InputGroup`: the first of them to be called runs one pool job over all their rows,
and the others take their part of its output, which saves the engine thread a submit and a
wait per member (decode on the CPU is bound by that thread's per-call costs, not by the
pool's bandwidth). Every row is the same dot product either way, so the outputs are the same.

The slow twin is :class:`~freetoken.layers.linear.Linear` on the same checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.expert_stack import ExpertStack
from freetoken.quant import QuantTensor, get_format

# Formats the pool's kernels read; f32 and f16 weights are kept as bf16.
_AS_BF16 = ("f32", "f16")
# Sibling layers that read one input, by attribute name in their parent module.
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class InputGroup:
    """PoolLinear layers called in turn on the same input tensor. Their weights are stacked
    into one matrix when they share a format and input size and keep no separate scales (so
    rows concatenate); otherwise each member runs alone."""

    def __init__(self, members: list[PoolLinear]) -> None:
        self.members = members
        self._id: int | None = None
        self.stacked: bool | None = None  # decided at the first call
        self._x: torch.Tensor | None = None  # the input whose outputs are pending
        self._pending: dict[int, torch.Tensor] = {}  # member index -> its output

    def _stack(self) -> None:
        qts = [m.weight_q for m in self.members]
        self.stacked = all(qt is not None for qt in qts) and len(
            {(qt.fmt, qt.shape[1:], qt.data.shape[1:], qt.data.dtype) for qt in qts}) == 1 \
            and not any(qt.scales for qt in qts)
        if self.stacked:
            first = qts[0]
            rows = sum(qt.shape[0] for qt in qts)
            stacked = QuantTensor(first.fmt, (rows, *first.shape[1:]),
                                  torch.cat([qt.data for qt in qts]))
            self._id = self.members[0].pool.add_linear(ExpertStack.from_quant(stacked, copy=True))
            for m in self.members:
                m.weight_q = None

    def linear_id(self) -> int | None:
        """The stacked matrix's id on the pool (registered now if it was not yet); None when
        the members do not stack."""
        if self.stacked is None:
            self._stack()
        return self._id

    def output(self, member: PoolLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s output for x from one job for the whole group; None when the group
        does not stack (the member then runs alone)."""
        if self.stacked is None:
            self._stack()
        if not self.stacked:
            return None
        i = self.members.index(member)
        if x is not self._x or i not in self._pending:
            y = member.pool.run_linear(x.reshape(-1, member.in_features), self._id)
            parts = y.split([m.out_features for m in self.members], dim=-1)
            self._x, self._pending = x, dict(enumerate(parts))
        y = self._pending.pop(i)
        if not self._pending:
            self._x = None
        return y


class PoolLinear(nn.Module):
    """``y = x @ W^T``, W (out_features, in_features) in its own format on the CPU pool; with
    ``exact`` (routers) W is kept in float32 and the input is not quantised, so the products are
    the torch path's up to the order of the sums. ``pool``: the CPU pool that holds W."""

    def __init__(self, in_features: int, out_features: int, pool: CpuMoeExecutor,
                 exact: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.pool = pool
        self.exact = exact
        self.weight_q: QuantTensor | None = None
        self._id: int | None = None
        self.group: InputGroup | None = None
        self.ties: str | None = None  # the checkpoint tensor it shares (a tied head)

    def load_weight_tensor(self, qt: QuantTensor) -> None:
        """Keep the checkpoint tensor (a view of the file) until it goes to the pool
        (:func:`place_pool_linears` as the load ends, else the first forward): a weight is
        loaded once, before that."""
        if self._id is not None or (self.group is not None and self.group.stacked):
            raise RuntimeError("a PoolLinear's weight is loaded once, before its first forward; "
                               "build a new model to load other weights")
        if tuple(qt.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(qt.shape)}, the config implies "
                             f"{(self.out_features, self.in_features)}")
        if self.exact and qt.fmt != "f32":
            qt = get_format("f32").quantize(get_format(qt.fmt).dequantize(qt).float())
        elif not self.exact and qt.fmt in _AS_BF16:
            qt = get_format("bf16").quantize(get_format(qt.fmt).dequantize(qt))
        self.weight_q = qt

    def missing_weight(self) -> bool:
        return self.weight_q is None and self._id is None and (
            self.group is None or not self.group.stacked)

    def linear_id(self) -> int:
        """This matrix's id on the pool, registered now if it was not yet."""
        if self._id is None:
            assert self.weight_q is not None, "PoolLinear used before its weight was loaded"
            self._id = self.pool.add_linear(ExpertStack.from_quant(self.weight_q, copy=True))
            self.weight_q = None
        return self._id

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.group.output(self, x) if self.group is not None else None
        if y is None:
            y = self.pool.run_linear(x.reshape(-1, self.in_features), self.linear_id())
        y = y.reshape(*lead, self.out_features)
        return y if self.exact else y.to(x.dtype)  # a router's logits stay float32


def use_pool_linears(model: nn.Module, pool: CpuMoeExecutor) -> int:
    """Swap the model's dense ``Linear`` layers for :class:`PoolLinear` on ``pool`` and group
    siblings that read one input (:data:`INPUT_GROUPS`). A head tied to the embedding becomes
    one too, filled from the embedding's checkpoint tensor in its format (``ties``): the
    embedding keeps its own rows for the lookup, and a decode step reads the head's bytes, not
    a float32 copy four times their size (the largest matrix of a small model with a large
    vocabulary). Routers (``mlp.gate``) stay float32 (``exact``): top-k choices stay as exact
    as the resident path's, and the pool reads their megabyte in a fraction of the engine
    thread's time. Returns how many were swapped; call before loading the weights."""
    from freetoken.layers.linear import Linear

    swapped = 0
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_f, in_f = module.weight.shape
        swap = PoolLinear(in_f, out_f, pool, exact=name.endswith("mlp.gate"))
        if name == "lm_head" and tied:
            swap.ties = "model.embed_tokens.weight"
        setattr(parent, attr, swap)
        swapped += 1
    for module in model.modules():
        for names in INPUT_GROUPS:
            members = [getattr(module, n, None) for n in names]
            if all(isinstance(m, PoolLinear) for m in members):
                group = InputGroup(members)  # type: ignore[arg-type]
                for m in members:
                    m.group = group  # type: ignore[union-attr]
    return swapped


def place_pool_linears(model: nn.Module) -> None:
    """Hand every loaded :class:`PoolLinear` weight to its pool now (stacked per input group
    where the members stack), as the model's load ends, so the first request does not pay the
    copies (the head of a large vocabulary is the largest matrix of a small model)."""
    for m in model.modules():
        if isinstance(m, PoolLinear) and not m.missing_weight():
            if m.group is None or m.group.linear_id() is None:
                m.linear_id()
