"""Page allocator for the KV slots shared by target and draft.

Slots are grouped in pages of `page_size` tokens; slot = page * page_size + offset. Page 0 (slots 0..page_size-1)
is the reserved dummy that padded graph rows read and write, so it is never handed out (docs/architecture.md).
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is the reserved dummy)")
        self.num_pages = num_pages
        self.page_size = page_size
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self.capacity_pages = num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_free_tokens(self) -> int:
        return len(self._free) * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_pages * self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
