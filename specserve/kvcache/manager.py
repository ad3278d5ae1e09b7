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
from specserve.kvcache.radix_cache import RadixCache, TreeNode
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.kvcache.state_pool import StatePool
from specserve.kvcache.state_snapshots import StateSnapshots


@dataclass
class KVHandle:
    row: int = 0  # page-table row; 0 = none (row 0 is the dummy)
    pages: list[int] = field(default_factory=list)
    state_row: int = 0  # recurrent-state row; 0 = none (models without recurrent layers never take one)
    cached: int = 0  # leading pages owned by the prefix cache (locked through `node`), not by this handle
    node: TreeNode | None = None  # the prefix-cache node the cached pages end at (None: no lock held)

    def num_positions(self, page_size: int) -> int:
        return len(self.pages) * page_size


class KVManager:
    def __init__(self, allocator: PageAllocator, req_to_token: ReqToTokenPool, state_pool: StatePool | None = None):
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.state_pool = state_pool
        self.page_size = allocator.page_size
        self.prefix_cache: RadixCache | None = None  # None: off (--disable-radix-cache), see enable_prefix_cache

    def enable_prefix_cache(self, check_draft_next: bool, snapshots: int = 0) -> None:
        """Turn the prefix cache on (before any request). check_draft_next: a draft shares the cached pages;
        snapshots: recurrent-state snapshots to keep (a model with recurrent state needs at least one)."""
        pool = None
        if self.state_pool is not None:
            pool = StateSnapshots(self.state_pool, snapshots)
        self.prefix_cache = RadixCache(self.allocator, check_draft_next, pool)

    @property
    def available_pages(self) -> int:
        """Pages a request can get now: free ones and cached ones nobody uses (evicted on demand)."""
        cache = self.prefix_cache
        return self.allocator.num_free_pages + (cache.evictable_pages if cache is not None else 0)

    def match_prefix(self, handle: KVHandle, tokens: list[int], limit: int) -> int:
        """Take the longest cached prefix of tokens[:limit] for a handle that holds nothing yet: its pages become the
        handle's first (locked, written into its page-table row by assign_row). Returns its length in tokens."""
        cache = self.prefix_cache
        if cache is None or handle.pages or handle.node is not None:
            return 0
        node, length = cache.match(tokens, limit)
        if length == 0:
            return 0
        cache.lock(node)
        handle.node = node
        handle.pages = cache.path_pages(node)
        handle.cached = len(handle.pages)
        return length

    def cache_prefix(self, handle: KVHandle, tokens: list[int], valid: int, state_at: int | None = None) -> None:
        """Hand the handle's own full pages below position `valid` (their K/V final in every pool, the draft's
        entry at valid - 1 made with tokens[valid]) to the prefix cache; they stay the handle's to use. A no-op when
        the cache is off or another request cached the same tokens first (the handle then keeps its pages).
        state_at: the position the handle's committed recurrent state is after, when it may be snapshotted (the
        node ending there gets the snapshot)."""
        cache = self.prefix_cache
        if cache is None or not handle.row:
            return
        full = min(valid // self.page_size, len(handle.pages))
        if full <= handle.cached:
            self._snapshot(handle, state_at)
            return
        end = full * self.page_size
        node = handle.node if handle.node is not None else cache.root
        new = cache.insert(node, tokens, handle.pages[handle.cached:full],
                           tokens[end] if end < len(tokens) else None)
        if new is node:
            return
        cache.lock(new)  # (before the old lock goes: no moment where the path is evictable)
        if handle.node is not None:
            cache.unlock(handle.node)
        handle.node, handle.cached = new, full
        self._snapshot(handle, state_at)

    def _snapshot(self, handle: KVHandle, state_at: int | None) -> None:
        cache = self.prefix_cache
        if (cache.snapshots is not None and state_at is not None and handle.node is not None and handle.state_row
                and handle.cached * self.page_size == state_at):
            cache.attach_snapshot(handle.node, handle.state_row)

    def pages_needed(self, handle: KVHandle, num_positions: int) -> int:
        have = len(handle.pages)
        want = -(-num_positions // self.page_size)
        return max(0, want - have)

    def can_fit(self, extra_pages: int) -> bool:
        return extra_pages <= self.available_pages

    def ensure(self, handles: list[KVHandle], num_positions: list[int]) -> bool:
        """Grow each handle to cover positions [0, n). All or nothing: on failure nothing is taken."""
        need = [self.pages_needed(h, n) for h, n in zip(handles, num_positions)]
        total = sum(need)
        if total == 0:
            return True
        if total > self.allocator.num_free_pages:
            if self.prefix_cache is None or total > self.available_pages:
                return False
            self.prefix_cache.evict(total - self.allocator.num_free_pages)
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
        if handle.pages:  # a prefix-cache hit: its pages from position 0
            self._write_table(handle.row, 0, handle.pages)
        if self.state_pool is not None:
            handle.state_row = self.state_pool.alloc()
            self.state_pool.bind(row, handle.state_row)
            if handle.node is not None:  # a prefix-cache hit: the state at its end
                self.prefix_cache.restore_snapshot(handle.node, handle.state_row)
        return True

    def _write_table(self, row: int, first_page: int, pages: list[int]) -> None:
        ps = self.page_size
        width = self.req_to_token.width
        cols = [c for c in range(first_page * ps, (first_page + len(pages)) * ps) if c < width]
        slots = [pages[c // ps - first_page] * ps + c % ps for c in cols]
        table = self.req_to_token.table
        self.req_to_token.table[row, cols[0]:cols[-1] + 1] = torch.tensor(slots, dtype=table.dtype).to(
            table.device, non_blocking=True)

    def release(self, handle: KVHandle) -> None:
        """Return the handle's own pages and rows, and unlock its cached pages (they stay in the tree)."""
        if handle.node is not None:
            self.prefix_cache.unlock(handle.node)
            handle.node = None
        if handle.pages:
            own = handle.pages[handle.cached:]
            if own:
                self.allocator.free(own)
            handle.pages = []
            handle.cached = 0
        if handle.state_row:
            self.state_pool.bind(handle.row, 0)
            self.state_pool.free(handle.state_row)
            handle.state_row = 0
        if handle.row:
            self.req_to_token.free_row(handle.row)
            handle.row = 0
