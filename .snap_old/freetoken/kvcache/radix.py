"""Prefix cache: a radix tree over token ids at page granularity.

Each node is one full page of tokens and holds a reference to the KV page that stores them, so a
new request whose prompt starts with a cached prefix reuses those pages instead of recomputing.
Leaves that only the cache still references are evicted least-recently-used first.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from freetoken.kvcache.paged import PagedKV


@dataclass
class _Node:
    page: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixCache:
    """Engine-thread only. Pages handed out by ``match`` carry a reference the caller releases."""

    def __init__(self, kv: PagedKV) -> None:
        self.kv = kv
        self.page = kv.page_size
        self.root = _Node(-1, None, ())
        self.clock = itertools.count(1)
        self.cached_pages = 0

    def _chunks(self, tokens: list[int], n_pages: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[i * self.page:(i + 1) * self.page]) for i in range(n_pages)]

    def match(self, tokens: list[int], max_pages: int) -> list[int]:
        """Pages of the longest cached prefix of ``tokens`` (at most max_pages), retained."""
        node, pages, now = self.root, [], next(self.clock)
        for key in self._chunks(tokens, min(max_pages, len(tokens) // self.page)):
            child = node.children.get(key)
            if child is None:
                break
            child.last_used = now
            pages.append(child.page)
            node = child
        self.kv.retain(pages)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Remember the full pages of a finished sequence (the cache takes its own reference)."""
        node, now = self.root, next(self.clock)
        n = min(len(pages), len(tokens) // self.page)
        for key, page in zip(self._chunks(tokens, n), pages[:n], strict=True):
            child = node.children.get(key)
            if child is None:
                child = _Node(page, node, key)
                node.children[key] = child
                self.kv.retain([page])
                self.cached_pages += 1
            child.last_used = now
            node = child

    def evict(self, want: int) -> int:
        """Free up to ``want`` pages held only by the cache, oldest leaves first."""
        freed = 0
        while freed < want:
            leaves = [n for n in self._nodes() if not n.children and self.kv.refs[n.page] == 1]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.last_used)[: want - freed]:
                assert leaf.parent is not None
                del leaf.parent.children[leaf.key]
                self.kv.release([leaf.page])
                self.cached_pages -= 1
                freed += 1
        return freed

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
