"""Preset geometries, the resolved synth spec, and the tensor plan of a synthetic checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from freetoken.checkpoint.gguf_writer import TensorPlan
from freetoken.errors import ConfigError
from freetoken.quant import FORMATS, get_format

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # the last ids of the vocabulary


@dataclass(frozen=True)
class Preset:
    """A model geometry; ``expert_format`` is the default --expert-format spec."""

    name: str
    hidden: int
    moe_intermediate: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    expert_format: str
    intermediate: int  # dense MLP width in config.json (no layer uses it)
    max_position: int = 32768
    rope_theta: float = 1e6


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen3-30b-a3b", 2048, 768, 128, 8, 48, 32, 4, 128, 151936, "bf16", 6144, 40960),
    Preset("gemma4-26b-a4b", 2816, 704, 128, 8, 30, 16, 8, 256, 262144, "q8_0*,bf16", 2112),
    Preset("gpt-oss-20b-like", 2880, 2880, 32, 4, 24, 64, 8, 64, 201088, "mxfp4", 2880, 131072),
    Preset("tiny", 64, 32, 8, 2, 2, 4, 2, 16, 512, "bf16", 128, 4096),
)}


@dataclass(frozen=True)
class SynthSpec:
    """Everything that determines the bytes written: geometry (overrides applied) and knobs."""

    preset: Preset
    expert_formats: tuple[str, ...]  # per layer
    router_skew: float = 0.0
    router_locality: float = 0.0
    seed: int = 0

    @property
    def matrix_format(self) -> str:
        """Non-expert matrices: q8_0 if most expert layers are quantized, else bf16."""
        quantized = sum(get_format(f).block_size > 1 for f in self.expert_formats)
        return "q8_0" if 2 * quantized > len(self.expert_formats) else "bf16"


def parse_expert_formats(spec: str, layers: int) -> tuple[str, ...]:
    """``q8_0`` (every layer), or a comma list of ``fmt`` (one layer), ``fmt*N`` (N layers) and
    at most one ``fmt*`` (the remaining layers), e.g. ``q8_0*29,bf16`` or ``q8_0*,bf16``."""
    items = [s.strip() for s in spec.split(",")]
    if len(items) == 1 and "*" not in items[0]:
        items = [items[0] + "*"]
    parsed: list[tuple[str, int | None]] = []
    for item in items:
        fmt, star, count = item.partition("*")
        if fmt not in FORMATS or FORMATS[fmt].gguf_type is None:
            choices = ", ".join(n for n, f in FORMATS.items() if f.gguf_type is not None)
            raise ConfigError(f"unknown expert format {fmt!r} in --expert-format {spec!r} "
                              f"(choose from {choices})")
        if star and count and not count.isdigit():
            raise ConfigError(f"bad repeat count {count!r} in --expert-format {spec!r}; "
                              "write FORMAT*N with N a number, or FORMAT* for the rest")
        parsed.append((fmt, int(count) if count else (None if star else 1)))
    fixed = sum(n for _, n in parsed if n is not None)
    fills = sum(n is None for _, n in parsed)
    if fills > 1 or fixed > layers or (fills == 0 and fixed != layers):
        raise ConfigError(
            f"--expert-format {spec!r} gives {fixed} layer(s){' plus a fill' * fills} but the "
            f"model has {layers}; list one format per layer, use FORMAT*N, or one FORMAT* "
            "for the remaining layers"
        )
    return tuple(f for f, n in parsed for _ in range(layers - fixed if n is None else n))


def resolve_spec(
    preset: str, gguf: bool, expert_format: str | None = None, layers: int | None = None,
    experts: int | None = None, vocab: int | None = None, router_skew: float = 0.0,
    router_locality: float = 0.0, seed: int = 0,
) -> SynthSpec:
    """Apply overrides to a preset and check every combination; ConfigError names the fix."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown --preset {preset!r} (choose from {', '.join(PRESETS)})")
    p = PRESETS[preset]
    p = dataclasses.replace(p, layers=p.layers if layers is None else layers,
                            experts=p.experts if experts is None else experts,
                            vocab=p.vocab if vocab is None else vocab)
    if min(p.layers, p.experts, p.vocab) < 1:
        raise ConfigError("--layers, --experts and --vocab must be positive")
    if p.experts < p.top_k:
        raise ConfigError(f"--experts {p.experts} is fewer than the preset's top-k {p.top_k}; "
                          f"pass --experts {p.top_k} or more")
    if p.vocab < 256 + len(SPECIALS):
        raise ConfigError(f"--vocab {p.vocab} cannot hold the 256 byte tokens and "
                          f"{len(SPECIALS)} special tokens; pass --vocab {256 + len(SPECIALS)}+")
    if router_skew < 0 or not 0 <= router_locality <= 1:
        raise ConfigError("--router-skew must be >= 0 and --router-locality within [0, 1]")
    formats = parse_expert_formats(expert_format or p.expert_format, p.layers)
    if not gguf and set(formats) != {"bf16"}:
        raise ConfigError(
            f"expert format(s) {', '.join(sorted(set(formats) - {'bf16'}))} cannot be written "
            "to a Hugging Face directory (bf16 only); write a .gguf --out or pass "
            "--expert-format bf16"
        )
    spec = SynthSpec(p, formats, router_skew, router_locality, seed)
    for fmt in {*formats, spec.matrix_format}:
        block = get_format(fmt).block_size
        bad = [n for n in (p.hidden, p.moe_intermediate, p.heads * p.head_dim) if n % block]
        if bad:
            raise ConfigError(f"format {fmt} needs rows that are a multiple of {block} values, "
                              f"but this geometry has rows of {bad[0]}; pick another format")
    return spec


