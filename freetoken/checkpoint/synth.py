"""Synthetic checkpoints at real geometry (``ft synth``): random weights, a byte-level BPE
tokenizer, and routers with tunable expert popularity.

Every preset is written in the Qwen3-MoE architecture (DESIGN.md §9), as a Hugging Face
directory (bf16 safetensors, sharded) or a GGUF file (per-layer expert formats). Weights are
drawn per tensor from ``(seed, tensor name)``, so a tensor does not depend on which others are
written: an HF directory and a GGUF file of one seed hold the same bf16 values.

The residual stream is split (by a seeded permutation of the hidden dims) into three parts:

    u  one dim, a constant c in every token's embedding: q_proj/k_proj read only u, so queries
       and keys are content-free and rotary turns attention into a recency window of about
       ``WINDOW`` tokens; the router's u column is a per-expert bias (``--router-skew``)
    S  a quarter of the dims, written only by o_proj: a moving average over recent tokens, the
       slowly varying part of the router input (``--router-locality``)
    F  the rest: token embeddings and expert outputs, the token-specific part

Weights have std 1/sqrt(fan_in) times a gain that makes each residual branch add a variance of
about 1/(2 * layers) per dim, so activations stay finite and O(1) through any depth.

HF output: config.json, model.safetensors (or model-0000i-of-0000n.safetensors + index past
4 GiB a shard), tokenizer.json, tokenizer_config.json. GGUF output: one file, tokenizer in the
``tokenizer.ggml.*`` keys; norms and routers f32, experts per --expert-format, other matrices
q8_0 when most expert layers are quantized, else bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from freetoken.checkpoint.gguf_writer import TensorPlan, write_gguf
from freetoken.config import ModelConfig
from freetoken.errors import ConfigError
from freetoken.quant import FORMATS, get_format

log = logging.getLogger(__name__)

WINDOW = 32  # tokens the attention (hence the slow router component) averages over
ROUTER_STD = 2.0  # std of a router logit
SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class Preset:
    """A model geometry; ``expert_format`` is the default --expert-format spec."""

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


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("qwen3-30b-a3b", 2048, 768, 128, 8, 48, 32, 4, 128, 151936, "bf16", 6144, 40960),
    Preset("gemma4-26b-a4b", 2816, 704, 128, 8, 30, 16, 8, 256, 262144, "q8_0*,bf16", 2112),
    Preset("gpt-oss-20b-like", 2880, 2880, 32, 4, 24, 64, 8, 64, 201088, "mxfp4", 2880, 131072),
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
        if fmt not in FORMATS or FORMATS[fmt].gguf_type is None:
            choices = ", ".join(n for n, f in FORMATS.items() if f.gguf_type is not None)
            raise ConfigError(f"unknown expert format {fmt!r} in --expert-format {spec!r} "
                              f"(choose from {choices})")
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
    if not gguf and set(formats) != {"bf16"}:
        raise ConfigError(
            f"expert format(s) {', '.join(sorted(set(formats) - {'bf16'}))} cannot be written "
            "to a Hugging Face directory (bf16 only); write a .gguf --out or pass "
            "--expert-format bf16"
        )
    spec = SynthSpec(p, formats, router_skew, router_locality, seed)
    for fmt in {*formats, spec.matrix_format}:
        block = get_format(fmt).block_size
        bad = [n for n in (p.hidden, p.moe_intermediate, p.heads * p.head_dim) if n % block]
        if bad:
            raise ConfigError(f"format {fmt} needs rows that are a multiple of {block} values, "
                              f"but this geometry has rows of {bad[0]}; pick another format")
    return spec


def hf_config(spec: SynthSpec) -> dict[str, Any]:
    """config.json in the style of Qwen/Qwen3-30B-A3B's."""
    p = spec.preset
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
        "vocab_size": p.vocab,
        "freetoken_synth": {"preset": p.name, "seed": spec.seed, "router_skew": spec.router_skew,
                            "router_locality": spec.router_locality},
    }


def tensor_plans(spec: SynthSpec, stacked: bool) -> list[TensorPlan]:
    """Every tensor under our name: experts stacked (GGUF) or one per expert (HF, all bf16)."""
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


