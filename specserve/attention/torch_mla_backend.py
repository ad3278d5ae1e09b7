"""Torch reference MLA attention over the paged latent cache (CacheKind.MLA), absorbed form, CPU and GPU; and the
sparse-attention indexer's backend (CacheKind.INDEX_KEYS), which restricts it to each query's top-k keys.

With the key and value up-projections absorbed (layers/mla.py), multi-head latent attention is attention with one
shared key/value head: every query head scores the cached latent row [c ; k_rope] (kv_lora_rank + rope dims) and
takes its values from the row's first kv_lora_rank dims, c. So this backend is the MHA reference's metadata (which
slots each query sees, causal within its request; graphs/padding.py's padded rows see only slot 0) over a one-head
cache whose value is a prefix of its key. Capturable in fixed-width modes (decode, verify, the draft phases), like the
MHA reference; variable-length batches read their lengths on the host (CPU static replay only). Eager prefill of
dense MLA layers may instead attend decompressed (--mla-prefill; attention/mla_prefill.py). An FP8 latent cache
(--kv-cache-dtype fp8_e4m3 / fp8_e5m2) keeps a float32 scale per group of each row: every write goes through
store_latent, every read dequantises (kernels/reference_latent_fp8.py; the Triton kernel inside its key tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.attention.eager_blocks import MAX_SCORES, query_blocks
from specserve.attention.mla_prefill import MAX_KV_VALUES, MHAPrefillMeta, mha_prefill_attention, prefill_is_mha
from specserve.attention.torch_backend import TorchAttentionBackend, _ExtendMeta, _FixedMeta
from specserve.batch import CacheKind, ForwardBatch, ForwardMode
from specserve.kernels.reference import quantise_rows_fp8
from specserve.kernels.reference_latent_fp8 import read_latent, store_latent


class TorchMLABackend(TorchAttentionBackend):
    kind = CacheKind.MLA
    captures_varlen = False
    max_scores = MAX_SCORES  # per instance where a test wants blocks of a few queries
    max_kv_values = MAX_KV_VALUES  # forward_mha's decompressed values per head group (per instance: tests)

    def __init__(self, req_to_token, kv_pool, mla_prefill: str = "absorbed"):
        """mla_prefill: --mla-prefill, the form of eager EXTEND batches' dense attention (attention/mla_prefill.py);
        every other batch attends absorbed."""
        super().__init__(req_to_token, kv_pool)
        self.mla_prefill = mla_prefill
        self._store_rows = store_latent  # the latent store (the rule's torch ops; TritonMLABackend's kernel)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        super().init_forward_metadata(fb)
        # only the target's eager prefill: graphs build their metadata elsewhere, and the draft's prefill is a draft
        # phase (DRAFT_EXTEND)
        if (fb.mode is ForwardMode.EXTEND and isinstance(self.meta, _ExtendMeta)
                and prefill_is_mha(self.mla_prefill)):
            self.meta = MHAPrefillMeta(self.meta.pieces)

    @property
    def prefill_mha(self) -> bool:
        """Do this forward's dense MLA layers attend decompressed (forward_mha) rather than absorbed (forward)?"""
        return isinstance(self.meta, MHAPrefillMeta)

    def forward_mha(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, w_kv: torch.Tensor,
                    layer, fb: ForwardBatch) -> torch.Tensor:
        """The non-absorbed form, where prefill_mha: q_nope [T, H, nope], q_rope [T, H, R] (rotated); latent [T, C + R]
        this batch's new rows (stored at fb.out_cache_loc); w_kv [H, nope + v, C] kv_b_proj's weight -> [T, H, v],
        o_proj's input."""
        rows, scales = self.store_latent(latent, layer, fb)
        return mha_prefill_attention(q_nope, q_rope, rows, w_kv, self.meta, layer.scaling, self.max_scores,
                                     self.max_kv_values, scales)

    def store_latent(self, latent: torch.Tensor, layer, fb: ForwardBatch):
        """This batch's new rows latent [T, C + R] stored at fb.out_cache_loc (in an fp8 cache quantised with a
        scale per group: kernels/reference_latent_fp8.py) -> the layer's (rows [slots, C + R], scales [slots, G]
        float32 or None)."""
        i = layer.cache_index
        rows = self.kv_pool.rows[i]
        scales = None if self.kv_pool.scales is None else self.kv_pool.scales[i]
        self._store_rows(rows, scales, fb.out_cache_loc, latent, rows.shape[1] - layer.kv_lora_rank)
        return rows, scales

    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer, fb: ForwardBatch,
                selection=None) -> torch.Tensor:
        """q [T, H, C + R] (absorbed nope part | rotated rope part); latent [T, C + R] this batch's new rows (stored
        at fb.out_cache_loc) -> [T, H, C] attention over the latent rows' first C = layer.kv_lora_rank dims.
        selection: the sparse-attention indexer's choice (TorchIndexBackend.select, same metadata layout), ANDed
        with the causal mask; None: dense."""
        rows, scales = self.store_latent(latent, layer, fb)  # [slots, C + R], [slots, G] or None
        c = layer.kv_lora_rank
        rope = rows.shape[1] - c
        meta = self.meta
        if isinstance(meta, _FixedMeta):
            bs, w = meta.mask.shape[0], meta.mask.shape[2]
            kv = read_latent(rows, scales, meta.kv_slots.reshape(-1), rope, q.dtype).view(bs, 1, -1, rows.shape[1])
            qq = q.view(bs, w, layer.num_heads, -1).transpose(1, 2)  # [bs, H, w, C + R]
            mask = meta.mask if selection is None else meta.mask & selection  # [bs, 1, w, kv]
            o = F.scaled_dot_product_attention(qq, kv, kv[..., :c], attn_mask=mask, scale=layer.scaling,
                                               enable_gqa=True)  # [bs, H, w, C]
            return o.transpose(1, 2).reshape(bs * w, layer.num_heads, c)
        out = q.new_empty((q.shape[0], layer.num_heads, c))
        for i, (q0, e, slots, mask) in enumerate(meta.pieces):
            kv = read_latent(rows, scales, slots, rope, q.dtype)[None, None]  # [1, 1, s, C + R]
            if selection is not None:
                mask = mask & selection[i]
            for a, b in query_blocks(e, layer.num_heads * slots.numel(), self.max_scores):
                qq = q[q0 + a:q0 + b].transpose(0, 1)[None]  # [1, H, b - a, C + R]
                o = F.scaled_dot_product_attention(qq, kv, kv[..., :c], attn_mask=mask[a:b][None, None],
                                                   scale=layer.scaling, enable_gqa=True)
                out[q0 + a:q0 + b] = o[0].transpose(0, 1)
        return out


