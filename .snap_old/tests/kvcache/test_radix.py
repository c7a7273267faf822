"""The prefix cache against a plain model of it: a dict from every cached prefix (a whole
number of pages of tokens) to the page holding its last page of tokens. Random inserts,
matches and evictions; after each, the tree must answer as the dict does and every page's
reference count must be what its holders add up to."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.kvcache.paged import PagedKV
from freetoken.kvcache.radix import PrefixCache

PAGE = 4


def _pool(pages: int = 64) -> PagedKV:
    return PagedKV(1, pages, PAGE, 1, 2, torch.float32, "cpu")


class PlainModel:
    """What the cache should hold: prefix (tuple of tokens, len % PAGE == 0) -> page."""

    def __init__(self) -> None:
        self.pages: dict[tuple[int, ...], int] = {}

    def match(self, tokens: list[int], max_pages: int) -> list[int]:
        out = []
        for n in range(1, min(max_pages, len(tokens) // PAGE) + 1):
            page = self.pages.get(tuple(tokens[: n * PAGE]))
            if page is None:
                break
            out.append(page)
        return out

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        for n in range(1, min(len(pages), len(tokens) // PAGE) + 1):
            self.pages.setdefault(tuple(tokens[: n * PAGE]), pages[n - 1])

    def leaves(self) -> set[tuple[int, ...]]:
        return {p for p in self.pages
                if not any(len(q) > len(p) and q[: len(p)] == p for q in self.pages)}


def _sequence(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """A token sequence that often shares a prefix with an earlier one (few distinct tokens)."""
    if stems and rng.random() < 0.7:
        base = rng.choice(stems)
        cut = rng.randint(0, len(base))
        seq = base[:cut] + [rng.randint(0, 2) for _ in range(rng.randint(0, 3 * PAGE))]
    else:
        seq = [rng.randint(0, 2) for _ in range(rng.randint(1, 4 * PAGE))]
    stems.append(seq)
    return seq


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_agree_with_the_plain_model(seed: int) -> None:
    rng = random.Random(seed)
    kv = _pool()
    cache, model = PrefixCache(kv), PlainModel()
    held: list[list[int]] = []  # pages callers hold (a running sequence's, or a match's)
    stems: list[list[int]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.45:  # a sequence finishes: its cached prefix plus fresh pages go in
            seq = _sequence(rng, stems)
            reused = cache.match(seq, len(seq) // PAGE)
            assert reused == model.match(seq, len(seq) // PAGE)
            fresh_n = -(-len(seq) // PAGE) - len(reused)
            if fresh_n > kv.free_pages:
                kv.release(reused)
                continue
            pages = reused + kv.allocate(fresh_n)
            cache.insert(seq, pages)
            model.insert(seq, pages)
            kv.release(pages)  # the sequence is done; the cache keeps its own references
        elif op < 0.75:  # a new request matches and holds its prefix for a while
            seq = _sequence(rng, stems)
            cap = rng.randint(0, 5)
            got = cache.match(seq, cap)
            assert got == model.match(seq, cap)
            held.append(got)
        elif op < 0.9 and held:  # a held request finishes without inserting
            kv.release(held.pop(rng.randrange(len(held))))
        else:  # memory pressure
            evictable = _evictable(model, kv)
            want = rng.randint(1, 6)
            freed = cache.evict(want)
            gone = _sync_model(model, cache)
            assert freed == len(gone) <= want
            if freed < want:  # it stops only when nothing held by the cache alone remains
                assert not _evictable(model, kv)
            assert evictable or freed == 0
        _check_refcounts(kv, cache, model, held)


def _evictable(model: PlainModel, kv: PagedKV) -> set[tuple[int, ...]]:
    return {p for p in model.leaves() if kv.refs[model.pages[p]] == 1}


def _sync_model(model: PlainModel, cache: PrefixCache) -> set[tuple[int, ...]]:
    """Drop from the model the prefixes the cache evicted; returns them. Each must have been a
    leaf when it went (its longer prefixes went first, or never were)."""
    kept = set(_prefixes(cache))
    gone = set(model.pages) - kept
    assert kept <= set(model.pages), "the cache holds a prefix nobody inserted"
    for p in gone:
        assert not any(q[: len(p)] == p and len(q) > len(p) for q in kept), \
            f"evicted {p} but kept a longer prefix of it"
        del model.pages[p]
    return gone


def _prefixes(cache: PrefixCache) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for key, child in node.children.items():
            out[prefix + key] = child.page
            stack.append((prefix + key, child))
    return out


def _check_refcounts(kv: PagedKV, cache: PrefixCache, model: PlainModel,
                     held: list[list[int]]) -> None:
    assert _prefixes(cache) == model.pages
    assert cache.cached_pages == len(model.pages)
    want = [0] * kv.num_pages
    for page in model.pages.values():
        want[page] += 1
    for pages in held:
        for page in pages:
            want[page] += 1
    assert kv.refs == want
    assert sorted(kv.free) == [p for p in range(kv.num_pages) if want[p] == 0]


def test_only_full_pages_are_cached_and_matched() -> None:
    kv = _pool(8)
    cache = PrefixCache(kv)
    seq = list(range(2 * PAGE + 1))  # two full pages and one token
    pages = kv.allocate(3)
    cache.insert(seq, pages)
    kv.release(pages)
    assert cache.cached_pages == 2 and kv.refs[pages[2]] == 0
    assert cache.match(seq, 8) == pages[:2]
    assert cache.match(seq[: 2 * PAGE - 1], 8) == pages[:1]  # the second page is not whole
    assert cache.match(seq, 1) == pages[:1]
    assert cache.match([99] + seq[1:], 8) == []


def test_eviction_takes_the_least_recently_used_leaf_first() -> None:
    kv = _pool(8)
    cache = PrefixCache(kv)
    a, b = [1] * PAGE, [2] * PAGE
    for seq in (a, b):
        pages = kv.allocate(1)
        cache.insert(seq, pages)
        kv.release(pages)
    kv.release(cache.match(a, 1))  # a is used again: b is now the oldest
    assert cache.evict(1) == 1
    assert cache.match(b, 1) == [] and cache.match(a, 1) != []


def test_a_page_someone_holds_is_not_evicted() -> None:
    kv = _pool(8)
    cache = PrefixCache(kv)
    seq = [5] * (2 * PAGE)
    pages = kv.allocate(2)
    cache.insert(seq, pages)
    kv.release(pages)
    held = cache.match(seq, 2)
    assert cache.evict(4) == 0  # the leaf is held by the request
    kv.release(held)
    assert cache.evict(4) == 2 and kv.free_pages == 8  # leaf first, then its parent
