"""Gemma-4 text (Gemma4ForCausalLM): Gemma-3's four norms, attention geometry per layer type,
and on MoE layers a routed-experts branch beside the dense MLP.

    e = embed(ids) * sqrt(H)
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    m = mlp(pre_feedforward_layernorm(h))                                        dense layers
    m = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))          MoE layers
      + post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), route(h)))
    y = (h + post_feedforward_layernorm(m)) * layer_scalar
    logits = softcap(tied_head(norm(y)))

attn: q = q_norm(q), k = k_norm(k), v = rms(v) (no scale), scale 1. Sliding layers use
head_dim and the local rope; full layers their own head size and KV heads, a rope that turns
only a fraction of each head's pairs ("proportional"), and with ``attention_k_eq_v`` v taken
from k's projection. route: p = softmax(proj(rms(h) * scale / sqrt(H))), top-A renormalised,
times per_expert_scale. Norm scales are w (not 1 + w), applied in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.layers.attention import attention
from freetoken.layers.context import ForwardContext
from freetoken.layers.embedding import Embedding
from freetoken.layers.linear import Linear
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import Rotary
from freetoken.models.blocks import MLP, CausalLM, rope_positions
from freetoken.moe.registry import make_experts
from freetoken.moe.strategy import ExpertShape, StrategyPlan


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a scale, in float32."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim_of(layer)
        self.layer, self.eps, self.rotary = layer, cfg.rms_norm_eps, rotary
        sliding = cfg.sliding_layers[layer]
        self.window = cfg.sliding_window if sliding else 0
        self.n_q, self.n_kv, self.head_dim = cfg.num_heads, cfg.kv_heads_of(layer), D
        self.q_proj = Linear(H, self.n_q * D)
        self.k_proj = Linear(H, self.n_kv * D)
        self.v_proj = None if cfg.attention_k_eq_v and not sliding else Linear(H, self.n_kv * D)
        self.o_proj = Linear(self.n_q * D, H)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, float_scale=True)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, float_scale=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(T, self.n_q, self.head_dim))
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(T, self.n_kv, self.head_dim)
        k, v = self.k_norm(k), _rms(v, self.eps)
        q, k = self.rotary(q, ctx.positions), self.rotary(k, ctx.positions)
        o = attention(q, k, v, ctx, self.layer, 1.0, self.window)
        return self.o_proj(o.reshape(T, -1))


class Gemma4Router(nn.Module):
    """h (T, H) -> top-A expert ids and their weights (T, A)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, E = cfg.hidden_size, cfg.num_experts
        self.top_k, self.eps, self.root = cfg.top_k, cfg.rms_norm_eps, H**-0.5
        self.proj = Linear(H, E)
        self.scale = nn.Parameter(torch.empty(H), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(E), requires_grad=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(_rms(h, self.eps) * self.scale * self.root)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        return ids, weights.to(h.dtype)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary,
                 strategy: StrategyPlan) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps

        def norm() -> RMSNorm:
            return RMSNorm(H, eps, float_scale=True)

        self.self_attn = Gemma4Attention(cfg, layer, rotary)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.mlp = MLP(H, cfg.intermediate_size, cfg.hidden_act)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)
        self.moe = cfg.moe_layers[layer]
        if self.moe:
            self.router = Gemma4Router(cfg)
            name = strategy if isinstance(strategy, str) else strategy[layer]
            self.experts = make_experts(name, ExpertShape(
                layer, cfg.num_experts, H, cfg.moe_intermediate_size, cfg.top_k,
                cfg.hidden_act))
            self.pre_feedforward_layernorm_2 = norm()
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()

    def router_map(self, before: nn.Module) -> tuple[torch.Tensor, None] | None:
        """This layer's router logits as a linear map of the experts' input of ``before``, an
        earlier MoE layer of the model (look-ahead, ``moe/lookahead.py``, predicts with it
        from that input). The input is ``rms(h) * w`` (``w``: before's
        ``pre_feedforward_layernorm_2``) and the router reads ``rms(h) * scale / sqrt(H)``,
        so on the residual stream ``h`` of that layer the map is the router itself:
        ``W = proj * scale / sqrt(H) / w``, columns where ``w`` is 0 left out (they carry
        nothing there)."""
        norm = getattr(before, "pre_feedforward_layernorm_2", None)
        proj = self.router.proj.weight
        if not isinstance(norm, RMSNorm) or not norm.float_scale or proj.dim() != 2:
            return None
        w = norm.weight.detach().float()
        kept = w.abs() > 1e-6
        column = torch.where(kept, self.router.scale.detach().float() * self.router.root
                             / torch.where(kept, w, torch.ones_like(w)), torch.zeros_like(w))
        return proj.detach().float() * column, None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:
            ids, weights = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), ids, weights)
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        return (h + self.post_feedforward_layernorm(m)) * self.layer_scalar


class Gemma4TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan, max_len: int = 0) -> None:
        super().__init__()
        positions = rope_positions(cfg, max_len)
        assert cfg.rope_full is not None and cfg.rope_sliding is not None
        n = cfg.num_layers
        full_dim = next((cfg.head_dim_of(i) for i in range(n) if not cfg.sliding_layers[i]),
                        cfg.head_dim)
        local = Rotary(cfg.head_dim, 0.0, positions, spec=cfg.rope_sliding)
        full = Rotary(full_dim, 0.0, positions, spec=cfg.rope_full)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size**0.5)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(cfg, i, local if cfg.sliding_layers[i] else full, strategy)
            for i in range(n)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, float_scale=True)
        self.rotary = nn.ModuleList([local, full])

    def forward(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class Gemma4ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan = "resident",
                 max_len: int = 0) -> None:
        super().__init__(cfg, Gemma4TextModel(cfg, strategy, max_len))
