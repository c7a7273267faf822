"""Per-forward state, passed explicitly through the model (never held in globals).

One forward runs T new tokens drawn from B sequences (prefill chunks and decode steps mixed).
Attention sees the batch padded to (B, Tq) queries and (B, S) keys; everything index-shaped is
built once per forward here, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from freetoken.kvcache.paged import PagedKV


@dataclass(frozen=True)
class Segment:
    """``count`` new tokens of one sequence at positions start..start+count-1."""

    pages: list[int]
    start: int
    count: int


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # (T,) absolute position of each new token
    slots: torch.Tensor  # (T,) KV slot each new token writes
    kv: PagedKV
    q_index: torch.Tensor  # (B, Tq) index into the T tokens (padding repeats a valid index)
    q_valid: torch.Tensor  # (B, Tq) bool
    k_slots: torch.Tensor  # (B, S) KV slots of each sequence's keys 0..end-1 (padding: 0)
    logit_rows: torch.Tensor | None  # (R,) rows of T whose logits are wanted; None = all
    single: bool  # one segment: attention can skip the padding gathers
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> (B, 1, Tq, S)
    decode: bool = False  # every segment has one token (Tq = 1): no padding to drop
    # per sequence: (first of its rows among the T tokens, its new tokens, its keys)
    spans: tuple[tuple[int, int, int], ...] = ()
    end: int = 0  # keys of the longest sequence, known on the host (0: not known)

    @staticmethod
    def build(kv: PagedKV, segments: list[Segment], device: torch.device,
              windows: tuple[int, ...] = (0,), all_logits: bool = False) -> ForwardContext:
        """Index tensors for ``segments``; ``windows`` are the attention windows used (0=full)."""
        B = len(segments)
        Tq = max(s.count for s in segments)
        S = max(s.start + s.count for s in segments)
        positions, slots, q_index, q_valid = [], [], [], []
        k_slots = torch.zeros(B, S, dtype=torch.long)
        k_pos = torch.full((B, S), 1 << 40, dtype=torch.long)  # padding: never visible
        offset, last, spans = 0, [], []
        for b, s in enumerate(segments):
            end = s.start + s.count
            spans.append((offset, s.count, end))
            positions.append(torch.arange(s.start, end))
            seq_slots = kv.slots(s.pages, 0, end, torch.device("cpu"))
            slots.append(seq_slots[s.start:])
            k_slots[b, :end] = seq_slots
            k_pos[b, :end] = torch.arange(end)
            idx = torch.arange(offset, offset + Tq).clamp(max=offset + s.count - 1)
            q_index.append(idx)
            q_valid.append(torch.arange(Tq) < s.count)
            offset += s.count
            last.append(offset - 1)
        pos = torch.cat(positions)
        q_idx = torch.stack(q_index)
        q_pos = pos[q_idx]
        masks = {}
        for w in windows:
            m = k_pos[:, None, :] <= q_pos[:, :, None]
            if w:
                m &= q_pos[:, :, None] - k_pos[:, None, :] < w
            masks[w] = m.unsqueeze(1).to(device)
        to = dict(device=device)
        return ForwardContext(
            positions=pos.to(**to), slots=torch.cat(slots).to(**to), kv=kv,
            q_index=q_idx.to(**to), q_valid=torch.stack(q_valid).to(**to),
            k_slots=k_slots.to(**to),
            logit_rows=None if all_logits else torch.tensor(last, **to),
            single=B == 1, masks=masks, decode=Tq == 1, spans=tuple(spans), end=S,
        )
