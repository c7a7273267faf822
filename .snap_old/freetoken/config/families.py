"""The families whose configs need more than the shared keys: Gemma-4's and GPT-OSS's fields
from a Hugging Face ``config.json`` and from GGUF metadata, and the readers they share with
:mod:`freetoken.config.model` (token ids, rope parameters, per-layer values)."""

from __future__ import annotations

from typing import Any

from freetoken.config.rope import RopeSpec
from freetoken.errors import CheckpointError


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def hf_rope(cfg: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(theta, linear factor) for full and sliding layers, from v4 or v5 style config keys."""
    params = cfg.get("rope_parameters")
    out = {
        "full": (float(cfg.get("rope_theta", 10000.0)), 1.0),
        "sliding": (float(cfg.get("rope_local_base_freq", 10000.0)), 1.0),
    }
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        out["full"] = (out["full"][0], float(scaling["factor"]))
    if isinstance(params, dict):
        per_type = params if "full_attention" in params else {"full_attention": params}
        for ours, theirs in (("full", "full_attention"), ("sliding", "sliding_attention")):
            p = per_type.get(theirs)
            if p:
                factor = float(p.get("factor", 1.0)) if p.get("rope_type") == "linear" else 1.0
                out[ours] = (float(p.get("rope_theta", out[ours][0])), factor)
    return out


def _hf_rope_spec(p: dict[str, Any], theta: float) -> RopeSpec:
    kind = str(p.get("rope_type", p.get("type", "default")))
    if kind not in ("default", "linear", "proportional", "yarn"):
        raise CheckpointError(f"unsupported rope_type {kind!r} in config.json "
                              "(supported: default, linear, proportional, yarn)")
    return RopeSpec(
        theta=float(p.get("rope_theta", theta)), kind=kind, factor=float(p.get("factor") or 1.0),
        fraction=float(p.get("partial_rotary_factor", 1.0)),
        beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
        original_max_position=int(p.get("original_max_position_embeddings") or 0),
        truncate=bool(p.get("truncate", True)),
        attention_factor=float(p.get("attention_factor") or 0.0),
    )


def gemma4_from_hf(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """Gemma4TextConfig's fields (transformers.models.gemma4); the text decoder only."""
    n = common["num_layers"]
    for key, why in (("hidden_size_per_layer_input", "per-layer input embeddings"),
                     ("num_kv_shared_layers", "key/value sharing across layers")):
        if cfg.get(key):
            raise CheckpointError(f"this Gemma-4 checkpoint uses {why} ({key}={cfg[key]}), "
                                  "which FreeToken does not implement yet; the MoE and dense "
                                  "Gemma-4 models without it (26B-A4B, 31B) are supported")
    if cfg.get("use_bidirectional_attention") == "all":
        raise CheckpointError("a Gemma-4 config with use_bidirectional_attention='all' is not a "
                              "causal decoder; FreeToken serves causal models only")
    types = list(cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    sliding = tuple(t == "sliding_attention" for t in types)
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    if not overrides:
        full: dict[str, Any] = {"head_dim": int(cfg.get("global_head_dim", 512))}
        if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
        overrides = {i: full for i in range(n) if not sliding[i]}
    dims = tuple(int(overrides.get(i, {}).get("head_dim", common["head_dim"])) for i in range(n))
    kv = tuple(int(overrides.get(i, {}).get("num_key_value_heads", common["num_kv_heads"]))
               for i in range(n))
    rope = cfg.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1_000_000.0}}
    moe = bool(cfg.get("enable_moe_block"))
    out = dict(common)
    out.update(
        hidden_act=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        sliding_window=int(cfg.get("sliding_window") or 0), sliding_layers=sliding,
        rope_full=_hf_rope_spec(rope["full_attention"], 1_000_000.0),
        rope_sliding=_hf_rope_spec(rope["sliding_attention"], 10_000.0),
        layer_head_dims=dims, layer_kv_heads=kv, attention_k_eq_v=k_eq_v,
        final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        moe_layers=(moe,) * n,
    )
    if moe:
        out.update(num_experts=int(cfg["num_experts"]), top_k=int(cfg["top_k_experts"]),
                   moe_intermediate_size=int(cfg["moe_intermediate_size"]), norm_topk_prob=True)
    return out


def gpt_oss_from_hf(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    """GptOssConfig's fields (transformers.models.gpt_oss)."""
    n = common["num_layers"]
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not cfg.get("rope_parameters"):
        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096, **rope}
    spec = _hf_rope_spec(rope, float(cfg.get("rope_theta", 150_000.0)))
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    out = dict(common)
    out.update(
        hidden_act="swiglu_oai", intermediate_size=0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        sliding_window=int(cfg.get("sliding_window") or 0),
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        rope_full=spec, rope_sliding=spec, rope_theta=spec.theta,
        attention_bias=bool(cfg.get("attention_bias", True)),
        num_experts=experts, top_k=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
        moe_layers=(experts > 0,) * n, expert_bias=True,
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
    )
    return out


