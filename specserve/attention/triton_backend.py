"""Triton attention backend over the paged KV cache (kernels: kernels/triton_attention.py; oracle:
attention/torch_backend.py).

Metadata is built once per forward (`init_forward_metadata*`) and read by every layer:
  * fixed-width batches (DECODE, TARGET_VERIFY, DRAFT_EXTEND, DRAFT_DECODE): page-table rows, KV lengths, and the
    number of KV splits of the split-KV kernel. The split count is a host int chosen from the batch size and the
    host bound fb.max_seq_len, both static per captured graph;
  * variable-length batches (EXTEND, prefill draft extend): rows, KV lengths, each request's first token and
    number of new tokens, and the longest extend (grid size) - eagerly from the host lists of the batch; in a
    prefill graph from device tensors, with the batch's (padded, static) token count as the grid bound.

The graph path copies the rows and KV lengths into this instance's own buffers with device ops only, so it is
capturable and a draft runner's backend never shares metadata with a target runner's (docs/architecture.md). Padded rows
(row 0, seq_len == width, slot 0) attend over dummy slot 0 only and stay finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.backend import AttentionBackend
from specserve.batch import ForwardBatch, extend_starts
from specserve.kernels.triton_attention import AttnPrep, fixed_width_attention, varlen_attention
from specserve.kernels.triton_kv import store_kv
from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.req_to_token import ReqToTokenPool

_CPU_NUM_SMS = 4  # stands in for the SM count on CPU (Triton interpreter) so the split heuristic is exercised


def kv_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, num_sms: int, max_kv_splits: int = 32,
              min_split_keys: int = 256) -> int:
    """KV splits of the split-KV kernel: enough (request, KV head, split) programs to cover every SM about twice,
    without splits shorter than min_split_keys, at most max_kv_splits. Depends on host ints only."""
    groups = max(1, batch_size * num_kv_heads)
    want = -(-2 * num_sms // groups)
    by_len = -(-max_seq_len // min_split_keys)
    return max(1, min(max_kv_splits, want, by_len))


@dataclass
class _FixedMeta:
    rows: torch.Tensor  # [bs] int64 page-table rows
    seq_lens: torch.Tensor  # [bs] int64 KV length after this forward
    width: int  # new tokens per request
    num_splits: int  # KV splits of the split-KV kernel (host int: static under graphs)


@dataclass
class _VarlenMeta:
    rows: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64 KV length after this forward (prefix + new)
    q_starts: torch.Tensor  # [bs] int64 first token of each request in q
    ext_lens: torch.Tensor  # [bs] int64 new tokens per request
    max_ext: int  # host max of ext_lens


class TritonAttentionBackend(AttentionBackend):
    captures_varlen = True
    store_kv = staticmethod(store_kv)
    qk_norm_rope_store = staticmethod(qk_norm_rope_store_triton)

    def __init__(self, req_to_token: ReqToTokenPool, kv_pool: KVPool, max_kv_splits: int = 32,
                 min_split_keys: int = 256, num_sms: int | None = None, block_n: int = 64, block_m: int = 64,
                 prep_in_attention: bool = True):
        """max_kv_splits caps the split-KV fan-out; min_split_keys is the fewest keys worth a split of their own;
        block_n / block_m: key / query tile sizes. prep_in_attention: fixed-width batches with a QKPrep the
        attention kernel can take (AttnPrep.fits) do the q/k prep inside the attention kernel instead of its own
        launch before it (measured faster or equal wherever it applies). False is a test seam only: the separate
        prep launch, the oracle tests/test_attention_prep.py compares the fused path against."""
        super().__init__(req_to_token, kv_pool)
        dev = req_to_token.table.device
        if num_sms is None:
            num_sms = (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda"
                       else _CPU_NUM_SMS)
        self.num_sms = num_sms
        self.max_kv_splits = max_kv_splits
        self.min_split_keys = min_split_keys
        self.block_n = block_n
        self.block_m = block_m
        self.prep_in_attention = prep_in_attention
        self.meta: _FixedMeta | _VarlenMeta | None = None

    def num_kv_splits(self, batch_size: int, max_seq_len: int) -> int:
        """kv_splits for this backend's KV heads, SMs and limits."""
        return kv_splits(batch_size, self.kv_pool.num_kv_heads, max_seq_len, self.num_sms, self.max_kv_splits,
                         self.min_split_keys)

    # ---------------------------------------------------------------- eager
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.width is not None:
            self.meta = _FixedMeta(fb.req_pool_indices, fb.seq_lens, fb.width,
                                   self.num_kv_splits(fb.batch_size, fb.max_seq_len))
            return
        ext = fb.extend_lens_cpu
        host = torch.tensor([fb.seq_lens_cpu, extend_starts(ext), ext], dtype=torch.int64)  # [3, bs]
        dev = host.to(fb.req_pool_indices.device, non_blocking=True)
        self.meta = _VarlenMeta(fb.req_pool_indices, dev[0], dev[1], dev[2], max(ext, default=0))

    # ---------------------------------------------------------------- graphs
    def alloc_graph_buffers(self, max_bs: int, width: int, max_seq_len: int) -> None:
        dev = self.req_to_token.table.device
        self.graph_buffers = {
            "rows": torch.zeros(max_bs, dtype=torch.int64, device=dev),  # [max_bs]
            "seq_lens": torch.full((max_bs,), width, dtype=torch.int64, device=dev),  # [max_bs]
        }

    def alloc_varlen_graph_buffers(self, max_rows: int) -> None:
        dev = self.req_to_token.table.device
        self.graph_buffers["varlen"] = torch.zeros((4, max_rows), dtype=torch.int64, device=dev)  # [4, rows]

    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        if fb.width is None:
            m = self.graph_buffers["varlen"][:, :bs]  # rows, KV lengths, first tokens, new tokens
            for dst, src in zip(m, (fb.req_pool_indices, fb.seq_lens, fb.extend_starts, fb.extend_lens)):
                dst.copy_(src)
            self.meta = _VarlenMeta(m[0], m[1], m[2], m[3], fb.num_tokens)
            return
        rows = self.graph_buffers["rows"][:bs]
        seq_lens = self.graph_buffers["seq_lens"][:bs]
        rows.copy_(fb.req_pool_indices)
        seq_lens.copy_(fb.seq_lens)
        self.meta = _FixedMeta(rows, seq_lens, fb.width, self.num_kv_splits(bs, fb.max_seq_len))

    # ---------------------------------------------------------------- attention
    def forward(self, q, k, v, layer, fb: ForwardBatch, prep=None) -> torch.Tensor:
        meta = self.meta
        table = self.req_to_token.table
        attn_prep = self._attn_prep(q, k, v, fb, prep) if isinstance(meta, _FixedMeta) else None
        k_scale, v_scale = self.layer_scales(layer)  # [S, Hkv] row scales of an FP8 pool, else None
        if attn_prep is not None:  # the attention kernel preps q and stores the new K/V itself
            k_cache, v_cache = self.layer_kv(layer)
            return fixed_width_attention(q, k_cache, v_cache, table, meta.rows, meta.seq_lens, meta.width,
                                         meta.num_splits, layer.scaling, block_n=self.block_n, prep=attn_prep,
                                         k_scale=k_scale, v_scale=v_scale)
        q, k_cache, v_cache = self.store_or_prep(q, k, v, layer, fb, prep)  # [S, Hkv, D] caches
        if q.stride(-1) != 1:
            q = q.contiguous()
        if isinstance(meta, _FixedMeta):
            return fixed_width_attention(q, k_cache, v_cache, table, meta.rows, meta.seq_lens, meta.width,
                                         meta.num_splits, layer.scaling, block_n=self.block_n, k_scale=k_scale,
                                         v_scale=v_scale)
        return varlen_attention(q, k_cache, v_cache, table, meta.rows, meta.seq_lens, meta.q_starts, meta.ext_lens,
                                meta.max_ext, layer.scaling, block_m=self.block_m, block_n=self.block_n,
                                k_scale=k_scale, v_scale=v_scale)

    def _attn_prep(self, q, k, v, fb: ForwardBatch, prep) -> AttnPrep | None:
        """prep as the attention kernel's AttnPrep where prep_in_attention holds and the kernel takes it, else None
        (no prep, a layer whose projection already stored K/V, partial rotary, mRoPE, strided heads)."""
        if not self.prep_in_attention or not hasattr(prep, "kernel_args"):
            return None
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return None
        cos_sin, positions, qw, kw, eps, offset = prep.kernel_args()
        if prep.rotary.mrope_section is not None or not AttnPrep.fits(q.shape[-1], cos_sin, positions):
            return None
        return AttnPrep(k, v, fb.out_cache_loc, cos_sin, positions, qw, kw, eps, offset)