def ranked_topk(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the min(k, kv) best keys along the last dim, best first, hidden keys (valid False) last; equal
    scores rank the earlier key first: exactly the first k of a stable descending sort, in every phase.

    Each score becomes one int64 that no other key shares: its float32 bits mapped to an order-preserving int32 in
    the high half (-0.0 counted as +0.0), (kv - 1 - position) in the low half. With every value distinct, torch.topk
    (a radix select, far cheaper than sorting 32k keys per query) has one answer, the stable sort's.
    scores [..., kv] float32; valid [..., kv] bool -> [..., min(k, kv)] int64."""
    kv = scores.shape[-1]
    s = scores.float().masked_fill(~valid, float("-inf")) + 0.0  # + 0.0: -0.0 -> +0.0, a tie as in a sort
    bits = s.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # monotonic in the float's value
    pos = torch.arange(kv, device=scores.device)
    key = (ordered << 32) | (kv - 1 - pos)
    return kv - 1 - (torch.topk(key, min(k, kv), dim=-1).values & 0xFFFFFFFF)


def topk_mask(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The `k` best of the valid keys along the last dim, as a mask; equal scores keep the earlier key (ranked_topk),
    in every phase. scores [..., kv] float32; valid [..., kv] bool -> [..., kv] bool."""
    chosen = ranked_topk(scores, valid, k)
    return torch.zeros_like(valid).scatter(-1, chosen, True) & valid


class TorchIndexBackend(TorchAttentionBackend):
    """The DSA indexer's keys (CacheKind.INDEX_KEYS): stores them and turns index queries into the top-k mask, in the
    layout of the MLA backend's metadata (both are built from the same batch). The last selection is kept for the
    layers that reuse it (GLM-5's "shared" indexer layers), within one forward."""

    kind = CacheKind.INDEX_KEYS
    captures_varlen = False
    max_scores = MAX_SCORES  # per-head scores of one eager block (query_blocks)

    def select(self, iq, indexer, fb: ForwardBatch):
        """iq: layers/dsa_indexer.py IndexQuery -> the selection (fixed width: [bs, 1, w, kv] bool; a prefill: one
        [e, s] mask per request piece)."""
        i = indexer.cache_index
        rows = self.kv_pool.rows[i]  # [slots, Di]
        self._store(iq, i, fb)
        meta = self.meta
        q_all = self._queries(iq.q)  # [T, Hi, Di] float32
        if isinstance(meta, _FixedMeta):
            bs, w = meta.mask.shape[0], meta.mask.shape[2]
            keys = self._keys(meta.kv_slots.reshape(-1), i).view(bs, -1, rows.shape[1])  # [bs, kv, D] float32
            q = q_all.view(bs, w, indexer.n_heads, -1)
            s = torch.einsum("bwhd,bkd->bwhk", q, keys).relu()  # [bs, w, Hi, kv]
            scores = torch.einsum("bwh,bwhk->bwk", iq.weights.view(bs, w, -1), s)
            self.last = topk_mask(scores, meta.mask[:, 0], indexer.topk)[:, None]  # [bs, 1, w, kv]
            return self.last
        out = []
        for q0, e, slots, mask in meta.pieces:
            keys = self._keys(slots, i)  # [s, D]
            parts = []
            for a, b in query_blocks(e, indexer.n_heads * slots.numel(), self.max_scores):
                s = torch.einsum("ehd,kd->ehk", q_all[q0 + a:q0 + b], keys).relu()  # [b - a, Hi, s]
                scores = torch.einsum("eh,ehk->ek", iq.weights[q0 + a:q0 + b], s)
                parts.append(topk_mask(scores, mask[a:b], indexer.topk))
            out.append(torch.cat(parts))  # [e, s]
        self.last = out
        return out

    def _store(self, iq, layer: int, fb: ForwardBatch) -> None:
        pool = self.kv_pool
        rows = pool.rows[layer]  # [slots, Di]
        if pool.scales is None:
            rows[fb.out_cache_loc] = iq.k.to(rows.dtype)
        else:  # fp8 with a float32 scale per token: the row's max maps to the format's largest finite value
            assert rows.dtype == torch.float8_e4m3fn
            k8, scale = quantise_rows_fp8(iq.k)  # [T, Di], [T]
            rows[fb.out_cache_loc] = k8
            pool.scales[layer][fb.out_cache_loc] = scale

    def _queries(self, q: torch.Tensor) -> torch.Tensor:
        """Index queries q [T, Hi, Di] -> float32; with fp8 index keys each (token, head) row rounded to e4m3 with
        its own scale first, as the keys are: DeepSeek-V3.2's fp8 indexer scores fp8 queries against fp8 keys, and
        the Triton backend's kernel does the same rounding (kernels/triton_indexer.py q_fp8)."""
        if self.kv_pool.scales is None:
            return q.float()
        q8, scale = quantise_rows_fp8(q)  # [T, Hi, Di], [T, Hi]
        return q8.float() * scale[..., None]

    def _keys(self, slots: torch.Tensor, layer: int) -> torch.Tensor:
        """Cached index keys of `slots` [n] -> [n, D] float32 (dequantised when stored in fp8)."""
        keys = self.kv_pool.rows[layer].index_select(0, slots).float()
        if self.kv_pool.scales is not None:
            keys = keys * self.kv_pool.scales[layer].index_select(0, slots)[:, None]
        return keys


@dataclass
class TokenRows:
    """A variable-length (prefill) batch as fixed-width rows of one token each: token t is a request of its own with
    its request's page-table row and its causal length, so the fixed-width kernels read the page table directly
    (their kv_rows) and a prefill graph has fixed shapes (its padded token count)."""

    rows: torch.Tensor  # [T] int64 page-table row of each token's request
    lens: torch.Tensor  # [T] int64 causal length of each token (its request's prefix + its offset + 1)
    width: int | None = None  # eager: the page-table columns the batch reaches (its longest KV); None: the row


def token_rows_eager(fb: ForwardBatch) -> TokenRows:
    """An eager variable-length batch (host lengths) -> TokenRows over the page table's first max(seq_lens)
    columns (a graph's token rows span the whole row: its shapes are fixed)."""
    dev = fb.req_pool_indices.device
    ext, seq = fb.extend_lens_cpu, fb.seq_lens_cpu
    rows = fb.req_pool_indices.repeat_interleave(torch.tensor(ext, device=dev))  # [T]
    lens = torch.cat([torch.arange(s - e + 1, s + 1) for s, e in zip(seq, ext) if e]).to(dev)  # [T]
    return TokenRows(rows, lens, max(seq))


def token_rows(fb: ForwardBatch) -> TokenRows:
    """fb's variable-length metadata (device tensors over its request slots: rows, KV lengths after the forward,
    first tokens, new tokens; graphs/padding.py stage_extend's layout, the padding tokens one more request on the
    dummy row) -> TokenRows, with device ops only (capturable)."""
    t = torch.arange(fb.num_tokens, device=fb.seq_lens.device)  # [T]
    starts, ext = fb.extend_starts, fb.extend_lens  # [R]
    j = torch.searchsorted(starts + ext, t, right=True).clamp_(max=starts.shape[0] - 1)  # [T] each token's request
    return TokenRows(fb.req_pool_indices[j], fb.seq_lens[j] - ext[j] + (t - starts[j]) + 1)


class _TokenRowsGraphs:
    """Prefill graphs for the Triton MLA and index backends: a variable-length batch under a graph (or the CPU's
    static replay) runs as TokenRows through the fixed-width kernels. Eager prefill: the index backend's token rows
    over the batch's longest KV (TritonIndexBackend.init_forward_metadata), the MLA attention of DSA layers over the
    chosen rows; dense MLA stays the torch reference's per-request path."""

    captures_varlen = True

    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        if fb.width is None:
            self.meta = token_rows(fb)
            return
        super().init_forward_metadata_graph(fb)


class TritonMLABackend(_TokenRowsGraphs, TorchMLABackend):
    """Fixed-width batches (decode, verify, the draft phases) and prefill graphs (as TokenRows) through the Triton
    absorbed-MLA kernel (kernels/triton_mla.py; each key's latent row read once for a block of heads), eager prefill
    batches through the torch reference. Chosen by --attention-backend triton, and by auto on CUDA."""

    def __init__(self, req_to_token, kv_pool, mla_prefill: str = "absorbed"):
        super().__init__(req_to_token, kv_pool, mla_prefill)
        from specserve.kernels.triton_latent_store import store_latent_triton
        from specserve.kernels.triton_mla import mla_decode_triton  # triton only where this backend is chosen

        self._kernel = mla_decode_triton
        self._store_rows = store_latent_triton  # the reference's rows and scales, bit for bit, in one launch

    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer, fb: ForwardBatch,
                selection=None) -> torch.Tensor:
        meta = self.meta
        if not isinstance(selection, SparseSelection) and not isinstance(meta, (_FixedMeta, TokenRows)):
            return super().forward(q, latent, layer, fb, selection)  # eager dense prefill: the reference
        mla_decode_triton = self._kernel
        rows, scales = self.store_latent(latent, layer, fb)  # [slots, C + R], [slots, G] or None
        if isinstance(selection, SparseSelection):  # each query token alone over its chosen rows
            return mla_decode_triton(q.contiguous(), rows, selection.slots, selection.counts, 1, layer.scaling,
                                     layer.kv_lora_rank, scales=scales)
        if isinstance(meta, TokenRows):  # each token over its request's page-table row, to its causal length
            return mla_decode_triton(q.contiguous(), rows, self.req_to_token.table, meta.lens, 1, layer.scaling,
                                     layer.kv_lora_rank, kv_rows=meta.rows, scales=scales)
        return mla_decode_triton(q.contiguous(), rows, meta.kv_slots, fb.seq_lens, meta.mask.shape[2],
                                 layer.scaling, layer.kv_lora_rank, selection, scales=scales)


