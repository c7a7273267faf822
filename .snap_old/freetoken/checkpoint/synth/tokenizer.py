"""The synthetic byte-level BPE tokenizer, as HF files and as GGUF metadata."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from freetoken.checkpoint.synth.presets import SPECIALS, SynthSpec

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def vocabulary(size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Tokens (byte-level spelling, ``size`` of them) and BPE merges, best first."""
    spell = _byte_spelling()
    tokens = [spell[b] for b in range(256)]
    merges: list[tuple[str, str]] = []
    room = size - 256 - len(SPECIALS)
    space = spell[ord(" ")]
    for n in itertools.count(1):
        for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=n):
            word = "".join(letters)
            pieces = [(space + word[:-1] if n > 1 else space, word[-1])]
            if n > 1:
                pieces.insert(0, (word[:-1], word[-1]))
            for a, b in pieces:
                if len(merges) == room:
                    return tokens + list(SPECIALS), merges
                tokens.append(a + b)
                merges.append((a, b))
    raise AssertionError("unreachable")


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens with it)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def hf_tokenizer_files(spec: SynthSpec, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = vocabulary(spec.preset.vocab)
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": SPECIALS[2],
        "pad_token": SPECIALS[0], "unk_token": None, "add_bos_token": False,
        "add_prefix_space": False, "model_max_length": spec.preset.max_position,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }, indent=2))


def gguf_tokenizer_metadata(spec: SynthSpec) -> dict[str, Any]:
    tokens, merges = vocabulary(spec.preset.vocab)
    v = spec.preset.vocab
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (v - len(SPECIALS)) + [3] * len(SPECIALS),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": v - 3, "tokenizer.ggml.eos_token_id": v - 1,
        "tokenizer.ggml.padding_token_id": v - 3, "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


