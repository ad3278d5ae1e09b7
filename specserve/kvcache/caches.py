"""One model's caches, one pool per kind, built from its per-layer cache specs (docs/architecture.md).

Token-indexed pools (MHA K/V, MLA latents, indexer keys) all have `num_slots` slots and are addressed through the
one shared page table; the recurrent-state pool has a row per running request. The model runner sizes both from
one memory budget: the token slots over the target's and the draft's specs together, the state rows over the
target's (a draft with recurrent layers is refused by the speculative worker).
"""

from __future__ import annotations

import torch

from specserve.batch import CacheKind
from specserve.kvcache.cache_spec import CacheSpec, specs_of_kind
from specserve.kvcache.kv_pool import KVPool, LatentPool
from specserve.kvcache.state_pool import StatePool


class ModelCaches:
    def __init__(self, specs: list[CacheSpec], num_slots: int, kv_dtype: torch.dtype, device: torch.device,
                 state_rows: int = 0, state_slots: int = 1, kind_dtypes: dict[CacheKind, torch.dtype] | None = None):
        """specs: the model's cache_specs(); num_slots: token slots of every token-indexed pool; state_rows,
        state_slots: request rows and slots per row of the recurrent-state pool (models without recurrent layers:
        none is built); kind_dtypes: token-indexed kinds kept in another dtype than kv_dtype (fp8 indexer keys)."""
        kind_dtypes = kind_dtypes or {}
        self.specs = list(specs)
        self.pools: dict[CacheKind, KVPool | LatentPool | StatePool] = {}
        for kind in CacheKind:
            of_kind = specs_of_kind(self.specs, kind)
            if not of_kind:
                continue
            if kind is CacheKind.MHA:
                self.pools[kind] = KVPool.from_specs(of_kind, num_slots, kv_dtype, device)
            elif kind is CacheKind.RECURRENT:
                if state_rows <= 0:
                    raise ValueError("a model with recurrent layers needs state rows")
                self.pools[kind] = StatePool(of_kind, state_rows, state_slots, device)
            else:
                self.pools[kind] = LatentPool(of_kind, num_slots, kind_dtypes.get(kind, kv_dtype), device)

    @property
    def kinds(self) -> list[CacheKind]:
        return list(self.pools)

    @property
    def kv(self) -> KVPool | None:
        """The MHA K/V pool, if the model has MHA layers."""
        return self.pools.get(CacheKind.MHA)

    @property
    def state(self) -> StatePool | None:
        return self.pools.get(CacheKind.RECURRENT)
