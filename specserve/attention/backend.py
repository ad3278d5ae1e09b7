"""The attention-backend interface.

There is one backend per cache kind (docs/architecture.md): this interface is the MHA kind's (paged K/V
attention). One backend instance belongs to one runner (or to the eager path) and one model's pool of its kind. It
owns its metadata buffers: a draft runner's backend can never write a target runner's metadata. A layer reaches it
with `fb.backend(CacheKind.MHA)` and its cache with its `cache_index` among the model's MHA layers.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

from specserve.batch import CacheKind, ForwardBatch
from specserve.kernels import ops
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from specserve.layers.attention import QKPrep


class AttentionBackend(abc.ABC):
    kind = CacheKind.MHA
    captures_varlen = False  # can a CUDA graph capture its variable-length (prefill) attention?

    def __init__(self, req_to_token: ReqToTokenPool, kv_pool: KVPool):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.graph_buffers: dict[str, torch.Tensor] = {}

    @abc.abstractmethod
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Eager path: build this forward's metadata (may allocate, may read host values)."""

    @abc.abstractmethod
    def alloc_graph_buffers(self, max_bs: int, width: int, max_seq_len: int) -> None:
        """Allocate this runner's private metadata buffers for fixed-width batches up to max_bs requests."""

    @abc.abstractmethod
    def alloc_varlen_graph_buffers(self, max_rows: int) -> None:
        """Allocate this runner's private metadata buffers for variable-length (prefill) batches of max_rows
        requests."""

    @abc.abstractmethod
    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        """Graph path: fill the private buffers from fb's tensors with device ops only (capturable, no host sync).
        A variable-length batch (fb.width None) brings its first tokens and new-token counts as device tensors
        (fb.extend_starts, fb.extend_lens); its grid bound is its token count.

        May be called several times inside one captured function (the draft-decode loop advances seq_lens)."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, fb: ForwardBatch,
                prep: QKPrep | None = None) -> torch.Tensor:
        """Store k, v at fb.out_cache_loc in layer.cache_index's K/V, then attend. q [T, Hq, D], k/v [T, Hkv, D]
        -> [T, Hq, D]. With prep, q and k first get its norms and rotary, in the same op as the store
        (store_or_prep)."""

    # The K/V store and its fusion with the q/k norms and rotary (the torch backend dispatches through ops; the
    # Triton backend calls its kernels directly, also under the interpreter on CPU).
    store_kv = staticmethod(ops.store_kv)
    qk_norm_rope_store = staticmethod(ops.qk_norm_rope_store)

    def layer_kv(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """layer's (k_cache, v_cache) [S, Hkv, D] (its layer.cache_index in the MHA pool)."""
        return self.kv_pool.k[layer.cache_index], self.kv_pool.v[layer.cache_index]

    def layer_scales(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """layer's (k_scale, v_scale) [S, Hkv] float32 row scales in an FP8 pool; (None, None) otherwise. Every
        writer and reader of layer_kv's caches takes them too."""
        if not self.kv_pool.is_fp8:
            return None, None
        return self.kv_pool.k_scale[layer.cache_index], self.kv_pool.v_scale[layer.cache_index]

    def store_or_prep(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, fb: ForwardBatch,
                      prep: QKPrep | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v at fb.out_cache_loc in layer.cache_index's K/V (an FP8 pool: quantized, with its row scales),
        after prep's norms and rotary on q and k (one op, q and k written in place) when given -> (the q to attend
        with, k_cache, v_cache) [S, Hkv, D]."""
        k_cache, v_cache = self.layer_kv(layer)
        k_scale, v_scale = self.layer_scales(layer)
        if prep is None:
            self.store_kv(k_cache, v_cache, fb.out_cache_loc, k, v, k_scale, v_scale)
        else:
            q, _ = prep.store(q, k, v, k_cache, v_cache, fb.out_cache_loc, self.qk_norm_rope_store, k_scale, v_scale)
        return q, k_cache, v_cache
