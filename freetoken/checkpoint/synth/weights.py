"""Synthetic checkpoints at real geometry (``ft synth``): random weights, a byte-level BPE
tokenizer, and routers with tunable expert popularity.

Each preset is written in its own architecture: Qwen3-MoE ones as a Hugging Face directory
(bf16 safetensors, sharded) or a GGUF file (per-layer expert formats), GPT-OSS and Gemma-4
ones as GGUF. Weights are drawn per tensor from ``(seed, tensor name)``, so a tensor does not
depend on which others are written: an HF directory and a GGUF file of one seed hold the same
bf16 values.

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

import hashlib
import math
import re

import torch

from freetoken.checkpoint.synth.presets import (
    SynthSpec,
)

WINDOW = 32  # tokens the attention (hence the slow router component) averages over
ROUTER_STD = 2.0  # std of a router logit
SELF_LOGIT = 3.0  # a tied head's logit of the input token over the others' (Gemma-4)

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

    def make(self, name: str, shape: tuple[int, ...] = ()) -> torch.Tensor:
        """The tensor ``name`` (our name; experts stacked or per expert) in bf16; ``shape``
        (the plan's) is needed for the GPT-OSS and Gemma-4 tensors Qwen3-MoE lacks."""
        family = self.spec.preset.family
        if family != "qwen3_moe" and (x := self._family(family, name, shape)) is not None:
            return x.to(torch.bfloat16)
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

    def _family(self, family: str, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """GPT-OSS's and Gemma-4's tensors by the same scale rules, or None for the ones the
        Qwen3-MoE recipe makes alike (embedding, head, experts, router matrix). Attention reads
        the whole residual stream (no recency window), so ``--router-locality`` acts through o_proj
        writing S only. Gemma-4's post-norms set each branch's size, its router the raw scale."""
        m = self._LAYER.match(name)
        rest = m.group(2) if m else name
        H, p = self.H, self.spec.preset
        if name.endswith(("bias", "sinks")):
            return torch.zeros(shape)
        if name == "model.embed_tokens.weight" and family == "gemma4":
            return self._make(name) * H ** -0.5  # Gemma scales the embedding by sqrt(H)
        if rest == "router.scale":
            return torch.full(shape, H ** 0.5)  # cancels the router's 1 / sqrt(H)
        if rest in ("router.per_expert_scale", "layer_scalar"):
            return torch.ones(shape)
        if rest in ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight") \
                and family == "gemma4":
            return torch.full(shape, math.sqrt(self.branch_var))
        if name == "model.norm.weight" and family == "gemma4":
            # the head is the embedding (tied), and the residual stream still holds the token's
            # own embedding: at unit scale its logit would stand ~0.75 sqrt(H) above the rest,
            # so a model sampled at temperature 1 would repeat its input token for ever (and
            # its routing with it). This scale leaves that logit SELF_LOGIT above the others.
            return torch.full(shape, SELF_LOGIT * H ** 0.5 / len(self.F))
        if re.search(r"norm(_\d)?\.weight$", rest):
            return torch.ones(shape)
        if not m:
            return None
        layer = int(m.group(1))
        if rest == "mlp.router.weight" or rest == "router.proj.weight":
            return self._router(name, layer)
        if rest == "experts.gate_up_proj":
            return torch.stack([torch.cat([self._expert(layer, e, "gate_proj"),
                                           self._expert(layer, e, "up_proj")])
                                for e in range(p.experts)])
        if rest == "experts.down_proj":
            return torch.stack([self._expert(layer, e, "down_proj") for e in range(p.experts)])
        if rest.startswith(("self_attn.", "mlp.")) and rest.endswith(".weight"):
            rows, cols = shape
            branch_out = rest.endswith(("o_proj.weight", "down_proj.weight"))
            gain = math.sqrt(self.branch_var) if branch_out else 1.0
            x = self._randn(name, shape, gain * cols ** -0.5)
            if branch_out:
                x[self.F if rest.endswith("o_proj.weight") else self.S] = 0
                x[self.u] = 0
            return x
        return None

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
