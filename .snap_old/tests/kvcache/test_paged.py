"""The paged KV pool: reference counts, the free list, and the slot of each position."""

from __future__ import annotations

import pytest
import torch

from freetoken.kvcache.paged import PagedKV


def test_pages_return_to_the_free_list_when_the_last_reference_goes() -> None:
    kv = PagedKV(2, 4, 8, 1, 4, torch.float32, "cpu")
    a = kv.allocate(3)
    assert len(set(a)) == 3 and kv.free_pages == 1
    kv.retain(a[:1])
    kv.release(a)
    assert kv.free_pages == 3 and kv.refs[a[0]] == 1
    kv.release(a[:1])
    assert kv.free_pages == 4
    with pytest.raises(MemoryError, match="4 free pages, 5 needed"):
        kv.allocate(5)


def test_slots_follow_the_page_table_and_store_writes_there() -> None:
    kv = PagedKV(1, 4, 3, 2, 2, torch.float32, "cpu")
    pages = [2, 0, 3]
    slots = kv.slots(pages, 1, 8, torch.device("cpu"))
    assert slots.tolist() == [pages[p // 3] * 3 + p % 3 for p in range(1, 8)]
    k = torch.arange(7 * 4, dtype=torch.float32).view(7, 2, 2)
    kv.store(0, slots, k, -k)
    assert torch.equal(kv.k[0, slots], k) and torch.equal(kv.v[0, slots], -k)
    assert PagedKV.bytes_per_token(3, 2, 4, torch.bfloat16) == 2 * 3 * 2 * 4 * 2