@dataclass
class SparseSelection:
    """The indexer's choice as per-query key lists, for attention that reads only the chosen rows: every query token
    is its own row with its own length (fixed shapes under a graph)."""

    slots: torch.Tensor  # [T, K] cache slots of the chosen keys, the valid ones first (then slot 0 or -1)
    counts: torch.Tensor  # [T] int64 valid entries of each row (>= 1)


def topk_slots(scores: torch.Tensor, valid: torch.Tensor, kv_slots: torch.Tensor, k: int) -> SparseSelection:
    """The same choice as topk_mask (ranked_topk: equal scores keep the earlier key), as slot lists.
    scores, valid [bs, w, kv]; kv_slots [bs, kv] -> rows of bs * w queries."""
    bs, w, kv = scores.shape
    k = min(k, kv)
    chosen = ranked_topk(scores, valid, k)  # [bs, w, K] key positions, the valid ones first
    counts = valid.sum(dim=-1).clamp(max=k).clamp(min=1)  # [bs, w]
    slots = kv_slots[:, None, :].expand(bs, w, kv).gather(-1, chosen)  # [bs, w, K]
    live = torch.arange(k, device=scores.device) < counts[..., None]
    return SparseSelection(torch.where(live, slots, 0).reshape(bs * w, k), counts.reshape(bs * w))


