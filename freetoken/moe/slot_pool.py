"""A pool of expert cache slots and its decisions, in Python: the slow twin of the library's
(:mod:`.native_slot_pool`), with the records both answer in.

Slots are byte rows of one size (an expert's bank row, see ``host_banks.ExpertLayout``) on the
compute device, with one LRU over all of them; every layer whose experts take those bytes
shares the pool. Each layer has a table expert -> slot, kept on the host for planning and
published to the device (:meth:`SlotPool.publish`) for the kernels that read the slots, so they
need no host-made index and can run inside a CUDA graph.

A decode call's plan asks the pool twice: :meth:`SlotPool.route` (the call's experts, how
often each is routed, hits and misses) and :meth:`SlotPool.split` (which misses are fetched into
which victim slots, which go to the CPU); look-ahead asks once more for the next layer
(:meth:`SlotPool.prefetch`).

Threads: the engine's main thread only. A slot handed out by :meth:`SlotPool.admit` is not
evicted again within the same call's ``keep`` set, so a step never loses an expert it still needs.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.cpu.row_copy import RowCopier, Spans, current_stream


@dataclass(frozen=True)
class Routed:
    """One call's experts (:meth:`SlotPool.route`): ``needed`` ascending, how often each is
    routed (``uses``), its slot or -1 for a miss (``slot``); int64 arrays of one length, and
    how many ``misses``. The library's pool reuses the arrays at its next route."""

    needed: np.ndarray
    uses: np.ndarray
    slot: np.ndarray
    misses: int

    @property
    def n_hits(self) -> int:
        return self.needed.size - self.misses

    def hits(self) -> dict[int, int]:
        """Expert -> slot of the hits."""
        hit = self.slot >= 0
        return dict(zip(self.needed[hit].tolist(), self.slot[hit].tolist(), strict=True))

    def missed(self) -> list[int]:
        """The misses, ascending."""
        return self.needed[self.slot < 0].tolist()


@dataclass(frozen=True)
class Prefetch:
    """What :meth:`SlotPool.prefetch` decided: the predicted experts, most picked first, and
    the misses among them fetched early (in that order) with the slots they now hold."""

    predicted: np.ndarray
    fetched: np.ndarray
    slots: np.ndarray


@dataclass(frozen=True)
class Split:
    """What :meth:`SlotPool.split` decided: the fetched experts (ascending) and the slots they
    now hold, and how many experts go to the CPU."""

    fetched: np.ndarray
    slots: np.ndarray
    cpu: int


def rank(picks: np.ndarray) -> list[int]:
    """The experts of ``picks`` (ids, each a token's pick), most picked first (ties: lower
    id)."""
    counts = Counter(picks.tolist())
    return sorted(counts, key=lambda e: (-counts[e], e))


