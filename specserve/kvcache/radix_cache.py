"""The prefix (radix) cache: a radix tree of token sequences over KV pages, shared by every token-indexed cache.

A node holds a run of whole pages: `key` is their tokens (len(pages) * page_size of them), `pages` the KV pages that
hold those tokens' K/V in every token-indexed pool of the target and of the draft (MHA/GQA K/V, MLA latents, the
DSA indexer's keys, the MTP draft's own KV: they all share the page table and the allocator, kvcache/manager.py).
Children are keyed by their first page's tokens, so a match walks pages, never single tokens, and a hit is always
a whole number of pages.

Ownership: a page in the tree belongs to the tree, not to a request. A running request that uses a path holds a
lock on its deepest node (`lock` counts along the path to the root); only nodes nobody locks can be evicted, least
recently used leaf first, when the allocator runs out of pages. A request adds its own full pages to the tree as
its prefill passes them (a chunk at a time) and when it finishes or is retracted; a page another request already
added under the same tokens stays the adder's and is freed with it.

The draft's entry at the last position of a page: the draft's KV at position p is made from (the target's features
at p, token p + 1), so the draft's entry at a node's last position depends on the token *after* the node, which
is not part of its key. Each node records that token (`draft_next`); a match stops at a page edge where the next
prompt token is the one the draft's entry there was made with, backing off a page at a time (inside a node the
next token is the node's own, so only node ends can disagree). A hit therefore leaves the draft's cache exactly as
a cold prefill would have written it, and the draft's extend can start where the target's prefill starts.

Models with recurrent state (kvcache/state_snapshots.py): a node may own a snapshot of the state after its last
token; a hit must end at a node that has one (the K/V before it are of no use without the state there). Snapshots
are taken where a prefill chunk ends and where a request leaves, so a multi-turn conversation hits at the end of its
previous turn. The snapshot pool is bounded: taking one when it is full drops the least recently used node's
(the node itself stays, for its K/V under deeper snapshots); evicting a node frees its snapshot.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.prefix_stats import PrefixCacheStats
from specserve.kvcache.state_snapshots import StateSnapshots


@dataclass(eq=False)
class TreeNode:
    key: list[int]  # tokens, len(pages) * page_size of them (the root: none)
    pages: list[int]
    parent: TreeNode | None = None
    children: dict[tuple, TreeNode] = field(default_factory=dict)  # first page's tokens -> child
    lock_ref: int = 0  # running requests whose path passes through (or ends at) this node
    last_access: tuple = (0.0, 0)  # (monotonic time, tie-breaking counter) of the last match or unlock
    # the token after the node's last one that the draft's KV entry at that last position was made with (None: the
    # engine has no draft, or nothing is known)
    draft_next: int | None = None
    snapshot: int = 0  # the recurrent state after the node's last token (kvcache/state_snapshots.py); 0: none

    @property
    def num_tokens(self) -> int:
        return len(self.key)


class RadixCache:
    def __init__(self, allocator: PageAllocator, check_draft_next: bool, snapshots: StateSnapshots | None = None):
        """check_draft_next: the engine has a draft whose cache the hits share (see the module docstring);
        snapshots: the model has recurrent state, and hits end at nodes with a snapshot of it."""
        self.allocator = allocator
        self.snapshots = snapshots
        self._snapshot_nodes: dict[int, TreeNode] = {}  # snapshot index -> the node that owns it
        self.page_size = allocator.page_size
        self.check_draft_next = check_draft_next
        self.root = TreeNode(key=[], pages=[])
        self.root.lock_ref = 1  # never evicted
        self.cached_pages = 0
        self.evictable_pages = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self._clock = itertools.count()  # ties in last_access (a coarse clock) broken by insertion order

    # ------------------------------------------------------------------ lookup
    def match(self, tokens: list[int], limit: int) -> tuple[TreeNode, int]:
        """The deepest node whose path is a prefix of tokens[:limit] (whole pages, and, with a draft, ending where
        tokens[length] is the node's draft_next), and that prefix's length. The node ends exactly there (a node
        matched part way is split; with snapshots, the node has one). limit < len(tokens) when the draft is checked
        (tokens[length] must exist)."""
        ps = self.page_size
        limit = min(limit, len(tokens)) // ps * ps
        node, length = self.root, 0
        while length < limit:
            child = node.children.get(tuple(tokens[length:length + ps]))
            if child is None:
                break
            key = child.key
            n = min(len(key), limit - length)
            i = ps  # the first page matched already (it is the child's dict key)
            while i < n and key[i] == tokens[length + i]:
                i += 1
            k = i // ps  # whole pages in common
            if k < len(child.pages):
                child = self._split(child, k)
            node, length = child, length + k * ps
            if k * ps < len(key):  # the rest differs (or the limit): no deeper match
                break
        while length and not self._usable_end(node, tokens[length] if length < len(tokens) else None):
            if self.snapshots is None and len(node.pages) > 1:
                # back off one page: the page edge before it is inside this node (its next token is the node's
                # own, which the prompt matched)
                node = self._split(node, len(node.pages) - 1)
                length -= ps
            else:  # the parent's end (checked in turn); snapshots are only ever at node ends
                length -= node.num_tokens
                node = node.parent
        self._touch(node)
        return node, length

    def _usable_end(self, node: TreeNode, next_token: int | None) -> bool:
        """Whether a hit may end at node's end, where the prompt goes on with next_token."""
        if self.check_draft_next and node.draft_next != next_token:
            return False
        return self.snapshots is None or node.snapshot != 0

    def path_pages(self, node: TreeNode) -> list[int]:
        """The pages from the root down to node, in sequence order."""
        runs = []
        while node is not None:
            runs.append(node.pages)
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Split node after its first k pages (0 < k < len(pages)); returns the new upper node, which ends there."""
        ps = self.page_size
        upper = TreeNode(key=node.key[:k * ps], pages=node.pages[:k], parent=node.parent, lock_ref=node.lock_ref,
                         last_access=node.last_access, draft_next=node.key[k * ps])
        node.parent.children[tuple(upper.key[:ps])] = upper
        node.key, node.pages, node.parent = node.key[k * ps:], node.pages[k:], upper
        upper.children[tuple(node.key[:ps])] = node
        return upper

    def _touch(self, node: TreeNode) -> None:
        now = (time.monotonic(), next(self._clock))
        while node is not None:
            node.last_access = now
            node = node.parent

    # ------------------------------------------------------------------ ownership
    def lock(self, node: TreeNode) -> None:
        """A running request uses the path root..node: none of it can be evicted until unlock."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        self._touch(node)
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            assert node.lock_ref >= 0, "prefix cache: unlocked more often than locked"
            node = node.parent

    def insert(self, node: TreeNode, tokens: list[int], pages: list[int], draft_next: int | None) -> TreeNode:
        """Add pages (a request's own, holding tokens[node's end : + len(pages) * page_size]) under node (which ends
        where they start); draft_next: the token after them that the draft's entry at their last position was made
        with. Returns the new node (the tree now owns the pages, unlocked), or node itself when nothing was added:
        another request cached the same first page meanwhile, so the caller keeps (and later frees) its pages."""
        if not pages:
            return node
        ps = self.page_size
        start = self._depth(node)
        key = tokens[start:start + len(pages) * ps]
        assert len(key) == len(pages) * ps, "prefix cache: pages beyond the tokens"
        first = tuple(key[:ps])
        if first in node.children:
            return node
        new = TreeNode(key=list(key), pages=list(pages), parent=node, draft_next=draft_next)
        node.children[first] = new
        self.cached_pages += len(pages)
        self.evictable_pages += len(pages)
        self._touch(new)
        return new

    def _depth(self, node: TreeNode) -> int:
        n = 0
        while node is not None:
            n += node.num_tokens
            node = node.parent
        return n

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free at least num_pages pages (fewer if not that many are evictable) from unlocked leaves, least
        recently used first; a parent left childless and unlocked becomes a leaf in turn. Returns pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            freed += self._remove(node)
            parent = node.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ------------------------------------------------------------------ snapshots
    def attach_snapshot(self, node: TreeNode, state_row: int) -> None:
        """Give node (which ends where state row `state_row`'s committed state is) a snapshot of that state; when
        the pool is full, the least recently used other node's snapshot is dropped for it."""
        if self.snapshots is None or node is self.root or node.snapshot:
            return
        if not self.snapshots.num_free:
            others = [n for n in self._snapshot_nodes.values() if n is not node]
            if not others:
                return
            self._drop_snapshot(min(others, key=lambda n: n.last_access))
        node.snapshot = self.snapshots.take(state_row)
        self._snapshot_nodes[node.snapshot] = node

    def restore_snapshot(self, node: TreeNode, state_row: int) -> None:
        """A hit at node: its snapshot becomes state row `state_row`'s committed state."""
        if self.snapshots is not None and node.snapshot:
            self.snapshots.restore(node.snapshot, state_row)

    def _drop_snapshot(self, node: TreeNode) -> None:
        del self._snapshot_nodes[node.snapshot]
        self.snapshots.free(node.snapshot)
        node.snapshot = 0

    def _remove(self, node: TreeNode) -> int:
        if node.snapshot:
            self._drop_snapshot(node)
        del node.parent.children[tuple(node.key[:self.page_size])]
        self.allocator.free(node.pages)
        n = len(node.pages)
        self.cached_pages -= n
        self.evictable_pages -= n
        return n

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def flush(self) -> None:
        """Drop every node (all must be unlocked: the engine is idle)."""
        if self.evictable_pages != self.cached_pages:
            raise RuntimeError("flush with locked prefix-cache nodes (requests running)")
        self.evict(self.cached_pages)
        assert self.cached_pages == 0 and not self.root.children and not self._snapshot_nodes

    def count(self, query_tokens: int, hit_tokens: int) -> None:
        """An admitted request looked up query_tokens tokens and took hit_tokens of them from the cache."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(cached_pages=self.cached_pages, evictable_pages=self.evictable_pages,
                                hit_tokens=self.hit_tokens, query_tokens=self.query_tokens,
                                state_snapshots=len(self._snapshot_nodes))
