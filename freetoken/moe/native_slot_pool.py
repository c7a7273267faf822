"""The expert cache's slot decisions made in the library (``csrc/expert_slots.cpp``): the same
pool as :class:`~freetoken.moe.slot_pool.SlotPool`, which is its slow twin
(``FREETOKEN_EXPERT_SLOTS=python``), with the LRU, the owners and the planning in native code."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from freetoken.cpu.library import native
from freetoken.moe.slot_pool import Prefetch, Routed, SlotPool, Split


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
