"""The expert cache: slots on the compute device shared by every offloaded layer, one global LRU
per slot size.

Layers whose experts take the same bytes share one slot pool and its LRU
(:mod:`.slot_pool`); a checkpoint with mixed expert formats (e.g. 29 q8_0 layers and 1 bf16
layer) gets one pool per size, the cache budget split between them by their share of expert
bytes. A pool makes its decisions in the library (:mod:`.native_slot_pool`) where it loads and
``FREETOKEN_EXPERT_SLOTS`` allows, else in Python (the slow twin, the same decisions).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from freetoken import env
from freetoken.cpu.library import NativeUnavailable
from freetoken.moe.native_slot_pool import NativeSlotPool
from freetoken.moe.slot_pool import SlotPool

log = logging.getLogger(__name__)


def make_pool(slot_bytes: int, num_slots: int, device: torch.device) -> SlotPool:
    """The library's pool where it loads and FREETOKEN_EXPERT_SLOTS allows, else the twin."""
    if env.expert_slots() == "native":
        try:
            return NativeSlotPool(slot_bytes, num_slots, device)
        except NativeUnavailable as e:
            log.info("expert cache decisions in Python: %s", e)
    return SlotPool(slot_bytes, num_slots, device)


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
            pool = make_pool(plan.slot_bytes, plan.num_slots, device)
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