def hf_config(spec: SynthSpec) -> dict[str, Any]:
    """config.json in the style of Qwen/Qwen3-30B-A3B's."""
    p = spec.preset
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": p.vocab - 3, "eos_token_id": p.vocab - 1,
        "decoder_sparse_step": 1, "head_dim": p.head_dim, "hidden_act": "silu",
        "hidden_size": p.hidden, "initializer_range": 0.02, "intermediate_size": p.intermediate,
        "max_position_embeddings": p.max_position, "max_window_layers": p.layers,
        "mlp_only_layers": [], "moe_intermediate_size": p.moe_intermediate,
        "norm_topk_prob": True, "num_attention_heads": p.heads, "num_experts": p.experts,
        "num_experts_per_tok": p.top_k, "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads, "output_router_logits": False,
        "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": p.rope_theta,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": p.vocab,
        "freetoken_synth": {"preset": p.name, "seed": spec.seed, "router_skew": spec.router_skew,
                            "router_locality": spec.router_locality},
    }


def tensor_plans(spec: SynthSpec, stacked: bool) -> list[TensorPlan]:
    """Every tensor under our name: experts stacked (GGUF) or one per expert (HF, all bf16)."""
    p, mat = spec.preset, spec.matrix_format if stacked else "bf16"
    norm = "f32" if stacked else "bf16"
    H, I_, E, q, kv = p.hidden, p.moe_intermediate, p.experts, p.heads * p.head_dim, p.kv_heads
    plans = [TensorPlan("model.embed_tokens.weight", (p.vocab, H), mat)]
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        plans += [
            TensorPlan(pre + "input_layernorm.weight", (H,), norm),
            TensorPlan(pre + "self_attn.q_proj.weight", (q, H), mat),
            TensorPlan(pre + "self_attn.k_proj.weight", (kv * p.head_dim, H), mat),
            TensorPlan(pre + "self_attn.v_proj.weight", (kv * p.head_dim, H), mat),
            TensorPlan(pre + "self_attn.o_proj.weight", (H, q), mat),
            TensorPlan(pre + "self_attn.q_norm.weight", (p.head_dim,), norm),
            TensorPlan(pre + "self_attn.k_norm.weight", (p.head_dim,), norm),
            TensorPlan(pre + "post_attention_layernorm.weight", (H,), norm),
            TensorPlan(pre + "mlp.gate.weight", (E, H), norm),
        ]
        shapes = {"gate_proj": (I_, H), "up_proj": (I_, H), "down_proj": (H, I_)}
        if stacked:
            plans += [TensorPlan(f"{pre}mlp.experts.{j}", (E, *s), spec.expert_formats[i])
                      for j, s in shapes.items()]
        else:
            plans += [TensorPlan(f"{pre}mlp.experts.{e}.{j}.weight", s, "bf16")
                      for e in range(E) for j, s in shapes.items()]
    return plans + [TensorPlan("model.norm.weight", (H,), norm),
                    TensorPlan("lm_head.weight", (p.vocab, H), mat)]


def plan_bytes(plan: TensorPlan) -> int:
    return math.prod(plan.shape[:-1]) * get_format(plan.fmt).row_bytes(plan.shape[-1])


