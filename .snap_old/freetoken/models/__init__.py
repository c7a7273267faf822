"""Model families, one short file each, registered by family name."""

from __future__ import annotations

from torch import nn

from freetoken.config import ModelConfig
from freetoken.models.gemma3 import Gemma3ForCausalLM
from freetoken.models.gemma4 import Gemma4ForCausalLM
from freetoken.models.gpt_oss import GptOssForCausalLM
from freetoken.models.qwen3_moe import Qwen3MoeForCausalLM
from freetoken.moe.strategy import StrategyPlan

MODELS: dict[str, type[nn.Module]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma4": Gemma4ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def build_model(cfg: ModelConfig, strategy: StrategyPlan = "resident",
                max_len: int = 0) -> nn.Module:
    """Build the module tree (uninitialised weights) for ``cfg`` on the current default device;
    positions below ``max_len`` (the engine's longest sequence; 0: the config's) can be run."""
    return MODELS[cfg.family](cfg, strategy, max_len)
