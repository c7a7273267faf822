"""GPT-OSS (GptOssForCausalLM): pre-norm blocks, biased GQA attention with a learned sink per
head, sliding and full layers in turn, biased experts with a clamped SwiGLU.

    h = x + attn(input_layernorm(x))
    y = h + moe(post_attention_layernorm(h))
attn: softmax over [q.k / sqrt(D) for the visible keys, sink_h] (the sink has no value);
yarn rope; sliding layers see the last ``sliding_window`` positions.
moe: l = router(x) (with bias); ids = top-A of l, weights = softmax over those A logits;
expert(x) = down(glu(gate(x) + b_g, up(x) + b_u)) + b_d with
glu(g, u) = (clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g'), g' = min(g, L).
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
from freetoken.models.blocks import CausalLM, rope_positions
from freetoken.moe.registry import make_experts
from freetoken.moe.strategy import ExpertShape, StrategyPlan


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary) -> None:
        super().__init__()
        H, D, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.layer, self.rotary, self.scale = layer, rotary, D**-0.5
        self.window = cfg.sliding_window if cfg.sliding_layers[layer] else 0
        self.n_q, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, D
        self.q_proj = Linear(H, self.n_q * D, bias=b)
        self.k_proj = Linear(H, self.n_kv * D, bias=b)
        self.v_proj = Linear(H, self.n_kv * D, bias=b)
        self.o_proj = Linear(self.n_q * D, H, bias=b)
        self.sinks = nn.Parameter(torch.empty(self.n_q), requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_q, self.head_dim)
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        q, k = self.rotary(q, ctx.positions), self.rotary(k, ctx.positions)
        o = attention(q, k, v, ctx, self.layer, self.scale, self.window, sinks=self.sinks)
        return self.o_proj(o.reshape(T, -1))


class GptOssMLP(nn.Module):
    """The router and the layer's experts (T tokens, H hidden, E experts, A active)."""

    def __init__(self, cfg: ModelConfig, layer: int, strategy: StrategyPlan) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        name = strategy if isinstance(strategy, str) else strategy[layer]
        self.experts = make_experts(name, ExpertShape(
            layer, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k,
            cfg.hidden_act, bias=cfg.expert_bias, swiglu_alpha=cfg.swiglu_alpha,
            swiglu_limit=cfg.swiglu_limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # (T, A)
        weights = torch.softmax(top, dim=-1, dtype=top.dtype)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary,
                 strategy: StrategyPlan) -> None:
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GptOssAttention(cfg, layer, rotary)
        self.mlp = GptOssMLP(cfg, layer, strategy)
        self.input_layernorm = RMSNorm(H, eps, float_scale=True)
        self.post_attention_layernorm = RMSNorm(H, eps, float_scale=True)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(nn.Module):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan, max_len: int = 0) -> None:
        super().__init__()
        positions = rope_positions(cfg, max_len)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, positions, spec=cfg.rope_full)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(cfg, i, rotary, strategy) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, float_scale=True)
        self.rotary = rotary

    def forward(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class GptOssForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan = "resident",
                 max_len: int = 0) -> None:
        super().__init__(cfg, GptOssModel(cfg, strategy, max_len))
