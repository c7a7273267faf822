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
}

_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.weight$")


def gguf_to_ours(name: str, family: str) -> str | None:
    """Our name for a GGUF tensor name, or None if we do not use that tensor."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if not m:
        return None
    layer, kind = m.groups()
    ours = _FFN_NORM[family] if kind == "ffn_norm" else _BLOCK.get(kind)
    return f"model.layers.{layer}.{ours}" if ours else None


def ours_to_gguf(name: str, family: str) -> str:
    """Inverse of :func:`gguf_to_ours` (for writing GGUF files)."""
    for k, v in _GLOBAL.items():
        if v == name:
            return k
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    if not m:
        raise KeyError(name)
    layer, rest = m.groups()
    if rest == _FFN_NORM[family]:
        return f"blk.{layer}.ffn_norm.weight"
    for k, v in _BLOCK.items():
        if v == rest:
            return f"blk.{layer}.{k}.weight"
    raise KeyError(name)