class TritonIndexBackend(_TokenRowsGraphs, TorchIndexBackend):
    """Fixed-width batches and prefill graphs (as TokenRows) score the paged index keys with the Triton kernel
    (kernels/triton_indexer.py), choose the top-k with kernels/triton_topk.py and hand the MLA backend per-query slot
    lists (SparseSelection): attention then reads index_topk rows per query, not the whole context. Eager prefill
    batches too, as token rows over the batch's longest KV. With --attention-backend triton (or auto on CUDA), like
    TritonMLABackend."""

    def __init__(self, req_to_token, kv_pool):
        super().__init__(req_to_token, kv_pool)
        from specserve.kernels.triton_indexer import fuse_first_pass, index_scores_triton  # triton where chosen
        from specserve.kernels.triton_topk import index_topk_triton, topk_workspace

        self._kernel = index_scores_triton
        self._topk = index_topk_triton
        self._workspace = topk_workspace  # the top-k's histograms
        self._fuse = fuse_first_pass  # whether the scores kernel does their first pass

    def _hist(self, num_tokens: int, max_kv: int, device: torch.device) -> torch.Tensor | None:
        """The top-k's histograms for the scores kernel to do their first pass, or None (the top-k does it)."""
        return self._workspace(num_tokens, device) if self._fuse(num_tokens, max_kv, device) else None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.width is None:  # eager prefill as token rows too: each query's top-k, then attention over only those
            self.meta = token_rows_eager(fb)  # rows (not every earlier key, as the reference's masked prefix)
            return
        super().init_forward_metadata(fb)

    def select(self, iq, indexer, fb: ForwardBatch):
        meta = self.meta
        if not isinstance(meta, (_FixedMeta, TokenRows)):
            return super().select(iq, indexer, fb)
        index_scores_triton = self._kernel
        i = indexer.cache_index
        self._store(iq, i, fb)
        pool = self.kv_pool
        # fp8 keys: fp8 queries too (_queries), rounded in the kernel, and the tile's dot as [keys, heads] (keys_m:
        # the DSA step measured faster than with [heads, keys] over fp8 keys at batches 8 to 64), its fp8 sums
        # kept in the tensor core (fast_acc, DeepGEMM's precision) on a GPU
        fp8 = pool.scales is not None
        if isinstance(meta, TokenRows):  # [T, 1, table width] scores over each token's page-table row
            table = self.req_to_token.table if meta.width is None else self.req_to_token.table[:, :meta.width]
            hist = self._hist(iq.q.shape[0], table.shape[1], iq.q.device)
            scores = index_scores_triton(iq.q.contiguous(), iq.weights.contiguous(), pool.rows[i],
                                         None if pool.scales is None else pool.scales[i], table, meta.lens, 1,
                                         kv_rows=meta.rows, hist=hist, k=indexer.topk, q_fp8=fp8, keys_m=fp8,
                                         fast_acc=fp8)
            self.last = SparseSelection(*self._topk(scores, meta.lens, table, 1, indexer.topk, kv_rows=meta.rows,
                                                    hist=hist))
            return self.last
        hist = self._hist(iq.q.shape[0], meta.kv_slots.shape[1], iq.q.device)
        scores = index_scores_triton(iq.q.contiguous(), iq.weights.contiguous(), pool.rows[i],
                                     None if pool.scales is None else pool.scales[i], meta.kv_slots, fb.seq_lens,
                                     meta.mask.shape[2], hist=hist, k=indexer.topk,
                                     q_fp8=fp8, keys_m=fp8, fast_acc=fp8)  # [bs, w, kv]
        slots, counts = self._topk(scores, fb.seq_lens, meta.kv_slots, meta.mask.shape[2], indexer.topk, hist=hist)
        self.last = SparseSelection(slots, counts)  # topk_slots' choice, in position order
        return self.last
