"""The expert cache: slots on the compute device shared by every offloaded layer, one global LRU.

Slots are byte rows of one size (an expert's bank row, see ``host_banks.ExpertLayout``). Layers
whose experts take the same bytes share one :class:`SlotPool` and its LRU; a checkpoint with
mixed expert formats (e.g. 29 q8_0 layers and 1 bf16 layer) gets one pool per size, the cache
budget split between them by their share of expert bytes. Each layer has a table expert -> slot,
kept on the host for planning and published to the device (:meth:`SlotPool.publish`) for the
kernels that read the slots, so they need no host-made index and can run inside a CUDA graph.

Threads: the engine's main thread only. A slot handed out by :meth:`SlotPool.admit` is not
evicted again within the same call's ``keep`` set, so a step never loses an expert it still needs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.cpu.row_copy import RowCopier, Spans, current_stream


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
        self.tables: dict[int, list[int]] = {}  # layer -> expert -> slot (-1: not cached)
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

    def cached(self, layer: int) -> list[int]:
        """Experts of ``layer`` in the cache now."""
        return [e for e, s in enumerate(self.tables[layer]) if s >= 0]


@dataclass(frozen=True)
class PoolPlan:
    """How many slots of one size, and which layers use them."""

    slot_bytes: int
    num_slots: int
    layers: tuple[int, ...]


class ExpertCache:
    """Every slot pool of the model, by slot size; ``pool(layer)`` is the layer's."""

    def __init__(self, plans: list[PoolPlan], experts_per_layer: dict[int, int],
                 device: torch.device) -> None:
        self.pools: list[SlotPool] = []
        self._by_layer: dict[int, SlotPool] = {}
        for plan in plans:
            pool = SlotPool(plan.slot_bytes, plan.num_slots, device)
            for layer in plan.layers:
                pool.add_layer(layer, experts_per_layer[layer])
                self._by_layer[layer] = pool
            self.pools.append(pool)

    def pool(self, layer: int) -> SlotPool:
        return self._by_layer[layer]

    @property
    def num_slots(self) -> int:
        return sum(p.num_slots for p in self.pools)

    @property
    def nbytes(self) -> int:
        return sum(p.num_slots * p.slot_bytes for p in self.pools)
