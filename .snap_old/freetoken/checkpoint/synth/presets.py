"""Preset geometries, the resolved synth spec, and the tensor plan of a synthetic checkpoint."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from freetoken.checkpoint.gguf_writer import TensorPlan
from freetoken.errors import ConfigError
from freetoken.quant import FORMATS, get_format, gguf_block_size, gguf_row_bytes, gguf_type_of

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # the last ids of the vocabulary


@dataclass(frozen=True)
class Preset:
    """A model geometry in ``family``'s architecture; ``expert_format`` is the default
    --expert-format spec. Gemma-4's full layers have heads of ``full_head_dim`` and
    ``full_kv_heads`` KV heads; ``sliding_window`` is the sliding layers' window."""

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
    family: str = "qwen3_moe"
    sliding_window: int = 0
    full_head_dim: int = 0
    full_kv_heads: int = 0


# UD-Q8_K_XL's mix: 29 layers of q8_0 experts and one of bf16
_GEMMA4 = Preset("gemma4-26b-a4b", 2816, 704, 128, 8, 30, 16, 8, 256, 262144, "q8_0*,bf16",
                 2112, 262144, 10_000.0, "gemma4", 1024, 512, 2)

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen3-30b-a3b", 2048, 768, 128, 8, 48, 32, 4, 128, 151936, "bf16", 6144, 40960),
    _GEMMA4,
    # the MXFP4 and NVFP4 GGUFs' experts; a variant is a preset so that `ft bench bw --preset`
    # has it too
    dataclasses.replace(_GEMMA4, name="gemma4-26b-a4b-mxfp4", expert_format="mxfp4"),
    dataclasses.replace(_GEMMA4, name="gemma4-26b-a4b-nvfp4", expert_format="nvfp4"),
    Preset("gpt-oss-20b", 2880, 2880, 32, 4, 24, 64, 8, 64, 201088, "mxfp4", 2880, 131072,
           150_000.0, "gpt_oss", 128),
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
        if fmt not in FORMATS or gguf_type_of(fmt) is None:
            choices = ", ".join(n for n in FORMATS if gguf_type_of(n) is not None)
            what = (f"{fmt} has no GGUF encoding here (it is read from Hugging Face "
                    "checkpoints only)" if fmt in FORMATS else f"unknown expert format {fmt!r}")
            raise ConfigError(f"{what} in --expert-format {spec!r} (choose from {choices})")
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
    if not gguf and p.family != "qwen3_moe":
        raise ConfigError(f"--preset {p.name} ({p.family}) is written as GGUF only; "
                          "pass --out PATH.gguf")
    if not gguf and set(formats) != {"bf16"}:
        raise ConfigError(
            f"expert format(s) {', '.join(sorted(set(formats) - {'bf16'}))} cannot be written "
            "to a Hugging Face directory (bf16 only); write a .gguf --out or pass "
            "--expert-format bf16"
        )
    spec = SynthSpec(p, formats, router_skew, router_locality, seed)
    rows = (p.hidden, p.moe_intermediate, p.heads * p.head_dim, p.heads * p.full_head_dim,
            p.intermediate if p.family == "gemma4" else 0)
    for fmt in {*formats, spec.matrix_format}:
        block = gguf_block_size(fmt)
        bad = [n for n in rows if n % block]
        if bad:
            raise ConfigError(f"format {fmt} needs rows that are a multiple of {block} values, "
                              f"but this geometry has rows of {bad[0]}; pick another format")
    return spec


def hf_config(spec: SynthSpec) -> dict[str, Any]:
    """config.json of the preset's architecture (Qwen/Qwen3-30B-A3B's style for Qwen3-MoE)."""
    p = spec.preset
    synth = {"preset": p.name, "seed": spec.seed, "router_skew": spec.router_skew,
             "router_locality": spec.router_locality}
    if p.family == "gpt_oss":
        return _gpt_oss_config(p) | {"freetoken_synth": synth}
    if p.family == "gemma4":
        return _gemma4_config(p) | {"freetoken_synth": synth}
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
        "vocab_size": p.vocab, "freetoken_synth": synth,
    }


def layer_types(p: Preset) -> list[str]:
    """Sliding and full layers: GPT-OSS's in turn, Gemma-4's one full in six and the last."""
    if p.family == "gpt_oss":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(p.layers)]
    return ["full_attention" if (i + 1) % 6 == 0 or i == p.layers - 1 else "sliding_attention"
            for i in range(p.layers)]


