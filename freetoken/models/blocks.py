"""Blocks shared by every model family: attention, gated MLP, MoE block.

Shapes: T tokens, H hidden, Hq/Hkv query/key-value heads, D head dim, E experts, A active.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.cpu.library import ACTIVATIONS as NATIVE_ACTIVATIONS
from freetoken.cpu.library import optional
from freetoken.kernels.activation import ACTIVATIONS
from freetoken.kernels.token_steps import (
    norm_rotary,
    norm_rotary_usable,
    route,
    route_from_hidden,
    route_from_hidden_usable,
    route_usable,
    usable,
)
from freetoken.layers.attention import attention
from freetoken.layers.block_linear import product
from freetoken.layers.context import ForwardContext
from freetoken.layers.linear import Linear, stack_rows
from freetoken.layers.norm import RMSNorm
from freetoken.layers.pool_linear import PoolLinear
from freetoken.layers.rotary import Rotary
from freetoken.moe.registry import make_experts
from freetoken.moe.strategy import ExpertShape, StrategyPlan


def rope_positions(cfg: ModelConfig, max_len: int = 0) -> int:
    """Positions a model's rotary tables cover: the engine's longest sequence ``max_len`` where
    it is set and shorter than the config's ``max_position`` (a 262k-position Gemma-4 table is
    ~0.5 GB that a 32k context never reads), else ``max_position``."""
    return min(max_len, cfg.max_position) if max_len > 0 else cfg.max_position


def _native_route() -> Any:
    """The native library's router top-k, or None where it is not built (torch runs)."""
    return optional("ft_route_topk")