def plan_bytes(plan: TensorPlan) -> int:
    return math.prod(plan.shape[:-1]) * get_format(plan.fmt).row_bytes(plan.shape[-1])


class Weights:
    """The weight recipe: every tensor is a function of (seed, name, geometry, knobs)."""

    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")
    _EXPERT = re.compile(r"mlp\.experts\.(?:(\d+)\.)?(gate_proj|up_proj|down_proj)")

    def __init__(self, spec: SynthSpec, device: str = "cpu") -> None:
        self.spec, p = spec, spec.preset
        self.device = torch.device(device)
        self.H = p.hidden
        roles = torch.randperm(self.H, generator=self._gen("roles", "cpu"))
        self.u, self.S, self.F = roles[0], roles[1:1 + self.H // 4], roles[1 + self.H // 4:]
        self.c = 0.5 * math.sqrt(len(self.F))  # the u dim carries ~20% of the embedding energy
        self.band, self.alpha = _recency_band(p.head_dim, p.rope_theta)
        self.branch_var = 1 / (2 * p.layers)

    def _gen(self, key: str, device: str | torch.device | None = None) -> torch.Generator:
        """Each tensor's own stream. Streams differ between CPU and CUDA generators."""
        digest = hashlib.blake2b(f"{self.spec.seed}:{key}".encode(), digest_size=8).digest()
        g = torch.Generator(device=device or self.device)
        return g.manual_seed(int.from_bytes(digest, "little") >> 1)

    def _randn(self, key: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=self._gen(key)).mul_(std)

    def make(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (our name; experts stacked or per expert) in bf16."""
        if (m := self._LAYER.match(name)) and (e := self._EXPERT.match(m.group(2))):
            layer, proj = int(m.group(1)), e.group(2)
            if e.group(1) is not None:
                return self._expert(layer, int(e.group(1)), proj)
            first = self._expert(layer, 0, proj)
            out = torch.empty(self.spec.preset.experts, *first.shape, dtype=torch.bfloat16)
            out[0] = first
            for i in range(1, len(out)):
                out[i] = self._expert(layer, i, proj)
            return out
        return self._make(name).to(torch.bfloat16)

    def _make(self, name: str) -> torch.Tensor:
        p, H = self.spec.preset, self.H
        if name == "model.embed_tokens.weight":
            x = self._randn(name, (p.vocab, H), 1.0)
            x[:, self.S] = 0
            x[:, self.u] = self.c
            return x
        if name == "lm_head.weight":
            x = self._randn(name, (p.vocab, H), H ** -0.5)
            x[:, self.u] = 0
            return x
        if name.endswith("q_norm.weight"):
            return torch.full((p.head_dim,), self.alpha)
        if name.endswith("k_norm.weight"):
            return torch.ones(p.head_dim)
        if name.endswith("norm.weight"):
            return torch.ones(H)
        m = self._LAYER.match(name)
        assert m, name
        layer, rest = int(m.group(1)), m.group(2)
        if rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = p.heads if rest.endswith("q_proj.weight") else p.kv_heads
            x = torch.zeros(heads, p.head_dim, H)
            x[:, self.band, self.u] = 1.0
            return x.reshape(heads * p.head_dim, H)
        if rest == "self_attn.v_proj.weight":
            x = self._randn(name, (p.kv_heads * p.head_dim, H), len(self.F) ** -0.5)
            x[:, self.S] = 0
            x[:, self.u] = 0
            return x
        if rest == "self_attn.o_proj.weight":
            # v has variance ~0.6; a WINDOW-token average divides it by ~WINDOW
            gain = math.sqrt(self.branch_var * WINDOW / 0.6)
            x = self._randn(name, (H, p.heads * p.head_dim), gain * (p.heads * p.head_dim) ** -0.5)
            x[self.F] = 0
            x[self.u] = 0
            return x
        if rest == "mlp.gate.weight":
            return self._router(name, layer)
        raise KeyError(name)

    def _expert(self, layer: int, e: int, proj: str) -> torch.Tensor:
        p = self.spec.preset
        key = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
        if proj == "down_proj":
            # silu(gate) * up has variance ~0.22; top-k mixing keeps ~1.5/k of it
            mix = min(1.0, 1.5 / p.top_k)
            gain = math.sqrt(self.branch_var / (0.22 * mix))
            x = self._randn(key, (self.H, p.moe_intermediate), gain * p.moe_intermediate ** -0.5)
            x[self.S] = 0
            x[self.u] = 0
            return x.to(torch.bfloat16)
        x = self._randn(key, (p.moe_intermediate, self.H), self.H ** -0.5)
        x[:, self.u] = 0
        return x.to(torch.bfloat16)

    def _router(self, name: str, layer: int) -> torch.Tensor:
        """Logit = skew bias (from u) + sqrt(1-l) * fast (from F) + sqrt(l) * slow (from S).

        The router reads RMSNorm(h); each part is scaled by the expected energy of its dims in
        h at this layer, so each part has std ROUTER_STD * its weight at every depth.
        """
        s, loc, E = self.spec.router_skew, self.spec.router_locality, self.spec.preset.experts
        g = self._gen(name)
        energy_f = len(self.F) * (1 + layer * self.branch_var)
        energy_s = len(self.S) * (layer + 1) * self.branch_var
        rms = math.sqrt((energy_f + energy_s + self.c ** 2) / self.H)
        x = torch.zeros(E, self.H)
        x[:, self.F] = torch.randn(E, len(self.F), generator=g) * (
            math.sqrt(1 - loc) * ROUTER_STD * rms / math.sqrt(energy_f))
        x[:, self.S] = torch.randn(E, len(self.S), generator=g) * (
            math.sqrt(loc) * ROUTER_STD * rms / math.sqrt(energy_s))
        # Expert of popularity rank r gets bias -s ln(r) in units of the top-k selection's
        # noise scale (~std / sqrt(ln E / 2)): it is then picked ~r^-s times as often as rank 1.
        rank = torch.randperm(E, generator=g).double() + 1
        noise_scale = ROUTER_STD / math.sqrt(max(math.log(E), 1.0) / 2)
        x[:, self.u] = (-s * noise_scale * rank.log() * rms / self.c).float()
        return x


def _recency_band(head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """Head dims that q/k use and the q_norm scale that make attention a ~WINDOW-token window.

    With content-free q = alpha * k on the rotary pairs of frequency in [1/(8W), 1/W], the score
    of a key d tokens back is alpha * sqrt(D) * mean(cos(freq * d)): a bump of width ~W. alpha
    is set by bisection so the effective number of attended tokens is W.
    """
    freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    used = (freq <= 1 / WINDOW) & (freq >= 1 / (8 * WINDOW))
    if not used.any():
        used = (freq - 1 / WINDOW).abs() == (freq - 1 / WINDOW).abs().min()
    kernel = torch.cos(torch.arange(4 * WINDOW + 1, dtype=torch.float64)[:, None]
                       * freq[used]).mean(1) - 1
    lo, hi = 1e-3, 1e5
    for _ in range(60):
        a = math.sqrt(lo * hi)
        p = torch.softmax(a * kernel, 0)
        lo, hi = (a, hi) if 1 / float((p * p).sum()) > WINDOW else (lo, a)
    pairs = used.nonzero().flatten()
    return torch.cat([pairs, pairs + head_dim // 2]), a / math.sqrt(head_dim)


# Tokenizer: 256 byte tokens, lowercase words with and without a leading space (each one merge
# from a shorter one), and three specials at the end of the vocabulary.
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
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


def write_synth(
    spec: SynthSpec, out: str | Path, overwrite: bool = False, progress: bool = False,
    shard_bytes: int = SHARD_BYTES, device: str = "cpu",
) -> Path:
    """Write ``spec`` to ``out``: a GGUF file if it ends in .gguf, else an HF directory."""
    out = Path(out)
    gguf = out.suffix == ".gguf"
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    if out.exists() and gguf != out.is_file():
        raise ConfigError(f"{out} exists and is a {'file' if out.is_file() else 'directory'}; "
                          "pick another --out")
    weights = Weights(spec, device)
    plans = tensor_plans(spec, stacked=gguf)
    bar = tqdm(total=sum(map(plan_bytes, plans)), desc=f"Writing {out.name}", unit="B",
               unit_scale=True, disable=not progress)

    def make(plan: TensorPlan) -> torch.Tensor:
        bar.update(plan_bytes(plan))
        with torch.device(device):
            return weights.make(plan.name)

    try:
        if gguf:
            partial = out.with_name(out.name + ".partial")
            cfg = ModelConfig.from_hf(hf_config(spec))
            extra = {"general.name": f"synth-{spec.preset.name}",
                     "freetoken.synth": json.dumps(hf_config(spec)["freetoken_synth"]),
                     **gguf_tokenizer_metadata(spec)}
            write_gguf(partial, cfg, plans, make, extra)
            os.replace(partial, out)
        else:
            _write_hf(spec, out, plans, make, shard_bytes)
    finally:
        bar.close()
    return out


def _write_hf(spec: SynthSpec, out: Path, plans: list[TensorPlan],
              make: Callable[[TensorPlan], torch.Tensor], shard_bytes: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + plan_bytes(p) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += plan_bytes(p)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(out / name, shard, make)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(map(plan_bytes, plans))},
                 "weight_map": {p.name: n for n, s in zip(names, shards, strict=True) for p in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    hf_tokenizer_files(spec, out)


def _write_safetensors(path: Path, plans: list[TensorPlan],
                       make: Callable[[TensorPlan], torch.Tensor]) -> None:
    """Header first (every offset is known from the shapes), then one tensor at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        header[p.name] = {"dtype": "BF16", "shape": list(p.shape),
                          "data_offsets": [offset, offset + plan_bytes(p)]}
        offset += plan_bytes(p)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for p in plans:
            make(p).to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tofile(f)


def add_synth_args(p: argparse.ArgumentParser) -> None:
    geometry = "; ".join(
        f"{n}: {q.hidden}x{q.moe_intermediate}, {q.experts} experts top-{q.top_k}, "
        f"{q.layers} layers, {q.expert_format}" for n, q in PRESETS.items())
    p.add_argument("--preset", required=True, choices=list(PRESETS), help=geometry)
    p.add_argument("--out", required=True, type=Path,
                   help="PATH.gguf writes one GGUF file; any other path an HF directory "
                   "(bf16 safetensors, sharded past 4 GiB, tokenizer files)")
    p.add_argument("--expert-format", metavar="SPEC", help=(
        "expert formats per layer (GGUF only; HF is bf16): FORMAT for every layer, or a comma "
        "list of FORMAT (one layer), FORMAT*N (N layers) and one FORMAT* (the remaining layers),"
        " e.g. q8_0, q8_0*29,bf16 or q8_0*,bf16 (default: the preset's). Norms and routers are "
        "f32; other matrices q8_0 when most expert layers are quantized, else bf16"))
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--experts", type=int, help="override the preset's experts per layer")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="expert popularity: rank r is picked ~r^-S as often as rank 1 "
                   "(0 = uniform, 1 = Zipf)")
    p.add_argument("--router-locality", type=float, default=0.0, metavar="L",
                   help=f"0..1: share of the router logit from a ~{WINDOW}-token moving "
                   "average, so consecutive tokens pick similar experts (0 = none)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where weights are drawn and quantised (cuda is much faster at full "
                   "size; the same seed gives different weights on cpu and cuda)")


def synth_main(args: argparse.Namespace) -> int:
    gguf = Path(args.out).suffix == ".gguf"
    spec = resolve_spec(args.preset, gguf, args.expert_format, args.layers, args.experts,
                        args.vocab, args.router_skew, args.router_locality, args.seed)
    p = spec.preset
    log.info("synth %s: %d layers, %d experts top-%d, vocab %d, experts %s, matrices %s, "
             "skew %g, locality %g, seed %d", p.name, p.layers, p.experts, p.top_k, p.vocab,
             ",".join(spec.expert_formats), spec.matrix_format if gguf else "bf16",
             spec.router_skew, spec.router_locality, spec.seed)
    out = write_synth(spec, args.out, args.overwrite, progress=sys.stderr.isatty(),
                      device=args.device)
    size = out.stat().st_size if out.is_file() else sum(
        f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{out} ({size / 1e9:.2f} GB)" if size >= 1e8 else f"{out} ({size / 1e6:.2f} MB)")
    return 0
