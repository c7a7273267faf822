"""A paged KV pool: fixed-size pages of token slots shared by every sequence.

Slot ``s`` of layer ``l`` holds one token's key and value: ``k[l][s]`` (Hkv, D). A sequence owns
a list of pages; its token at position p lives in slot ``pages[p // page] * page + p % page``.
Pages are reference-counted so the prefix cache can share them between sequences.
"""

from __future__ import annotations

import torch


class PagedKV:
    """Keys and values of all sequences, plus the free list of pages.

    Only the engine thread touches a pool; nothing here is thread-safe.
    """

    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_pages * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size, self.num_pages = page_size, num_pages
        self.refs = [0] * num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def free_pages(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages (refcount 1). Raises MemoryError if the pool has fewer free."""
        if n > len(self.free):
            raise MemoryError(f"KV pool has {len(self.free)} free pages, {n} needed")
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def slots(self, pages: list[int], start: int, end: int, device: torch.device) -> torch.Tensor:
        """Slot indices of positions start..end-1 of a sequence with these pages."""
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).to(device)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k
        self.v[layer, slots] = v
