"""What the prefix (radix) cache reports: /metrics, /get_server_info (kvcache/radix_cache.py keeps the counts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    cached_pages: int = 0  # KV pages the tree holds (in use by running requests or kept for reuse)
    evictable_pages: int = 0  # of those, pages no running request uses (freed under memory pressure, LRU)
    hit_tokens: int = 0  # prompt tokens admitted from the cache since start
    query_tokens: int = 0  # prompt tokens looked up since start
    state_snapshots: int = 0  # recurrent-state snapshots held (models with recurrent state)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