class SlotPool:
    """``num_slots`` rows of ``slot_bytes`` on ``device`` with one LRU over all of them."""

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError("an expert cache pool needs at least one slot")
        self.slot_bytes, self.num_slots = slot_bytes, num_slots
        # zeros: a slot never filled still dequantises to finite weights (a masked pair reads it)
        self.data = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=device)
        self.device = device
        self.owner: list[tuple[int, int] | None] = [None] * num_slots  # slot -> (layer, expert)
        self.lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.tables: dict[int, list[int] | np.ndarray] = {}  # layer -> expert -> slot (-1: none)
        self.device_tables: dict[int, torch.Tensor] = {}  # the same, as last published
        self._staged: dict[int, torch.Tensor] = {}  # pinned host copies being published
        self._staged_np: dict[int, np.ndarray] = {}  # numpy views of those (no tensor made)
        self._publish: dict[int, Spans] = {}  # each layer's publish, laid out once
        self.copier: RowCopier | None = None  # publishes through the library (the runtime's)
        on = self.data.device
        self._index = on.index or 0 if on.type == "cuda" else -1  # the copier's stream

    def add_layer(self, layer: int, num_experts: int) -> None:
        self.tables[layer] = [-1] * num_experts
        pinned = self.device.type == "cuda"
        self._staged[layer] = torch.full((num_experts,), -1, dtype=torch.long, pin_memory=pinned)
        self._staged_np[layer] = self._staged[layer].numpy()
        self.device_tables[layer] = torch.full((num_experts,), -1, dtype=torch.long,
                                               device=self.device)

    def publish(self, layer: int, empty: bool = False) -> torch.Tensor:
        """Copy ``layer``'s table (all -1 with ``empty``) to its device tensor, in order on the
        current stream, and return that tensor.

        The copy reads a pinned host buffer after this call returns. The buffer is rewritten
        only by the layer's next publish, which comes after the host has read that next call's
        routed ids: a sync on the same stream, later than this copy."""
        staged = self._staged[layer]
        self._staged_np[layer][:] = -1 if empty else self.tables[layer]
        table = self.device_tables[layer]
        if self.copier is None:
            table.copy_(staged, non_blocking=True)
            return table
        spans = self._publish.get(layer)
        if spans is None:
            spans = self._publish[layer] = Spans([(table, staged)])
        self.copier.run(spans, current_stream(self._index) if self._index >= 0 else 0)
        return table

    def lookup(self, layer: int, experts: list[int]) -> tuple[dict[int, int], list[int]]:
        """Split ``experts`` into hits (expert -> slot, marked most recently used) and misses."""
        table = self.tables[layer]
        hits: dict[int, int] = {}
        misses: list[int] = []
        for e in experts:
            s = table[e]
            if s >= 0:
                hits[e] = s
                self.lru.move_to_end(s)
            else:
                misses.append(e)
        return hits, misses

    def admit(self, layer: int, experts: list[int], keep: set[int]) -> list[int]:
        """Give each of ``experts`` (not cached) a slot: the least recently used slot not in
        ``keep``, evicting its expert. The slots join ``keep`` and become most recently used.
        The caller fills them before anything reads them."""
        table = self.tables[layer]
        out = []
        for e in experts:
            victim = next((s for s in self.lru if s not in keep), None)
            if victim is None:
                raise RuntimeError(f"expert cache: {len(keep)} slots in use, none left to evict")
            old = self.owner[victim]
            if old is not None:
                self.tables[old[0]][old[1]] = -1
            self.owner[victim] = (layer, e)
            table[e] = victim
            self.lru.move_to_end(victim)
            keep.add(victim)
            out.append(victim)
        return out

    def prefetch(self, layer: int, picks: torch.Tensor, keep: np.ndarray,
                 share: Callable[[int], int]) -> Prefetch:
        """Look-ahead for ``layer``: the experts of ``picks`` (the next router's top-k of
        every token; int64 on the host), most picked first (ties: lower id); hits marked most
        recently used in that order; of the misses, the first ``share(misses)`` (at most the
        slots neither in ``keep`` (negative entries ignored) nor hits) given victim slots
        outside those."""
        predicted = rank(picks.numpy().ravel())
        table = self.tables[layer]
        if any(e < 0 or e >= len(table) for e in predicted):
            raise ValueError(f"expert cache: layer {layer} has no experts {predicted}")
        hits, misses = self.lookup(layer, predicted)
        busy = {s for s in keep.tolist() if s >= 0} | set(hits.values())
        n = max(0, min(share(len(misses)), self.num_slots - len(busy)))
        slots = self.admit(layer, misses[:n], busy) if n else []
        return Prefetch(np.array(predicted, dtype=np.int64),
                        np.array(misses[:n], dtype=np.int64), np.array(slots, dtype=np.int64))

    def cached(self, layer: int) -> list[int]:
        """Experts of ``layer`` in the cache now."""
        return [e for e, s in enumerate(self.tables[layer]) if s >= 0]

    def state(self) -> tuple[list[int], list[tuple[int, int] | None]]:
        """The slots from least to most recently used, and each slot's (layer, expert)."""
        return list(self.lru), list(self.owner)

    def route(self, layer: int, flat: torch.Tensor) -> Routed:
        """A call's routed ids ``flat`` (int64, contiguous, on the CPU) -> its experts, their
        uses and slots; hits become most recently used, in ascending expert order
        (:meth:`lookup`)."""
        ids = flat.tolist()
        needed = sorted(set(ids))
        uses = Counter(ids)
        hits, misses = self.lookup(layer, needed)
        return Routed(np.array(needed, dtype=np.int64),
                      np.array([uses[e] for e in needed], dtype=np.int64),
                      np.array([hits.get(e, -1) for e in needed], dtype=np.int64), len(misses))

    def split(self, layer: int, flat: torch.Tensor, routed: Routed, n_fetch: int,
              cpu_ids: torch.Tensor | None = None) -> Split:
        """Of ``routed``'s misses the ``n_fetch`` most used (ties: the lower id) are given
        slots (:meth:`admit`, in ascending expert order, the hits' slots kept); the others are
        the CPU's: ``cpu_ids`` (if given: int64, contiguous, as many as ``flat``) gets each
        routed id that is, -1 elsewhere."""
        uses = dict(zip(routed.needed.tolist(), routed.uses.tolist(), strict=True))
        slots = routed.slot.tolist()
        misses = [e for e, s in zip(routed.needed.tolist(), slots, strict=True) if s < 0]
        by_use = sorted(misses, key=lambda e: (-uses[e], e))
        n = max(0, min(n_fetch, len(misses)))
        fetched = sorted(by_use[:n])
        given = self.admit(layer, fetched, {s for s in slots if s >= 0})
        on_cpu = set(by_use[n:])
        if cpu_ids is not None:
            cpu_ids.numpy().reshape(-1)[:] = [e if e in on_cpu else -1 for e in flat.tolist()]
        return Split(np.array(fetched, dtype=np.int64), np.array(given, dtype=np.int64),
                     len(on_cpu))
