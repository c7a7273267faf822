"""Frozen configuration: what the model is (ModelConfig) and how we run it (EngineConfig).

ModelConfig is built from a Hugging Face ``config.json`` (:meth:`ModelConfig.from_hf`) or from
GGUF metadata (:meth:`ModelConfig.from_gguf`); both give the same object for the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.errors import CheckpointError

# Hugging Face architecture name -> our family name. GGUF ``general.architecture`` -> family.
HF_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4", "Gemma4ForConditionalGeneration": "gemma4",
    "GptOssForCausalLM": "gpt_oss",
}
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3", "gemma4": "gemma4",
                      "gpt-oss": "gpt_oss"}


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rotary embedding, as Hugging Face's ``rope_parameters`` describe it.

    kind: ``default``; ``linear`` (positions / factor); ``proportional`` (Gemma-4: the first
    ``fraction`` of each head's frequency pairs rotate, the rest do not); ``yarn`` (GPT-OSS:
    frequencies blended between extrapolation and interpolation by ``factor`` over the
    correction range of ``beta_fast``..``beta_slow`` rotations, cos/sin scaled by
    ``attention_factor``, 0.1 ln(factor) + 1 unless given).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    fraction: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position: int = 0
    truncate: bool = True
    attention_factor: float = 0.0  # 0: from factor


@dataclass(frozen=True)
class ModelConfig:
    """Geometry and numerics of one decoder-only model. Layer-wise facts are tuples per layer."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    intermediate_size: int = 0  # dense MLP width (0: no dense MLP layers)
    hidden_act: str = "silu"
    # Mixture of experts
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: True where the MLP is an MoE block
    # Gemma-3: sliding-window layers with their own rope base, scaled attention
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where attention is windowed
    rope_local_theta: float = 0.0
    rope_scaling_factor: float = 1.0  # linear position scaling on full-attention layers
    query_pre_attn_scalar: float = 0.0  # 0: 1/sqrt(head_dim)
    final_logit_softcapping: float = 0.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma-4 and GPT-OSS: rotary per layer type (None: the fields above), per-layer attention
    # geometry where layer types differ (empty: head_dim / num_kv_heads everywhere)
    rope_full: RopeSpec | None = None
    rope_sliding: RopeSpec | None = None
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    attention_k_eq_v: bool = False  # Gemma-4: full-attention layers reuse k's projection as v
    attention_bias: bool = False  # GPT-OSS: q/k/v/o projections carry biases
    expert_bias: bool = False  # GPT-OSS: experts' gate/up/down carry biases
    swiglu_alpha: float = 0.0  # GPT-OSS experts (hidden_act swiglu_oai): sigmoid gain
    swiglu_limit: float = 0.0  # and clamp

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    @property
    def kv_shape(self) -> tuple[int, int]:
        """(heads, head dim) of one token's keys in the KV pool: the widest layer's; narrower
        layers use the front of the row."""
        shapes = [(self.kv_heads_of(i), self.head_dim_of(i)) for i in range(self.num_layers)]
        return max(shapes, key=lambda s: s[0] * s[1])

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @staticmethod
    def from_hf(cfg: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """From a parsed ``config.json`` and, where the checkpoint has one, its parsed
        ``generation_config.json``: the stop tokens are both files' ``eos_token_id`` (GPT-OSS
        lists ``<|return|>`` and ``<|call|>`` there, Gemma-4 its end-of-turn ids), config.json's
        first, each once. Raises CheckpointError for unknown architectures."""
        arch = (cfg.get("architectures") or ["?"])[0]
        family = HF_ARCHITECTURES.get(arch)
        if family is None:
            raise CheckpointError(
                f"unsupported architecture {arch!r} in config.json "
                f"(supported: {', '.join(HF_ARCHITECTURES)})"
            )
        if "text_config" in cfg:
            cfg = {**cfg, **cfg["text_config"]}
        n = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = _hf_rope(cfg)
        common: dict[str, Any] = dict(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope["full"][0],
            rope_scaling_factor=rope["full"][1],
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(
                _ids(cfg.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id")))),
        )
        if family in ("gemma4", "gpt_oss"):
            make = _gemma4_hf if family == "gemma4" else _gpt_oss_hf
            return ModelConfig(**make(cfg, common))
        if family == "qwen3_moe":
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            step = int(cfg.get("decoder_sparse_step", 1)) or 1
            dense = set(cfg.get("mlp_only_layers") or [])
            return ModelConfig(
                **common,
                num_experts=experts,
                top_k=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_layers=tuple(
                    experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)
                ),
            )
        types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern", 6)) == 0
            else "sliding_attention"
            for i in range(n)
        ]
        return ModelConfig(
            **common,
            moe_layers=(False,) * n,
            sliding_window=int(cfg.get("sliding_window") or 0),
            sliding_layers=tuple(t == "sliding_attention" for t in types),
            rope_local_theta=rope["sliding"][0],
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0.0),
            final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0),
        )

    @staticmethod
    def from_gguf(meta: dict[str, Any]) -> ModelConfig:
        """From GGUF metadata (key -> python value), as llama.cpp reads the same keys."""
        arch = str(meta.get("general.architecture", "?"))
        family = GGUF_ARCHITECTURES.get(arch)
        if family is None:
            raise CheckpointError(
                f"unsupported GGUF architecture {arch!r} "
                f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
            )

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise CheckpointError(f"GGUF file lacks the metadata key {arch}.{name}")
            return value

        n = int(key("block_count"))
        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        head_dim = int(key("attention.key_length", hidden // heads))
        vocab = meta.get("_vocab_size") or meta.get(f"{arch}.vocab_size")
        if not vocab:
            raise CheckpointError("GGUF file has no token_embd.weight tensor; it is incomplete")
        scaling = meta.get(f"{arch}.rope.scaling.type")
        common: dict[str, Any] = dict(
            family=family,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=_per_layer(key("attention.head_count_kv", heads), n)[0],
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling_factor=float(key("rope.scaling.factor", 1.0))
            if scaling == "linear" else 1.0,
            max_position=int(key("context_length", 4096)),
            tie_word_embeddings=bool(meta.get("_tied_output", False)),
            intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or 0),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(_ids(meta.get("tokenizer.ggml.eos_token_id"))
                                              + _ids(meta.get("_end_of_turn_ids")))),
        )
        if family in ("gemma4", "gpt_oss"):
            make = _gemma4_gguf if family == "gemma4" else _gpt_oss_gguf
            return ModelConfig(**make(meta, key, common))
        if family == "qwen3_moe":
            experts = int(key("expert_count"))
            return ModelConfig(
                **common,
                num_experts=experts,
                top_k=int(key("expert_used_count")),
                moe_intermediate_size=int(key("expert_feed_forward_length")),
                # llama.cpp always renormalises qwen3moe's top-k weights
                norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
                moe_layers=tuple(i in meta.get("_moe_layers", range(n)) for i in range(n)),
                hidden_act="silu",
            )
        # Gemma-3 is dense; an expert count marks a file whose MLPs were made MoE blocks.
        experts = int(meta.get(f"{arch}.expert_count") or 0)
        moe: dict[str, Any] = dict(moe_layers=(False,) * n)
        if experts > 0:
            moe = dict(
                num_experts=experts,
                top_k=int(key("expert_used_count")),
                moe_intermediate_size=int(key("expert_feed_forward_length")),
                norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
                moe_layers=tuple(i in meta.get("_moe_layers", range(n)) for i in range(n)),
            )
        # llama.cpp: every 6th Gemma-3 layer attends globally, the rest use a 10k rope base.
        return ModelConfig(
            **common,
            **moe,
            hidden_act="gelu_pytorch_tanh",
            sliding_window=int(key("attention.sliding_window", 0)),
            sliding_layers=tuple((i + 1) % 6 != 0 for i in range(n)),
            rope_local_theta=10000.0,
            query_pre_attn_scalar=float(head_dim),
            final_logit_softcapping=float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),
        )


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _hf_rope(cfg: dict[str, Any]) -> dict[str, tuple[float, float]]:
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


