"""KV cache: page allocator, page table (req_to_token), per-model K/V pools."""

from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.req_to_token import ReqToTokenPool

__all__ = ["KVPool", "PageAllocator", "ReqToTokenPool"]
