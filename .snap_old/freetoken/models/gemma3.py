"""Gemma-3 text (Gemma3ForCausalLM): four norms per block, sliding-window and global layers.

    e = embed(ids) * sqrt(H)
    h = x + post_attention_layernorm(attn(input_layernorm(x)))        local or global rope
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
    logits = softcap(tied_head(norm(y)))
Norm scales are (1 + w).
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


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: Rotary,
                 strategy: StrategyPlan) -> None:
        super().__init__()
        sliding = cfg.sliding_layers[layer]
        window = cfg.sliding_window if sliding else 0
        self.self_attn = Attention(cfg, layer, rotary, window, unit_offset_norm=True)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(H, eps, unit_offset=True)
        self.mlp: nn.Module = (
            MoEBlock(cfg, layer, strategy) if cfg.moe_layers[layer]
            else MLP(H, cfg.intermediate_size, cfg.hidden_act)
        )
        # CPU float32 decode's whole layer as one native call, where attached
        # (freetoken/models/native_decode.py); these modules are its slow twin.
        self.native: NativeDecodeLayer | None = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.native is not None and ctx.decode:
            return self.native(x, ctx)
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ctx))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan, max_len: int = 0) -> None:
        super().__init__()
        positions = rope_positions(cfg, max_len)
        local = Rotary(cfg.head_dim, cfg.rope_local_theta, positions)
        full = Rotary(cfg.head_dim, cfg.rope_theta, positions, cfg.rope_scaling_factor)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size**0.5)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, local if cfg.sliding_layers[i] else full, strategy)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.rotary = nn.ModuleList([local, full])

    def forward(self, ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, ctx)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, strategy: StrategyPlan = "resident",
                 max_len: int = 0) -> None:
        super().__init__(cfg, Gemma3TextModel(cfg, strategy, max_len))