class Attention(nn.Module):
    """q/k/v projections, per-head q_norm/k_norm, rotary, causal attention, o_proj."""

    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: Rotary, window: int = 0,
        unit_offset_norm: bool = False,
    ) -> None:
        super().__init__()
        D = cfg.head_dim
        self.layer, self.window, self.scale = layer, window, cfg.attn_scale
        self.n_q, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * D)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * D)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * D)
        self.o_proj = Linear(cfg.num_heads * D, cfg.hidden_size)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, unit_offset_norm)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, unit_offset_norm)
        self.rotary = rotary
        # on a GPU q, k and v are one matmul over a stacked weight (their weights its views)
        self.qkv = stack_rows([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        if self.qkv is not None:
            qkv = product(x, self.qkv)  # bf16, or Q8_0x8 blocks (block_linear.py)
            nq, nk = self.n_q * D, self.n_kv * D
            both = self._norm_rotary(qkv[:, :nq + nk].view(T, self.n_q + self.n_kv, D), ctx)
            if both is not None:
                q, k = both
            else:
                q = qkv[:, :nq].view(T, self.n_q, D)
                k = qkv[:, nq:nq + nk].view(T, self.n_kv, D)
            v = qkv[:, nq + nk:].view(T, self.n_kv, D)
        else:
            both = None
            q = self.q_proj(x).view(T, self.n_q, D)
            k = self.k_proj(x).view(T, self.n_kv, D)
            v = self.v_proj(x).view(T, self.n_kv, D)
        if both is None:
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(q, ctx.positions), self.rotary(k, ctx.positions)
        o = attention(q, k, v, ctx, self.layer, self.scale, self.window)
        return self.o_proj(o.reshape(T, -1))

    def _norm_rotary(self, qk: torch.Tensor,
                     ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q and k normalised and rotated in one GPU kernel (``kernels/token_steps.py``; its
        slow twin: q_norm, k_norm, then rotary on each), or None where it does not apply."""
        qn, kn, rot = self.q_norm, self.k_norm, self.rotary
        if not (qn.mode == kn.mode and qn.eps == kn.eps and usable(qk, qn.weight)
                and usable(qk, kn.weight)
                and norm_rotary_usable(qk, self.n_q, rot.cos, ctx.positions)):
            return None
        return norm_rotary(qk, self.n_q, qn.weight, kn.weight, qn.eps, qn.mode, rot.cos,
                           rot.sin, ctx.positions)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)).

    With its matrices on the CPU pool (float32 activations), ``act(g) * u`` is the library's
    (``ft_glu``): the native decode layer's MLP computes it so too, and the two stay the same
    bits; in torch (and against ``transformers``) it is torch's."""

    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.activation = activation
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_proj(x), self.up_proj(x)
        if isinstance(self.gate_proj, PoolLinear) and g.dtype is torch.float32 and g.dim() == 2:
            fn = optional("ft_glu")
            if fn is not None and g.stride(1) == 1 and u.stride(1) == 1:
                out = torch.empty(g.shape, dtype=torch.float32)
                fn(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), g.shape[0], g.shape[1],
                   NATIVE_ACTIVATIONS[self.activation], out.data_ptr())
                return self.down_proj(out)
        return self.down_proj(self.act(g) * u)


class MoEBlock(nn.Module):
    """Router (``gate``) -> softmax over E -> top-A (renormalised if the model says so) -> experts.

    Where the experts live and how a cache miss is served is the strategy's business.
    """

    def __init__(self, cfg: ModelConfig, layer: int, strategy: StrategyPlan) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        name = strategy if isinstance(strategy, str) else strategy[layer]
        self.experts = make_experts(name, ExpertShape(
            layer, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k,
            cfg.hidden_act,
        ))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> top-k expert ids (T, A) and their weights (T, A) in x's dtype."""
        gate = self.gate
        if type(gate) is Linear and gate.bias is None \
                and route_from_hidden_usable(x, gate.weight, self.top_k):
            # a decode step's matmul and routing in one GPU kernel (kernels/token_steps.py)
            got = route_from_hidden(x, gate.weight, self.top_k, self.norm_topk_prob, x.dtype)
            if got is not None:
                return got
        logits = gate(x)
        if logits.is_cpu and logits.dtype is torch.float32 and logits.dim() == 2 \
                and self.top_k <= logits.shape[1]:
            fn = _native_route()
            if fn is not None:  # one call instead of five torch calls at decode
                logits = logits.contiguous()
                ids = torch.empty(logits.shape[0], self.top_k, dtype=torch.int64, device="cpu")
                weights = torch.empty(logits.shape[0], self.top_k, dtype=torch.float32,
                                      device="cpu")
                fn(logits.data_ptr(), logits.shape[0], logits.shape[1], self.top_k,
                   self.norm_topk_prob, ids.data_ptr(), weights.data_ptr())
                return ids, weights.to(x.dtype)
        if route_usable(logits, self.top_k):  # one GPU kernel (kernels/token_steps.py)
            got = route(logits, self.top_k, self.norm_topk_prob, x.dtype)
            if got is not None:
                return got
        return self.choose(logits, x.dtype)

    def choose(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path of :meth:`route` from the router's logits (the native one's slow
        twin): softmax over E, top-A, renormalised if the model says so. On exactly equal
        logits the two may pick different experts of the tie (the native one takes the lower
        ids; torch.topk's order is its own)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return self.experts(x, ids, weights)


class CausalLM(nn.Module):
    """A decoder stack (``model``, whose ``embed_tokens`` the head may share) under its head:
    ``lm_head`` tied to the embedding where the config says, logits in float32 for the rows
    the context asks for, soft-capped as ``c * tanh(logits / c)`` where the config sets ``c``."""

    def __init__(self, cfg: ModelConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight
        self.softcap = cfg.final_logit_softcapping
        # positions the model was built for: rows of its shortest rotary table
        self.positions = min((m.cos.shape[0] for m in model.modules() if isinstance(m, Rotary)),
                             default=1 << 62)

    def forward(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """ids (T,) -> logits (R, vocab) in float32 for the rows ctx.logit_rows (or all T).
        A sequence longer than the rotary tables is refused: a GPU kernel would read past
        them."""
        if ctx.end > self.positions:
            raise ValueError(f"a sequence of {ctx.end} tokens is longer than the "
                             f"{self.positions} positions this model was built for "
                             "(the engine's max_seq_len)")
        h = self.model(ids, ctx)
        if ctx.logit_rows is not None:
            h = h[ctx.logit_rows]
        logits = self.lm_head(h).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
