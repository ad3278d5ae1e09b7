"""Torch reference attention over the paged KV cache. Runs on CPU and GPU (capturable in fixed-width modes only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.attention.backend import AttentionBackend
from specserve.batch import ForwardBatch, extend_starts
from specserve.kernels.reference_kv_fp8 import dequantize_kv


@dataclass
class _FixedMeta:
    kv_slots: torch.Tensor  # [bs, max_kv] slot of every key position (row 0 / slot 0 for padded rows)
    mask: torch.Tensor  # [bs, 1, w, max_kv] True where the query may attend


@dataclass
class _ExtendMeta:
    pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (q_start, q_len, slots [s], mask [q_len, s])


def _fixed_meta(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, width: int, max_kv: int,
                out_slots: torch.Tensor | None = None, out_mask: torch.Tensor | None = None) -> _FixedMeta:
    bs = rows.shape[0]
    kv_pos = torch.arange(max_kv, device=rows.device)  # [max_kv]
    slots = table[rows, :max_kv]  # [bs, max_kv]
    q_idx = seq_lens[:, None] - width + torch.arange(width, device=rows.device)[None, :]  # [bs, w]
    mask = (kv_pos[None, None, :] <= q_idx[:, :, None]).view(bs, 1, width, max_kv)
    if out_slots is not None:
        out_slots.copy_(slots)
        out_mask.copy_(mask)
        return _FixedMeta(out_slots, out_mask)
    return _FixedMeta(slots, mask)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for cache [S, Hkv, D] and slots [..] -> [.., Hkv, D], as whole-row copies: index_select copies
    each slot's contiguous Hkv x D block at once, where advanced indexing goes element by element (on the CPU
    several times slower, a visible share of a SmolLM2 verify step)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _read(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows at slots [..] of cache [S, Hkv, D] in dtype -> [.., Hkv, D]; an FP8 cache (scale [S, Hkv])
    dequantized (reference_kv_fp8.dequantize_kv: stored * scale in float32, then rounded to dtype)."""
    rows = _gather(cache, slots)
    if scale is None:
        return rows.to(dtype)
    return dequantize_kv(rows, _gather(scale, slots), dtype)


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, req_to_token, kv_pool):
        super().__init__(req_to_token, kv_pool)
        self.meta: _FixedMeta | _ExtendMeta | None = None

    # ---------------------------------------------------------------- eager
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.width is not None:  # decode / verify / draft phases: every request has `width` new tokens
            self.meta = _fixed_meta(self.req_to_token.table, fb.req_pool_indices, fb.seq_lens, fb.width,
                                    fb.max_seq_len)
            return
        self.meta = self._extend_meta(fb.req_pool_indices.tolist(), fb.seq_lens_cpu,
                                      extend_starts(fb.extend_lens_cpu), fb.extend_lens_cpu)

    def _extend_meta(self, rows: list[int], seq_lens: list[int], starts: list[int], ext: list[int]) -> _ExtendMeta:
        table = self.req_to_token.table
        pieces = []
        for row, s, q0, e in zip(rows, seq_lens, starts, ext):
            if e == 0:
                continue
            slots = table[row, :s]
            q_idx = torch.arange(s - e, s, device=table.device)
            mask = torch.arange(s, device=table.device)[None, :] <= q_idx[:, None]  # [e, s]
            pieces.append((q0, e, slots, mask))
        return _ExtendMeta(pieces)

    # ---------------------------------------------------------------- graphs
    def alloc_graph_buffers(self, max_bs: int, width: int, max_seq_len: int) -> None:
        dev = self.req_to_token.table.device
        self.graph_buffers = {
            "kv_slots": torch.zeros((max_bs, max_seq_len), dtype=torch.int64, device=dev),
            "mask": torch.zeros((max_bs, 1, width, max_seq_len), dtype=torch.bool, device=dev),
        }

    def alloc_varlen_graph_buffers(self, max_rows: int) -> None:
        pass  # variable-length metadata is read from the batch's tensors (below)

    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        if fb.width is None:
            # A padded prefill batch, run over static buffers. This reference reads the lengths back to the host,
            # so it serves the CPU's static replay; CUDA prefill graphs need the Triton backend (model_runner).
            if fb.req_pool_indices.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the torch attention backend cannot capture a variable-length batch")
            meta = torch.stack([fb.req_pool_indices, fb.seq_lens, fb.extend_starts, fb.extend_lens]).tolist()
            self.meta = self._extend_meta(*meta)
            return
        bs, kv = fb.batch_size, fb.max_seq_len
        gb = self.graph_buffers
        self.meta = _fixed_meta(self.req_to_token.table, fb.req_pool_indices, fb.seq_lens, fb.width, kv,
                                gb["kv_slots"][:bs, :kv], gb["mask"][:bs, :, :fb.width, :kv])

    # ---------------------------------------------------------------- attention
    def forward(self, q, k, v, layer, fb: ForwardBatch, prep=None) -> torch.Tensor:
        q, k_cache, v_cache = self.store_or_prep(q, k, v, layer, fb, prep)
        k_scale, v_scale = self.layer_scales(layer)
        meta = self.meta
        if isinstance(meta, _FixedMeta):
            bs, w = meta.mask.shape[0], meta.mask.shape[2]
            kk = _read(k_cache, k_scale, meta.kv_slots, q.dtype)  # [bs, kv, Hkv, D]
            vv = _read(v_cache, v_scale, meta.kv_slots, q.dtype)
            qq = q.view(bs, w, layer.num_heads, layer.head_dim).transpose(1, 2)  # [bs, Hq, w, D]
            o = F.scaled_dot_product_attention(qq, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=meta.mask,
                                               scale=layer.scaling, enable_gqa=True)
            return o.transpose(1, 2).reshape(bs * w, layer.num_heads, layer.head_dim)
        out = torch.empty_like(q)
        for q0, e, slots, mask in meta.pieces:
            kk = _read(k_cache, k_scale, slots, q.dtype).transpose(0, 1)[None]  # [1, Hkv, s, D]
            vv = _read(v_cache, v_scale, slots, q.dtype).transpose(0, 1)[None]
            qq = q[q0:q0 + e].transpose(0, 1)[None]  # [1, Hq, e, D]
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[None, None], scale=layer.scaling,
                                               enable_gqa=True)
            out[q0:q0 + e] = o[0].transpose(0, 1)
        return out
