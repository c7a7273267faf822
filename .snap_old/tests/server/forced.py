"""Tiny checkpoints whose output is fixed: a real model, weights set so it must say it.

Every layer's output projections (attention's ``o_proj``, the MLP's and experts' ``down_proj``)
are zero, so the final hidden state is the current token's embedding. Token ``chain[i]``
embeds as basis vector ``i + 1`` and every other token as vector 0; the head maps vector 0 to
``chain[0]`` and vector ``i + 1`` to ``chain[i + 1]``, by a margin no temperature near 1
overturns. Whatever the prompt, the model emits the chain; its last token must be the EOS.
More generally (``force_graph``) each token names its successor and any other token is
followed by one default, so an output may loop. The tokenizer is byte-level with the
output's words as added tokens, markers special or not as the family's real tokenizer has
them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def force_graph(model: torch.nn.Module, nexts: dict[int, int], default: int) -> None:
    """Set ``model``'s weights so that the token after ``t`` is ``nexts[t]``, and after any
    other token ``default``, whatever came before."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    known = list(dict.fromkeys([*nexts, *nexts.values()]))
    assert len(known) + 1 <= emb.shape[1]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
            elif name.endswith("model.norm.weight"):
                p.fill_(8.0)  # logits 64 vs 0: the successor wins even when sampling at 1.0
        emb.zero_()
        emb[:, 0] = 1.0
        head.zero_()
        head[default, 0] = 1.0
        for i, t in enumerate(known):
            emb[t] = 0.0
            emb[t, i + 1] = 1.0
            if t in nexts:
                head[nexts[t], i + 1] = 1.0


def build(out: Path, text: list[str], specials: list[str], template: str, eos: str,
          make: Callable[[dict[str, int]], Any],
          loop: dict[str, str] | None = None) -> dict[str, int]:
    """Write a forced checkpoint to ``out``: the tokenizer (``text``'s words, ``specials``),
    the model ``make(ids)`` returns (ids by token text) forced to answer ``text`` then
    ``eos``, saved; ``loop`` adds successors by text, which may lead back into ``text``
    (each of ``text`` is then followed by the next of it only where ``loop`` says nothing).
    Returns the ids."""
    words = [t for t in dict.fromkeys([*text, *(loop or {}), *(loop or {}).values()])
             if t not in specials]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_files(out, words, specials, template)
    ids = {t: 256 + i for i, t in enumerate(words + specials)}
    torch.manual_seed(0)
    model = make(ids)
    chain = [ids[t] for t in text] + [ids[eos]]
    assert len(set(chain)) == len(chain), "a token repeats in text: say where it goes in loop"
    nexts = dict(zip(chain, chain[1:], strict=False))
    nexts.update({ids[a]: ids[b] for a, b in (loop or {}).items()})
    force_graph(model, nexts, chain[0])
    model.save_pretrained(out)
    return ids


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

    def make(ids: dict[str, int]) -> Any:
        eos = ids["<|endoftext|>"]
        return GptOssForCausalLM(GptOssConfig(
            vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
            eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
            layer_types=["sliding_attention", "full_attention"]))

    ids = build(out, text, HARMONY_SPECIALS, HARMONY_TEMPLATE, "<|endoftext|>", make)
    if stops:
        eos = ids["<|endoftext|>"]
        GenerationConfig(eos_token_id=[eos, *(ids[s] for s in stops)], pad_token_id=eos,
                         ).save_pretrained(out)
    return out


QWEN_SPECIALS = ["<|im_start|>", "<|endoftext|>", "<|im_end|>"]
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def qwen3_moe(out: Path, text: list[str], template: str = QWEN_TEMPLATE,
              loop: dict[str, str] | None = None, max_position: int = 512) -> Path:
    """A Qwen3-MoE directory that answers with the tokens of ``text`` then ``<|im_end|>``
    (``loop``: see ``build``); ``<think>`` and ``<tool_call>`` are plain added tokens, as in
    Qwen3's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def make(ids: dict[str, int]) -> Any:
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=max_position,
            eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
            bos_token_id=None))

    build(out, text, QWEN_SPECIALS, template, "<|im_end|>", make, loop)
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

    def make(ids: dict[str, int]) -> Any:
        eos = ids["<turn|>"]
        return Gemma4ForCausalLM(Gemma4TextConfig(
            vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
            num_experts=4, top_k_experts=2, moe_intermediate_size=32, sliding_window=8,
            hidden_size_per_layer_input=0, max_position_embeddings=512,
            tie_word_embeddings=False, layer_types=["sliding_attention", "full_attention"],
            eos_token_id=eos, pad_token_id=eos, bos_token_id=None))

    build(out, text, GEMMA4_SPECIALS, GEMMA4_TEMPLATE, "<turn|>", make)
    return out


GEMMA3_SPECIALS = ["<start_of_turn>", "<eos>", "<end_of_turn>"]
GEMMA3_TEMPLATE = (
    "{% if tools %}<start_of_turn>user\nTools: {{ tools | map(attribute='function') | "
    "map(attribute='name') | join(', ') }}<end_of_turn>\n{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}"
    "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3(out: Path, text: list[str]) -> Path:
    """A Gemma-3 (dense) directory that answers with the tokens of ``text`` then
    ``<end_of_turn>``; its tool calls are plain text (a ``tool_code`` block), as in Gemma-3.
    The head is untied from the embedding (the forcing needs them apart)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def make(ids: dict[str, int]) -> Any:
        eos = ids["<end_of_turn>"]
        return Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
            max_position_embeddings=512, query_pre_attn_scalar=16, tie_word_embeddings=False,
            eos_token_id=eos, pad_token_id=ids["<eos>"], bos_token_id=None))

    build(out, text, GEMMA3_SPECIALS, GEMMA3_TEMPLATE, "<end_of_turn>", make)
    return out
