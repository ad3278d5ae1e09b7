"""The radix tree of kvcache/radix_cache.py on its own: matching whole pages, splitting, the draft's next-token
check at page edges, locks, LRU eviction of unlocked leaves, flush, and the page accounting."""

import pytest

from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.radix_cache import RadixCache


def _cache(ps=4, pages=64, draft=False):
    alloc = PageAllocator(pages, ps)
    return RadixCache(alloc, check_draft_next=draft), alloc


def _add(cache, alloc, tokens, valid=None, node=None):
    """A request's pages for tokens[:valid] (whole pages) under node, as KVManager.cache_prefix adds them."""
    ps = cache.page_size
    node = node or cache.root
    start = cache._depth(node)
    valid = len(tokens) if valid is None else valid
    n = valid // ps - start // ps
    pages = alloc.alloc(n)
    end = (start // ps + n) * ps
    new = cache.insert(node, tokens, pages, tokens[end] if end < len(tokens) else None)
    return new, pages


def test_match_is_whole_pages_and_splits_a_node_matched_part_way():
    cache, alloc = _cache(ps=4)
    seq = list(range(10, 30))  # 20 tokens = 5 pages
    node, pages = _add(cache, alloc, seq)
    assert cache.cached_pages == 5 and cache.evictable_pages == 5
    # 11 common tokens: 2 whole pages
    hit, n = cache.match(seq[:11] + [99, 98], limit=100)
    assert n == 8 and cache.path_pages(hit) == pages[:2]
    assert hit.parent is cache.root and len(hit.children) == 1  # the 5-page node was split 2 + 3
    assert cache.cached_pages == 5  # a split moves no page
    # the whole sequence, capped by the limit
    hit, n = cache.match(seq, limit=19)
    assert n == 16 and cache.path_pages(hit) == pages[:4]
    hit, n = cache.match([1, 2, 3, 4, 5], limit=5)
    assert n == 0 and hit is cache.root


def test_draft_next_backs_off_to_an_edge_where_the_drafts_entry_was_made_with_the_next_token():
    cache, alloc = _cache(ps=4, draft=True)
    seq = list(range(10, 26))  # 4 pages; its last page's draft entry was made with seq[16] = None (unknown)
    _add(cache, alloc, seq + [77], valid=16)  # made with 77 after position 15
    # diverging right at a page edge (position 8): the entry at 7 was made with seq[8], not 50 -> back off a page
    _, n = cache.match(seq[:8] + [50, 51, 52], limit=10)
    assert n == 4
    # diverging inside a page: the edge at 8 is followed by seq[8] as the draft saw it
    _, n = cache.match(seq[:9] + [50, 51], limit=10)
    assert n == 8
    # through the end: the draft's entry at 15 was made with 77
    _, n = cache.match(seq + [77, 1], limit=17)
    assert n == 16
    _, n = cache.match(seq + [78, 1], limit=17)
    assert n == 12
    # the same without a draft: every whole page counts
    plain, alloc2 = _cache(ps=4, draft=False)
    _add(plain, alloc2, seq + [77], valid=16)
    assert plain.match(seq[:8] + [50, 51, 52], limit=10)[1] == 8


def test_locked_paths_survive_eviction_and_lru_leaves_go_first():
    cache, alloc = _cache(ps=2, pages=32)
    free0 = alloc.num_free_pages
    a, _ = _add(cache, alloc, [1, 1, 2, 2, 3, 3])
    b, _ = _add(cache, alloc, [5, 5, 6, 6])
    c, own = _add(cache, alloc, [1, 1, 2, 2, 4, 4])  # added from the root, where a's first page [1, 1] is
    assert c is cache.root  # nothing taken: the request keeps its pages and frees them itself
    alloc.free(own)
    hit, n = cache.match([1, 1, 2, 2, 9], limit=5)
    assert n == 4
    cache.lock(hit)
    assert cache.evictable_pages == cache.cached_pages - 2
    cache.match([5, 5, 6, 6, 0], limit=5)  # b's path used most recently
    freed = cache.evict(1)
    assert freed == 1  # a's tail [3, 3]: least recently used unlocked leaf
    assert cache.match([1, 1, 2, 2, 3, 3, 0], limit=7)[1] == 4
    freed = cache.evict(100)  # everything unlocked goes, the locked path stays
    assert freed == 2 and cache.cached_pages == 2 and cache.match([1, 1, 2, 2, 0], limit=5)[1] == 4
    with pytest.raises(RuntimeError):
        cache.flush()
    cache.unlock(hit)
    cache.flush()
    assert cache.cached_pages == 0 and cache.evictable_pages == 0 and alloc.num_free_pages == free0


def test_insert_under_a_hit_extends_its_path():
    cache, alloc = _cache(ps=3)
    first, _ = _add(cache, alloc, [1, 2, 3, 4, 5, 6])
    hit, n = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 0], limit=9)
    assert n == 6 and hit is first
    longer, pages = _add(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0], node=hit)
    assert longer.parent is hit and cache.cached_pages == 3
    hit, n = cache.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 0], limit=10)
    assert n == 9 and cache.path_pages(hit)[-1] == pages[0]
