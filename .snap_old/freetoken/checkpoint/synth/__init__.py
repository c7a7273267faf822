"""Synthetic checkpoints at real geometry (``ft synth``): random weights, a byte-level BPE
tokenizer, and routers with tunable expert popularity. See ``weights.py`` for the recipe."""

from freetoken.checkpoint.synth.cli import add_synth_args, synth_main
from freetoken.checkpoint.synth.presets import (
           PRESETS,
           Preset,
           SynthSpec,
           hf_config,
           parse_expert_formats,
           plan_bytes,
           resolve_spec,
           tensor_plans,
)
from freetoken.checkpoint.synth.tokenizer import (
           CHAT_TEMPLATE,
           QWEN2_SPLIT,
           SPECIALS,
           gguf_tokenizer_metadata,
           hf_tokenizer_files,
           vocabulary,
)
from freetoken.checkpoint.synth.weights import ROUTER_STD, WINDOW, Weights
from freetoken.checkpoint.synth.write import SHARD_BYTES, write_synth

__all__ = ["CHAT_TEMPLATE", "PRESETS", "Preset", "QWEN2_SPLIT", "ROUTER_STD", "SHARD_BYTES",
           "SPECIALS", "SynthSpec", "WINDOW", "Weights", "add_synth_args",
           "gguf_tokenizer_metadata", "hf_config", "hf_tokenizer_files", "parse_expert_formats",
           "plan_bytes", "resolve_spec", "synth_main", "tensor_plans", "vocabulary",
           "write_synth"]
