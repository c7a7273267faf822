"""What the model is: :class:`ModelConfig`, built from a Hugging Face ``config.json``
(:meth:`ModelConfig.from_hf`) or from GGUF metadata (:meth:`ModelConfig.from_gguf`); both give
the same object for the same model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.config.families import (
    gemma4_from_gguf,
    gemma4_from_hf,
    gpt_oss_from_gguf,
    gpt_oss_from_hf,
    hf_rope,
    per_layer,
    token_ids,
)
from freetoken.config.rope import RopeSpec
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
        rope = hf_rope(cfg)
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
                token_ids(cfg.get("eos_token_id"))
                + token_ids((generation or {}).get("eos_token_id")))),
        )
        if family in ("gemma4", "gpt_oss"):
            make = gemma4_from_hf if family == "gemma4" else gpt_oss_from_hf
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
            num_kv_heads=per_layer(key("attention.head_count_kv", heads), n)[0],
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling_factor=float(key("rope.scaling.factor", 1.0))
            if scaling == "linear" else 1.0,
            max_position=int(key("context_length", 4096)),
            tie_word_embeddings=bool(meta.get("_tied_output", False)),
            intermediate_size=int(meta.get(f"{arch}.feed_forward_length") or 0),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(token_ids(meta.get("tokenizer.ggml.eos_token_id"))
                                              + token_ids(meta.get("_end_of_turn_ids")))),
        )
        if family in ("gemma4", "gpt_oss"):
            make = gemma4_from_gguf if family == "gemma4" else gpt_oss_from_gguf
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
