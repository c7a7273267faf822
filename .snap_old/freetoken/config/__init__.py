"""Frozen configuration: what the model is (:mod:`.model`, ``ModelConfig``; the family
readers in :mod:`.families`, rotary specs in :mod:`.rope`) and how we run it (:mod:`.engine`,
``EngineConfig`` and ``CacheSizing``)."""

from freetoken.config.engine import (
    KV_RESERVE_TOKENS,
    MOE_CPU_SPIN_US,
    CacheSizing,
    EngineConfig,
    human_bytes,
)
from freetoken.config.model import GGUF_ARCHITECTURES, HF_ARCHITECTURES, ModelConfig
from freetoken.config.rope import RopeSpec

__all__ = ["GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "KV_RESERVE_TOKENS", "MOE_CPU_SPIN_US",
           "CacheSizing", "EngineConfig", "ModelConfig", "RopeSpec", "human_bytes"]
