"""Frozen configuration: what the model is (ModelConfig) and how we run it (EngineConfig).

ModelConfig is built from a Hugging Face ``config.json`` (:meth:`ModelConfig.from_hf`) or from
GGUF metadata (:meth:`ModelConfig.from_gguf`); both give the same object for the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.errors import CheckpointError

# Hugging Face architecture name -> our family name. GGUF ``general.architecture`` -> family.
HF_ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Gemma3ForCausalLM": "gemma3"}
GGUF_ARCHITECTURES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3"}


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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.moe_layers)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        """From a parsed ``config.json``. Raises CheckpointError for unknown architectures."""
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
            eos_token_ids=_ids(cfg.get("eos_token_id")),
        )
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
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling_factor=float(key("rope.scaling.factor", 1.0))
            if scaling == "linear" else 1.0,
            max_position=int(key("context_length", 4096)),
            tie_word_embeddings=bool(meta.get("_tied_output", False)),
            intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or 0),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_ids(meta.get("tokenizer.ggml.eos_token_id")),
        )
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
    cpu_dense: str = "torch"  # dense layers on the CPU: "torch" (f32/bf16) or "pool" (own format)
