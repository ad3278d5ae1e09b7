"""KV cache: page allocator, page table (req_to_token), per-layer cache specs, pools per cache kind, state pool."""

from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.caches import ModelCaches
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.kvcache.state_pool import StatePool

__all__ = ["KVPool", "ModelCaches", "PageAllocator", "ReqToTokenPool", "StatePool"]