def per_layer(value: Any, n: int) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise CheckpointError(f"GGUF per-layer array of {len(value)} for {n} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n


def _uniform(value: Any, name: str) -> float:
    """A scalar key, or a per-layer array of one value."""
    values = set(value) if isinstance(value, list) else {value}
    if len(values) != 1:
        raise CheckpointError(f"GGUF key {name} differs between layers ({sorted(values)}); "
                              "FreeToken takes one value for all layers")
    return float(values.pop())


def gemma4_from_gguf(meta: dict[str, Any], key: Any, common: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's gemma4 keys: full-layer head size in key_length, sliding in
    key_length_swa; the full layers' proportional rope in the rope_freqs tensor (factor 1 on
    the pairs that rotate, 1e30 on the rest)."""
    n, a = common["num_layers"], "gemma4"
    for k, why in (("embedding_length_per_layer_input", "per-layer input embeddings"),
                   ("attention.shared_kv_layers", "key/value sharing across layers")):
        if meta.get(f"{a}.{k}"):
            raise CheckpointError(f"this Gemma-4 GGUF uses {why} ({a}.{k}), which FreeToken "
                                  "does not implement yet")
    pattern = meta.get(f"{a}.attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n:
        raise CheckpointError(f"GGUF file lacks {a}.attention.sliding_window_pattern (one bool "
                              "per layer); convert it again with a current llama.cpp")
    sliding = tuple(bool(x) for x in pattern)
    full_dim, swa_dim = int(key("attention.key_length")), int(key("attention.key_length_swa"))
    kv = per_layer(key("attention.head_count_kv"), n)
    freqs = meta.get("_rope_freqs")
    fraction = 1.0 if not freqs else sum(f < 1e29 for f in freqs) / len(freqs)
    experts = int(meta.get(f"{a}.expert_count") or 0)
    out = dict(common)
    out.update(
        hidden_act="gelu_pytorch_tanh", head_dim=swa_dim,
        sliding_window=int(key("attention.sliding_window")), sliding_layers=sliding,
        rope_theta=float(key("rope.freq_base")),
        rope_full=RopeSpec(float(key("rope.freq_base")), "proportional", fraction=fraction),
        rope_sliding=RopeSpec(float(key("rope.freq_base_swa"))),
        layer_head_dims=tuple(swa_dim if s else full_dim for s in sliding), layer_kv_heads=kv,
        num_kv_heads=kv[0], attention_k_eq_v=bool(meta.get("_k_eq_v", False)),
        final_logit_softcapping=float(meta.get(f"{a}.final_logit_softcapping") or 0.0),
        moe_layers=(experts > 0,) * n,
    )
    if experts:
        out.update(num_experts=experts, top_k=int(key("expert_used_count")),
                   moe_intermediate_size=int(key("expert_feed_forward_length")),
                   norm_topk_prob=True)
    return out


def gpt_oss_from_gguf(meta: dict[str, Any], key: Any, common: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's gpt-oss keys: yarn rope scaling, every other layer sliding (from the
    first), biased experts with the clamped SwiGLU (alpha 1.702 as llama.cpp fixes it; the
    limit from ``swiglu_clamp_exp`` where written, else llama.cpp's 7)."""
    n = common["num_layers"]
    a = "gpt-oss"
    if meta.get(f"{a}.rope.scaling.type", "yarn") != "yarn":
        raise CheckpointError(f"GPT-OSS GGUF with rope scaling "
                              f"{meta.get(f'{a}.rope.scaling.type')!r}; only yarn is known")
    theta = float(key("rope.freq_base"))
    spec = RopeSpec(theta, "yarn", factor=float(key("rope.scaling.factor", 32.0)),
                    beta_fast=float(meta.get(f"{a}.rope.scaling.yarn_beta_fast") or 32.0),
                    beta_slow=float(meta.get(f"{a}.rope.scaling.yarn_beta_slow") or 1.0),
                    original_max_position=int(key("rope.scaling.original_context_length",
                                                  4096)))
    experts = int(key("expert_count"))
    out = dict(common)
    out.update(
        hidden_act="swiglu_oai", intermediate_size=0,
        sliding_window=int(key("attention.sliding_window")),
        sliding_layers=tuple(i % 2 == 0 for i in range(n)),
        rope_full=spec, rope_sliding=spec, attention_bias=True,
        num_experts=experts, top_k=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")), norm_topk_prob=True,
        moe_layers=(True,) * n, expert_bias=True, swiglu_alpha=1.702,
        swiglu_limit=_uniform(meta.get(f"{a}.swiglu_clamp_exp", 7.0), "swiglu_clamp_exp"),
    )
    return out
