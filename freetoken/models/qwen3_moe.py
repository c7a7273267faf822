"""Qwen3-MoE (Qwen3MoeForCausalLM): pre-norm blocks, q/k-normed GQA attention, routed experts.

    h = x + attn(input_layernorm(x))
    y = h + moe(post_attention_layernorm(h))      (dense MLP on mlp_only_layers)

Each residual add is made with the norm that follows it (``RMSNorm.added``: one GPU kernel),
so a layer hands the next its residual and its output apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from freetoken.config import ModelConfig
from freetoken.layers.context import ForwardContext
from freetoken.layers.embedding import Embedding
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import Rotary
from freetoken.models.blocks import MLP, Attention, CausalLM, MoEBlock, rope_positions
from freetoken.moe.strategy import StrategyPlan

if TYPE_CHECKING:
    from freetoken.models.native_decode import NativeDecodeLayer


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary,
                 strategy: StrategyPlan) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, rotary)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoEBlock(cfg, layer, strategy) if cfg.moe_layers[layer]
            else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        )
        # CPU float32 decode's whole layer as one native call, where attached
        # (freetoken/models/native_decode.py); these modules are its slow twin.
        self.native: NativeDecodeLayer | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer on x + ``delta`` (the layer before's output, not yet added: each add goes
        with the norm after it, one kernel on a GPU); returns the residual and this layer's
        output, for the next layer (or the final norm) to add."""
        if self.native is not None and ctx.decode:
            x = x if delta is None else x + delta
            return self.native(x, ctx), None
        x, normed = self.input_layernorm.added(x, delta)
        h, normed = self.post_attention_layernorm.added(x, self.self_attn(normed, ctx))
        return h, self.mlp(normed)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan, max_len: int = 0) -> None:
        super().__init__()
        positions = rope_positions(cfg, max_len)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, positions)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3MoeDecoderLayer(cfg, i, rotary, strategy) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary

    def forward(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, delta = self.embed_tokens(ids), None
        for layer in self.layers:
            x, delta = layer(x, ctx, delta)
        return self.norm.added(x, delta)[1]


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan = "resident",
                 max_len: int = 0) -> None:
        super().__init__(cfg, Qwen3MoeModel(cfg, strategy, max_len))
