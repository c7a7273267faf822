"""Map llama.cpp's GGUF tensor names to ours (the Hugging Face checkpoint names).

Expert tensors of a layer are stacked in GGUF (``blk.N.ffn_gate_exps.weight``: E x I x H) and
keep that shape under our stacked name ``model.layers.N.mlp.experts.gate_proj``. Hugging Face
directories store one tensor per expert (``...mlp.experts.E.gate_proj.weight``); the model
loader accepts both.
"""

from __future__ import annotations

import re

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK = {
    "attn_norm": "input_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight",
    "attn_k": "self_attn.k_proj.weight",
    "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight",
    "ffn_up": "mlp.up_proj.weight",
    "ffn_down": "mlp.down_proj.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
    "ffn_gate_inp": "mlp.gate.weight",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}

# ffn_norm is the norm before the MLP: post_attention_layernorm in Qwen (two norms per block),
# pre_feedforward_layernorm in Gemma-3 (four norms per block, the attention output has its own).
_FFN_NORM = {
    "qwen3_moe": "post_attention_layernorm.weight",
    "gemma3": "pre_feedforward_layernorm.weight",
    "gemma4": "pre_feedforward_layernorm.weight",
}

# Per family, by GGUF kind and suffix: what differs from the table above. Gemma-4's experts sit
# beside the MLP with a fused gate_up tensor and its router's two scales ride on ffn_gate_inp
# and ffn_down_exps; GPT-OSS's projections, router and experts carry biases.
_FAMILY: dict[str, dict[str, str]] = {
    "gemma4": {
        "ffn_gate_inp.weight": "router.proj.weight",
        "ffn_gate_inp.scale": "router.scale",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj",
        "ffn_down_exps.weight": "experts.down_proj",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
        "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
        "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
        "layer_output_scale.weight": "layer_scalar",
    },
    "gpt_oss": {
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
        "ffn_gate_exps.bias": "mlp.experts.gate_proj_bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj_bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
    },
}

_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias|scale)$")


def _block_table(family: str) -> dict[str, str]:
    """GGUF ``kind.suffix`` -> our name after ``model.layers.N.``, for ``family``."""
    table = {f"{k}.weight": v for k, v in _BLOCK.items()}
    if family in _FFN_NORM:
        table["ffn_norm.weight"] = _FFN_NORM[family]
    return table | _FAMILY.get(family, {})


def gguf_to_ours(name: str, family: str) -> str | None:
    """Our name for a GGUF tensor name, or None if we do not use that tensor."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if not m:
        return None
    layer, kind, suffix = m.groups()
    ours = _block_table(family).get(f"{kind}.{suffix}")
    return f"model.layers.{layer}.{ours}" if ours else None


def ours_to_gguf(name: str, family: str) -> str:
    """Inverse of :func:`gguf_to_ours` (for writing GGUF files)."""
    if name in DERIVED:
        return name
    for k, v in _GLOBAL.items():
        if v == name:
            return k
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if not m:
        raise KeyError(name)
    layer, rest = m.groups()
    # later entries win: ffn_norm over post_attention_norm in Qwen, the family's over both
    kind = {v: k for k, v in _block_table(family).items()}.get(rest)
    if kind is None:
        raise KeyError(name)
    return f"blk.{layer}.{kind}"


# GGUF tensors llama.cpp's converter derives from the config, written under their own name
DERIVED = ("rope_freqs.weight",)