def _gemma4_hf(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
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


def _gpt_oss_hf(cfg: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
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


def _per_layer(value: Any, n: int) -> tuple[int, ...]:
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


def _gemma4_gguf(meta: dict[str, Any], key: Any, common: dict[str, Any]) -> dict[str, Any]:
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
    kv = _per_layer(key("attention.head_count_kv"), n)
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


def _gpt_oss_gguf(meta: dict[str, Any], key: Any, common: dict[str, Any]) -> dict[str, Any]:
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


def human_bytes(n: float) -> str:
    """``4GB``, ``9.44MB``, ``512KB``: decimal units, three significant digits."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{int(n)}B"


@dataclass(frozen=True)
class CacheSizing:
    """One of the mutually exclusive expert-cache flags; slots are worked out after the weights
    are loaded (``moe/plan.py:plan_moe_cache``), when each layer's expert size is known.

    kind: ``mem`` (value in bytes), ``rate`` (fraction of all experts), ``size`` (slots), or
    ``auto`` (the device memory the weights leave, less the KV floor), which the MoE plan
    turns into ``mem`` with ``from_auto`` set (:meth:`resolved`) before the model is built.
    """

    kind: str = "auto"
    value: float = 0.0
    from_auto: bool = False  # a ``mem`` budget the plan worked out for --moe-cache-auto

    @staticmethod
    def resolved(budget: int) -> CacheSizing:
        """``--moe-cache-auto`` made concrete: ``budget`` bytes."""
        return CacheSizing("mem", float(budget), from_auto=True)

    def describe(self) -> str:
        if self.from_auto or self.kind == "auto":
            return "--moe-cache-auto"
        if self.kind == "mem":
            return f"--moe-cache-mem {human_bytes(self.value)}"
        if self.kind == "rate":
            return f"--moe-cache-rate {self.value:g}"
        if self.kind == "size":
            return f"--moe-cache-size {int(self.value)}"
        return self.kind


# Idle CPU pool workers spin this long for the next job before they sleep (--moe-cpu-spin-us):
# decode hands the pool one job per layer a fraction of a millisecond apart, and a futex
# wake-up costs tens of microseconds in a VM.
MOE_CPU_SPIN_US = 1000
KV_RESERVE_TOKENS = 8192  # KV tokens --moe-cache-auto leaves room for (--kv-reserve-tokens)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model, as the flags ask once validated.

    Device, dtype, graphs and ``cpu_dense`` are resolved (no ``auto``). The MoE requests
    (``moe_strategy``, ``moe_cache``, ``moe_cpu_threads``, ``moe_hybrid_max_fetch``) may still
    say ``auto``: resolving them needs the checkpoint and the device's free memory, so
    ``moe/plan.py:plan_moe`` turns them into a frozen, logged ``MoEPlan`` in the engine
    process, before the model is built.
    """

    model: str
    device: str
    dtype: str  # torch dtype name used for compute: float32, bfloat16, float16
    moe_strategy: str  # a registered strategy, or "auto" (per layer, by the plan)
    max_seq_len: int
    cuda_graph_max_bs: int = 0  # 0: decode runs eagerly (always on the CPU)
    moe_cpu_threads: int = 0  # CPU expert workers (0: one per usable core but the first)
    moe_cpu_spin_us: int = MOE_CPU_SPIN_US  # how long idle CPU workers spin, then sleep
    moe_cache: CacheSizing = CacheSizing()  # the expert cache of offloaded layers
    kv_reserve_tokens: int = KV_RESERVE_TOKENS
    # hybrid: experts fetched per layer call at most, or "auto" (from the profile row)
    moe_hybrid_max_fetch: int | str = "auto"
    moe_hybrid_online: bool = True  # hybrid corrects its fetch fraction from measured times
    # cached layers fetch the next layer's predicted experts early: "auto" (offload only),
    # "on" (hybrid too) or "off"
    moe_lookahead: str = "auto"
    cpu_dense: str = "torch"  # dense layers on the CPU: "torch" (f32/bf16) or "pool" (own format)
