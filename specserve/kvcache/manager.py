"""Per-request KV ownership: which pages a request holds and the page-table rows that point at them.

A running request always owns slots for positions [0, seq_len + N + 1) (docs/architecture.md): draft and verify
write into them and rejected positions are overwritten by the next step, so nothing is freed on rejection. Everything is
returned when the request finishes, is aborted or is retracted. A model with recurrent layers also gives each
request a state row (kvcache/state_pool.py), taken with its page-table row and returned with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.kvcache.state_pool import StatePool


@dataclass
class KVHandle:
    row: int = 0  # page-table row; 0 = none (row 0 is the dummy)
    pages: list[int] = field(default_factory=list)
    state_row: int = 0  # recurrent-state row; 0 = none (models without recurrent layers never take one)

    def num_positions(self, page_size: int) -> int:
        return len(self.pages) * page_size


class KVManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool, state_pool: StatePool | None = None):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.state_pool = state_pool
        self.page_size = allocator.page_size
        self.prefix_cache = None  # kvcache/radix_cache.py RadixCache, None: off (--disable-radix-cache)

    def pages_needed(self, handle: KVHandle, num_positions: int) -> int:
        have = len(handle.pages)
        want = -(-num_positions // self.page_size)
        return max(0, want - have)

    def can_fit(self, extra_pages: int) -> bool:
        return extra_pages <= self.allocator.num_free_pages

    def ensure(self, handles: list[KVHandle], num_positions: list[int]) -> bool:
        """Grow each handle to cover positions [0, n). All or nothing: on failure nothing is taken."""
        need = [self.pages_needed(h, n) for h, n in zip(handles, num_positions)]
        total = sum(need)
        if total == 0:
            return True
        if total > self.allocator.num_free_pages:
            return False
        if any(h.row == 0 for h, k in zip(handles, need) if k):
            raise RuntimeError("ensure() on a request that holds no page-table row")
        pages = self.allocator.alloc(total)
        assert pages is not None
        rows, cols, slots = [], [], []
        ps = self.page_size
        i = 0
        for h, k in zip(handles, need):
            for p in pages[i:i + k]:
                start = len(h.pages) * ps
                h.pages.append(p)
                rows.extend([h.row] * ps)
                cols.extend(range(start, start + ps))
                slots.extend(range(p * ps, p * ps + ps))
            i += k
        table = self.req_to_token.table
        width = table.shape[1]
        keep = [j for j, c in enumerate(cols) if c < width]  # the last page may run past the row's width
        dev = table.device
        idx_r = torch.tensor([rows[j] for j in keep], dtype=torch.int64).to(dev, non_blocking=True)
        idx_c = torch.tensor([cols[j] for j in keep], dtype=torch.int64).to(dev, non_blocking=True)
        val = torch.tensor([slots[j] for j in keep], dtype=torch.int64).to(dev, non_blocking=True)
        table[idx_r, idx_c] = val
        return True

    def assign_row(self, handle: KVHandle) -> bool:
        """A page-table row (and a zeroed state row when the model has recurrent layers): both or neither."""
        if handle.row:
            return True
        if self.state_pool is not None and self.state_pool.num_free_rows == 0:
            return False
        row = self.req_to_token.alloc_row()
        if row is None:
            return False
        handle.row = row
        if self.state_pool is not None:
            handle.state_row = self.state_pool.alloc()
            self.state_pool.bind(row, handle.state_row)
        return True

    def release(self, handle: KVHandle) -> None:
        if handle.pages:
            self.allocator.free(handle.pages)
            handle.pages = []
        if handle.state_row:
            self.state_pool.bind(handle.row, 0)
            self.state_pool.free(handle.state_row)
            handle.state_row = 0
        if handle.row:
            self.req_to_token.free_row(handle.row)
            handle.row = 0
