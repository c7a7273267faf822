"""Tiny checkpoints whose output is fixed: a real model, weights set so it must say it.

Every layer's output projections (attention's ``o_proj``, the MLP's and experts' ``down_proj``)
are zero, so the final hidden state is the current token's embedding. Token ``chain[i]``
embeds as basis vector ``i + 1`` and every other token as vector 0; the head maps vector 0 to
``chain[0]`` and vector ``i + 1`` to ``chain[i + 1]``, by a margin no temperature near 1
overturns. Whatever the prompt, the model emits the chain; its last token must be the EOS.
The tokenizer is byte-level with the chain's words as added tokens, markers special or not as
the family's real tokenizer has them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def tokenizer_files(out: Path, words: list[str], specials: list[str], template: str) -> None:
    """A byte-level tokenizer: 256 byte tokens, ``words`` as plain added tokens, ``specials``
    as special ones (ids in that order after the bytes)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    spell = _byte_spelling()
    tok = Tokenizer(models.BPE({spell[b]: b for b in range(256)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in words])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": specials[-1], "chat_template": template,
        "clean_up_tokenization_spaces": False}))


def force(model: torch.nn.Module, chain: list[int]) -> None:
    """Set ``model``'s weights so that greedy decoding emits ``chain`` (see the module)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    assert len(chain) + 1 <= emb.shape[1] and len(set(chain)) == len(chain)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
            elif name.endswith("model.norm.weight"):
                p.fill_(8.0)  # logits 64 vs 0: the chain wins even when sampling at 1.0
        emb.zero_()
        emb[:, 0] = 1.0
        head.zero_()
        head[chain[0], 0] = 1.0
        for i, t in enumerate(chain):
            emb[t] = 0.0
            emb[t, i + 1] = 1.0
            if i + 1 < len(chain):
                head[chain[i + 1], i + 1] = 1.0


def _byte_spelling() -> dict[int, str]:
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


HARMONY_SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                    "<|call|>", "<|constrain|>", "<|endoftext|>"]
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}"
                    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
                    "{% endif %}")


def gpt_oss(out: Path, text: list[str], stops: tuple[str, ...] = ()) -> Path:
    """A GPT-OSS directory that answers every prompt with the tokens of ``text`` (each a harmony
    special token or a word) and then its EOS, ``<|endoftext|>``: a token the harmony parser
    does not know, so only its being dropped keeps it out of the content. ``stops``: special
    tokens generation_config.json lists beside the EOS, as gpt-oss's lists ``<|return|>`` and
    ``<|call|>``; the output ends at the first of them in ``text``."""
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    words = [t for t in text if t not in HARMONY_SPECIALS]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out, words, HARMONY_SPECIALS, HARMONY_TEMPLATE)
    ids = {t: 256 + i for i, t in enumerate(words + HARMONY_SPECIALS)}
    eos = ids["<|endoftext|>"]
    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
        layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg)
    force(model, [ids[t] for t in text] + [eos])
    model.save_pretrained(out)
    if stops:
        GenerationConfig(eos_token_id=[eos, *(ids[s] for s in stops)], pad_token_id=eos,
                         ).save_pretrained(out)
    return out


QWEN_SPECIALS = ["<|im_start|>", "<|endoftext|>", "<|im_end|>"]
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def qwen3_moe(out: Path, text: list[str]) -> Path:
    """A Qwen3-MoE directory that answers with the tokens of ``text`` then ``<|im_end|>``;
    ``<think>`` and ``<tool_call>`` are plain added tokens, as in Qwen3's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    words = list(dict.fromkeys(text))
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out, words, QWEN_SPECIALS, QWEN_TEMPLATE)
    ids = {t: 256 + i for i, t in enumerate(words + QWEN_SPECIALS)}
    eos = ids["<|im_end|>"]
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
        eos_token_id=eos, pad_token_id=ids["<|endoftext|>"], bos_token_id=None)
    model = Qwen3MoeForCausalLM(cfg)
    force(model, [ids[t] for t in text] + [eos])
    model.save_pretrained(out)
    return out


GEMMA4_SPECIALS = ["<|turn>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                   "<tool_response|>", "<|channel>", "<channel|>", "<turn|>"]
GEMMA4_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|tool_response>response:"
    "{{ m['name'] or 'tool' }}{value:{{ m['content'] }}}<tool_response|>{% else %}<|turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] or [] %}<|tool_call>call:{{ c['function']['name'] }}{}"
    "<tool_call|>{% endfor %}<turn|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}")


def gemma4(out: Path, text: list[str]) -> Path:
    """A Gemma-4 (MoE) directory that answers with the tokens of ``text`` then ``<turn|>``;
    the turn and tool-call markers are special tokens, as in Gemma-4's tokenizer. The head is
    untied from the embedding (the forcing needs them apart)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    words = [t for t in text if t not in GEMMA4_SPECIALS]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out, words, GEMMA4_SPECIALS, GEMMA4_TEMPLATE)
    ids = {t: 256 + i for i, t in enumerate(words + GEMMA4_SPECIALS)}
    eos = ids["<turn|>"]
    torch.manual_seed(0)
    cfg = Gemma4TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, sliding_window=8,
        hidden_size_per_layer_input=0, max_position_embeddings=512, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    model = Gemma4ForCausalLM(cfg)
    force(model, [ids[t] for t in text] + [eos])
    model.save_pretrained(out)
    return out