def _gpt_oss_config(p: Preset) -> dict[str, Any]:
    """config.json in the style of openai/gpt-oss-20b's (its experts unquantised). Its yarn
    dims are truncated as a GGUF's are read (llama.cpp rounds them; openai's config does not)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "attention_bias": True, "attention_dropout": 0.0,
        "bos_token_id": p.vocab - 3, "eos_token_id": p.vocab - 1, "pad_token_id": p.vocab - 3,
        "head_dim": p.head_dim, "hidden_act": "silu", "hidden_size": p.hidden,
        "initializer_range": 0.02, "intermediate_size": p.moe_intermediate,
        "layer_types": layer_types(p), "max_position_embeddings": p.max_position,
        "num_attention_heads": p.heads, "num_experts_per_tok": p.top_k,
        "num_hidden_layers": p.layers, "num_key_value_heads": p.kv_heads,
        "num_local_experts": p.experts, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": True, "rope_theta": p.rope_theta,
                            "original_max_position_embeddings": 4096},
        "sliding_window": p.sliding_window, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": p.vocab,
    }


def _gemma4_config(p: Preset) -> dict[str, Any]:
    """The text decoder's config.json in the style of google/gemma-4-26B-A4B's."""
    return {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True,
        "bos_token_id": p.vocab - 3, "eos_token_id": p.vocab - 1, "pad_token_id": p.vocab - 3,
        "enable_moe_block": True, "final_logit_softcapping": 30.0,
        "global_head_dim": p.full_head_dim, "head_dim": p.head_dim,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": p.hidden,
        "hidden_size_per_layer_input": 0, "initializer_range": 0.02,
        "intermediate_size": p.intermediate, "layer_types": layer_types(p),
        "max_position_embeddings": p.max_position, "moe_intermediate_size": p.moe_intermediate,
        "num_attention_heads": p.heads, "num_experts": p.experts,
        "num_global_key_value_heads": p.full_kv_heads, "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads, "num_kv_shared_layers": 0, "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": p.rope_theta}},
        "sliding_window": p.sliding_window, "tie_word_embeddings": True,
        "top_k_experts": p.top_k, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": p.vocab,
    }


def tensor_plans(spec: SynthSpec, stacked: bool) -> list[TensorPlan]:
    """Every tensor under our name: experts stacked (GGUF) or one per expert (HF, all bf16)."""
    if spec.preset.family == "gpt_oss":
        return _gpt_oss_plans(spec)
    if spec.preset.family == "gemma4":
        return _gemma4_plans(spec)
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


def _gpt_oss_plans(spec: SynthSpec) -> list[TensorPlan]:
    """GPT-OSS's tensors, experts stacked: biased attention with sinks, a biased router,
    biased experts; norms, biases and sinks f32."""
    p, mat = spec.preset, spec.matrix_format
    H, I_, E, q, kv = p.hidden, p.moe_intermediate, p.experts, p.heads * p.head_dim, p.kv_heads
    plans = [TensorPlan("model.embed_tokens.weight", (p.vocab, H), mat)]
    for i in range(p.layers):
        pre, fmt = f"model.layers.{i}.", spec.expert_formats[i]
        for proj, rows, cols in (("q_proj", q, H), ("k_proj", kv * p.head_dim, H),
                                 ("v_proj", kv * p.head_dim, H), ("o_proj", H, q)):
            plans += [TensorPlan(f"{pre}self_attn.{proj}.weight", (rows, cols), mat),
                      TensorPlan(f"{pre}self_attn.{proj}.bias", (rows,), "f32")]
        plans += [
            TensorPlan(pre + "input_layernorm.weight", (H,), "f32"),
            TensorPlan(pre + "self_attn.sinks", (p.heads,), "f32"),
            TensorPlan(pre + "post_attention_layernorm.weight", (H,), "f32"),
            TensorPlan(pre + "mlp.router.weight", (E, H), "f32"),
            TensorPlan(pre + "mlp.router.bias", (E,), "f32"),
        ]
        for proj, shape in (("gate_proj", (I_, H)), ("up_proj", (I_, H)),
                            ("down_proj", (H, I_))):
            plans += [TensorPlan(f"{pre}mlp.experts.{proj}", (E, *shape), fmt),
                      TensorPlan(f"{pre}mlp.experts.{proj}_bias", (E, shape[0]), "f32")]
    return plans + [TensorPlan("model.norm.weight", (H,), "f32"),
                    TensorPlan("lm_head.weight", (p.vocab, H), mat)]


def _gemma4_plans(spec: SynthSpec) -> list[TensorPlan]:
    """Gemma-4's tensors, experts stacked: per layer type attention geometry (full layers
    take v from k's projection), the dense MLP beside the router and experts, the head tied."""
    p, mat = spec.preset, spec.matrix_format
    H, I_, E = p.hidden, p.moe_intermediate, p.experts
    plans = [TensorPlan("model.embed_tokens.weight", (p.vocab, H), mat)]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
             "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
    for i, kind in enumerate(layer_types(p)):
        pre, fmt = f"model.layers.{i}.", spec.expert_formats[i]
        full = kind == "full_attention"
        D, kv = (p.full_head_dim, p.full_kv_heads) if full else (p.head_dim, p.kv_heads)
        plans += [TensorPlan(f"{pre}{n}.weight", (H,), "f32") for n in norms]
        plans += [
            TensorPlan(pre + "layer_scalar", (1,), "f32"),
            TensorPlan(pre + "self_attn.q_proj.weight", (p.heads * D, H), mat),
            TensorPlan(pre + "self_attn.k_proj.weight", (kv * D, H), mat),
            *([] if full else [TensorPlan(pre + "self_attn.v_proj.weight", (kv * D, H), mat)]),
            TensorPlan(pre + "self_attn.o_proj.weight", (H, p.heads * D), mat),
            TensorPlan(pre + "self_attn.q_norm.weight", (D,), "f32"),
            TensorPlan(pre + "self_attn.k_norm.weight", (D,), "f32"),
            TensorPlan(pre + "mlp.gate_proj.weight", (p.intermediate, H), mat),
            TensorPlan(pre + "mlp.up_proj.weight", (p.intermediate, H), mat),
            TensorPlan(pre + "mlp.down_proj.weight", (H, p.intermediate), mat),
            TensorPlan(pre + "router.proj.weight", (E, H), "f32"),
            TensorPlan(pre + "router.scale", (H,), "f32"),
            TensorPlan(pre + "router.per_expert_scale", (E,), "f32"),
            TensorPlan(pre + "experts.gate_up_proj", (E, 2 * I_, H), fmt),
            TensorPlan(pre + "experts.down_proj", (E, H, I_), fmt),
        ]
    return plans + [TensorPlan("model.norm.weight", (H,), "f32")]


def plan_bytes(plan: TensorPlan) -> int:
    return math.prod(plan.shape[:-1]) * gguf_row_bytes(plan.fmt, plan.shape[-1])


