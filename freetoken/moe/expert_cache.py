"""The expert cache: slots on the compute device shared by every offloaded layer, one global LRU.

Slots are byte rows of one size (an expert's bank row, see ``host_banks.ExpertLayout``). Layers
whose experts take the same bytes share one :class:`SlotPool` and its LRU; a checkpoint with
mixed expert formats (e.g. 29 q8_0 layers and 1 bf16 layer) gets one pool per size, the cache
budget split between them by their share of expert bytes. Each layer has a table expert -> slot,
kept on the host for planning and published to the device (:meth:`SlotPool.publish`) for the
kernels that read the slots, so they need no host-made index and can run inside a CUDA graph.

A decode call's plan asks the pool twice: :meth:`SlotPool.route` (the call's experts, how
often each is routed, hits and misses) and :meth:`SlotPool.split` (which misses are fetched into
which victim slots, which go to the CPU); look-ahead asks once more for the next layer
(:meth:`SlotPool.prefetch`). :class:`NativeSlotPool` makes every decision in the
library (``csrc/expert_slots.cpp``); :class:`SlotPool` is its slow twin, with the same decisions
(``FREETOKEN_EXPERT_SLOTS=python``).

Threads: the engine's main thread only. A slot handed out by :meth:`SlotPool.admit` is not
evicted again within the same call's ``keep`` set, so a step never loses an expert it still needs.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from freetoken import env
from freetoken.cpu.library import NativeUnavailable, native
from freetoken.cpu.row_copy import RowCopier, Spans, current_stream

log = logging.getLogger(__name__)


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


class NativeSlotPool(SlotPool):
    """:class:`SlotPool` whose decisions the library makes (``csrc/expert_slots.cpp``): the
    LRU and the owners live there, the tables are int64 arrays both sides read and write.
    :meth:`route` answers in buffers the pool reuses, so :meth:`split` takes the pool's last
    route (a plan routes and splits one layer call before the next)."""

    def __init__(self, slot_bytes: int, num_slots: int, device: torch.device) -> None:
        super().__init__(slot_bytes, num_slots, device)
        self._lib = native()
        self._handle = self._lib.ft_slots_new(num_slots)
        self.lru, self.owner = OrderedDict(), []  # kept by the library: see :meth:`state`
        self._out = np.empty((5, 0), dtype=np.int64)  # route's and split's outputs, reused
        self._at: tuple[int, ...] = ()  # their rows' addresses
        self._pre = np.empty((4, 0), dtype=np.int64)  # prefetch's outputs, reused
        self._pre_at: tuple[int, ...] = ()  # their rows' addresses

    @property
    def handle(self) -> int:
        """The library's pool, for a library call that plans on it (``moe/layer_call.py``)."""
        return self._handle

    def table_buffers(self, layer: int) -> tuple[int, int, int, int]:
        """``layer``'s table as :meth:`publish` copies it: its address, the pinned staging
        copy's, the device table's, and its bytes."""
        table = self.tables[layer]
        assert isinstance(table, np.ndarray)
        return (int(table.ctypes.data), self._staged[layer].data_ptr(),
                self.device_tables[layer].data_ptr(), table.nbytes)

    def _outputs(self, n: int) -> tuple[int, ...]:
        """Room for ``n`` experts in the output rows; their addresses."""
        if self._out.shape[1] < n:
            self._out = np.empty((5, max(n, 64)), dtype=np.int64)
            self._at = tuple(int(self._out[r].ctypes.data) for r in range(5))
        return self._at

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.ft_slots_free(handle)

    def add_layer(self, layer: int, num_experts: int) -> None:
        super().add_layer(layer, num_experts)
        table = self.tables[layer] = np.full(num_experts, -1, dtype=np.int64)
        if self._lib.ft_slots_add_layer(self._handle, layer, table.ctypes.data, num_experts):
            raise ValueError(f"expert cache: layer {layer} of {num_experts} experts refused")

    def lookup(self, layer: int, experts: list[int]) -> tuple[dict[int, int], list[int]]:
        want = np.array(experts, dtype=np.int64)
        slot = np.empty(len(experts), dtype=np.int64)
        if self._lib.ft_slots_lookup(self._handle, layer, want.ctypes.data, len(experts),
                                     slot.ctypes.data):
            raise ValueError(f"expert cache: layer {layer} has no experts {experts}")
        hit = slot >= 0
        return (dict(zip(want[hit].tolist(), slot[hit].tolist(), strict=True)),
                want[~hit].tolist())

    def admit(self, layer: int, experts: list[int], keep: set[int]) -> list[int]:
        want = np.array(experts, dtype=np.int64)
        kept = np.array(sorted(keep), dtype=np.int64)
        slots = np.empty(len(experts), dtype=np.int64)
        err = self._lib.ft_slots_admit(self._handle, layer, want.ctypes.data, len(experts),
                                       kept.ctypes.data, len(kept), slots.ctypes.data)
        if err == -2:
            raise ValueError(f"expert cache: layer {layer} has no experts {experts}")
        if err:
            raise RuntimeError(f"expert cache: {len(keep)} slots in use, none left to evict")
        keep.update(slots.tolist())
        return slots.tolist()

    def route(self, layer: int, flat: torch.Tensor) -> Routed:
        n = flat.numel()
        needed, uses, slot, _, _ = self._outputs(n)
        k = self._lib.ft_slots_route(self._handle, layer, flat.data_ptr(), n, needed, uses, slot)
        if k < 0:
            raise ValueError(f"expert cache: layer {layer} was routed to an expert it lacks "
                             f"({flat.tolist()})")
        out = self._out
        return Routed(out[0, :k], out[1, :k], out[2, :k], int(np.count_nonzero(out[2, :k] < 0)))

    def split(self, layer: int, flat: torch.Tensor, routed: Routed, n_fetch: int,
              cpu_ids: torch.Tensor | None = None) -> Split:
        if routed.needed.base is not self._out:
            raise ValueError("a native pool splits the experts of its own last route")
        k = routed.needed.size
        needed, uses, slot, fetched, slots = self._at  # route made room for k
        n_cpu = self._lib.ft_slots_split(
            self._handle, layer, flat.data_ptr(), flat.numel(), needed, uses, slot, k, n_fetch,
            fetched, slots, None if cpu_ids is None else cpu_ids.data_ptr())
        if n_cpu == -2:
            raise ValueError(f"expert cache: layer {layer} was routed to an expert it lacks "
                             f"({flat.tolist()})")
        if n_cpu < 0:
            raise RuntimeError(f"expert cache: {self.num_slots} slots, none left to evict")
        n = routed.misses - n_cpu
        return Split(self._out[3, :n].copy(), self._out[4, :n].copy(), n_cpu)

    def prefetch(self, layer: int, picks: torch.Tensor, keep: np.ndarray,
                 share: Callable[[int], int]) -> Prefetch:
        picks = picks.contiguous()
        n = picks.numel()
        if self._pre.shape[1] < n:
            self._pre = np.empty((4, max(n, 128)), dtype=np.int64)
            self._pre_at = tuple(int(self._pre[r].ctypes.data) for r in range(4))
        pre, (predicted, slot, fetched, slots) = self._pre, self._pre_at
        k = self._lib.ft_slots_rank(self._handle, layer, picks.data_ptr(), n, predicted, slot)
        if k < 0:
            raise ValueError(f"expert cache: layer {layer} has no experts {picks.tolist()}")
        m = share(int(np.count_nonzero(pre[1, :k] < 0)))
        got = 0
        if m > 0:
            keep = np.ascontiguousarray(keep, dtype=np.int64)
            got = self._lib.ft_slots_admit_ranked(self._handle, m, keep.ctypes.data, keep.size,
                                                  fetched, slots)
            if got < 0:
                raise RuntimeError(f"expert cache: {self.num_slots} slots, none left to evict")
        return Prefetch(pre[0, :k].copy(), pre[2, :got].copy(), pre[3, :got].copy())

    def state(self) -> tuple[list[int], list[tuple[int, int] | None]]:
        n = self.num_slots
        out = np.empty((3, n), dtype=np.int64)
        self._lib.ft_slots_state(self._handle, out[0].ctypes.data, out[1].ctypes.data,
                                 out[2].ctypes.data)
        owners = [None if la < 0 else (la, e) for la, e in zip(out[1].tolist(),
                                                               out[2].tolist(), strict=True)]
        return out[0].tolist(), owners


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
