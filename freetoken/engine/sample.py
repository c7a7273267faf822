"""Token sampling: greedy, temperature, top-k, top-p, min-p, with a seeded generator.

The filters run where the logits are. The draw from the filtered distribution too: on the CPU
with ``torch.multinomial``; on a GPU by an exponential race (:func:`race`: the argmax of
``p_i / E_i`` with ``E_i`` independent Exp(1) is token i with probability ``p_i``), so only the
chosen id crosses to the host, not the whole vocabulary (``torch.multinomial`` on the CPU takes
about 3 ms over a 152k vocabulary). The multinomial is the race's slow twin; a seeded request
draws from a generator on the logits' device (:func:`generator`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.cpu.gpu_wait import to_host

MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's chat limit)

TokenLogprobs = tuple[float, tuple[tuple[int, float], ...]]  # the token's, then the top (id, lp)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: each token's log-probability and the top N

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")


def apply_penalties(logits: torch.Tensor, output: list[int], p: SamplingParams) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the tokens generated so far."""
    if not output or (p.presence_penalty == 0 and p.frequency_penalty == 0):
        return logits
    ids, counts = torch.tensor(output).unique(return_counts=True)
    ids = ids.to(logits.device)
    penalty = counts.to(logits) * p.frequency_penalty + p.presence_penalty
    return logits.index_put((ids,), -penalty, accumulate=True)


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The log-probability of ``token`` under the model's distribution (log-softmax of the
    logits in float32, before penalties, temperature and filters) and the ``top`` most
    likely (id, log-probability), most likely first (ties: lower id)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.sort(lp, descending=True, stable=True)
        best = tuple(zip(ids[:top].tolist(), values[:top].tolist(), strict=True))
    return float(lp[token]), best


def generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's sampling generator on the device its logits come from (None: unseeded)."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def race(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """A token drawn from the weights ``probs`` (vocab,; they need not sum to 1) where they
    are: the argmax of ``probs / E`` with E ~ Exp(1) per token. E is kept above 0, so a token
    of weight 0 (filtered out) is never drawn."""
    return int(to_host(race_rows(probs, gen)))


def race_rows(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """:func:`race` over the last dimension of ``probs`` (..., vocab): one draw per row, on
    their device."""
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=gen)
    e.clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.argmax(probs.float() / e, dim=-1)


def greedy(logits: torch.Tensor) -> int | list[int]:
    """The argmax over the last dimension of ``logits`` (vocab,) or (rows, vocab), on the
    host (ties and NaNs as torch's argmax takes them)."""
    # numpy's argmax takes a twentieth of torch's time over a 150k vocabulary
    if logits.is_cpu and logits.dtype is torch.float32:
        return logits.numpy().argmax(axis=-1).tolist()
    return to_host(torch.argmax(logits, dim=-1)).tolist()


def plain(p: SamplingParams) -> bool:
    """Whether a draw with ``p`` is the temperature's softmax alone (no filter, no seed)."""
    return p.top_k == 0 and p.top_p == 1 and p.min_p == 0 and p.seed is None


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` (rows, vocab), row i with ``params[i]`` and
    ``gens[i]``: the greedy rows in one argmax, on a GPU the unseeded rows without filters in
    one race, each other row by :func:`sample`. One host copy for each group, not one per
    row. The greedy rows give :func:`sample`'s ids; a
    seeded row gives the draws of its own generator, whatever the batch."""
    out: list[int | None] = [None] * len(params)
    argmax = [i for i, p in enumerate(params) if p.greedy]
    if argmax:
        picked = greedy(logits[argmax] if len(argmax) < len(params) else logits)
        assert isinstance(picked, list)
        for i, t in zip(argmax, picked, strict=True):
            out[i] = t
    # on a GPU one race for the unseeded rows without filters (on the CPU a 2-D multinomial
    # measured no faster than one per row: benchmarks/sample.py)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0 and plain(p)]
    if len(drawn) > 1 and not logits.is_cpu:
        temps = torch.tensor([params[i].temperature for i in drawn], device=logits.device)
        probs = torch.softmax(logits[drawn].float() / temps.unsqueeze(-1), dim=-1)
        for i, t in zip(drawn, to_host(race_rows(probs, None)).tolist(), strict=True):
            out[i] = t
    return [sample(logits[i], params[i], gens[i]) if t is None else t
            for i, t in enumerate(out)]


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from logits (vocab,) in float32; ``gen`` is on the logits' device."""
    if p.greedy:
        return int(greedy(logits))
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0)
    if p.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if probs.is_cpu:
        return int(torch.multinomial(probs.float(), 1, generator=gen))
    return race(probs, gen)
