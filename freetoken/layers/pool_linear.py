"""A dense linear layer whose weight stays in its checkpoint format and is multiplied on the
CPU MoE pool (``--cpu-dense pool``): the attention projections and the head read q8_0 bytes
with the experts' row kernels, on every pool worker plus the engine thread, instead of
float32 weights in torch on the engine thread alone.

The slow twin is :class:`~freetoken.layers.linear.Linear` on the same checkpoint tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.quant import QuantTensor, get_format

# Formats the pool's kernels read; f32 and f16 weights are kept as bf16.
_AS_BF16 = ("f32", "f16")


class PoolLinear(nn.Module):
    """``y = x @ W^T``, W (out_features, in_features) in its own format on the CPU pool."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_q: QuantTensor | None = None
        self._id: int | None = None

    def load_weight_tensor(self, qt: QuantTensor) -> None:
        """Keep the checkpoint tensor (a view of the file) until the first forward."""
        if tuple(qt.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(qt.shape)}, the config implies "
                             f"{(self.out_features, self.in_features)}")
        if qt.fmt in _AS_BF16:
            qt = get_format("bf16").quantize(get_format(qt.fmt).dequantize(qt))
        self.weight_q = qt

    def missing_weight(self) -> bool:
        return self.weight_q is None and self._id is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from freetoken.moe.cpu import shared_executor

        ex = shared_executor()
        if self._id is None:
            from freetoken.moe.cpu_executor import ExpertStack

            qt = self.weight_q
            assert qt is not None, "PoolLinear used before its weight was loaded"
            stacked = QuantTensor(qt.fmt, (1, *qt.shape), qt.data.unsqueeze(0),
                                  {k: v.unsqueeze(0) for k, v in qt.scales.items()})
            self._id = ex.add_linear(ExpertStack.from_quant(stacked, copy=True))
            self.weight_q = None
        lead = x.shape[:-1]
        y = ex.submit_linear(x.reshape(-1, self.in_features), self._id).wait()
        return y.view(*lead, self.out_features).to(x.dtype)


def use_pool_linears(model: nn.Module) -> int:
    """Swap the model's dense ``Linear`` layers for :class:`PoolLinear`, except routers
    (``mlp.gate``: top-k choices stay as exact as the resident path's) and a head tied to
    the embedding. Returns how many were swapped; call before loading the weights."""
    from freetoken.layers.linear import Linear

    swapped = 0
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name.endswith("mlp.gate"):
            continue
        if name == "lm_head" and tied:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_f, in_f = module.weight.shape
        setattr(parent, attr, PoolLinear(in_f, out_f))
        swapped += 1
    return swapped
