"""Torch reference MLA attention over the paged latent cache (CacheKind.MLA), absorbed form, CPU and GPU.

With the key and value up-projections absorbed (layers/mla.py), multi-head latent attention is attention with one
shared key/value head: every query head scores the cached latent row [c ; k_rope] (kv_lora_rank + rope dims) and
takes its values from the row's first kv_lora_rank dims, c. So this backend is the MHA reference's metadata (which
slots each query sees, causal within its request; graphs/padding.py's padded rows see only slot 0) over a one-head
cache whose value is a prefix of its key. Capturable in fixed-width modes (decode, verify, the draft phases), like the
MHA reference; variable-length batches read their lengths on the host (CPU static replay only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.torch_backend import TorchAttentionBackend, _FixedMeta
from specserve.batch import CacheKind, ForwardBatch


class TorchMLABackend(TorchAttentionBackend):
    kind = CacheKind.MLA
    captures_varlen = False

    def forward(self, q: torch.Tensor, latent: torch.Tensor, layer, fb: ForwardBatch) -> torch.Tensor:
        """q [T, H, C + R] (absorbed nope part | rotated rope part); latent [T, C + R] this batch's new rows (stored
        at fb.out_cache_loc) -> [T, H, C] attention over the latent rows' first C = layer.kv_lora_rank dims."""
        rows = self.kv_pool.rows[layer.cache_index]  # [slots, C + R]
        rows[fb.out_cache_loc] = latent.to(rows.dtype)
        c = layer.kv_lora_rank
        meta = self.meta
        if isinstance(meta, _FixedMeta):
            bs, w = meta.mask.shape[0], meta.mask.shape[2]
            kv = rows.index_select(0, meta.kv_slots.reshape(-1)).view(bs, 1, -1, rows.shape[1]).to(q.dtype)
            qq = q.view(bs, w, layer.num_heads, -1).transpose(1, 2)  # [bs, H, w, C + R]
            o = F.scaled_dot_product_attention(qq, kv, kv[..., :c], attn_mask=meta.mask, scale=layer.scaling,
                                               enable_gqa=True)  # [bs, H, w, C]
            return o.transpose(1, 2).reshape(bs * w, layer.num_heads, c)
        out = q.new_empty((q.shape[0], layer.num_heads, c))
        for q0, e, slots, mask in meta.pieces:
            kv = rows.index_select(0, slots)[None, None].to(q.dtype)  # [1, 1, s, C + R]
            qq = q[q0:q0 + e].transpose(0, 1)[None]  # [1, H, e, C + R]
            o = F.scaled_dot_product_attention(qq, kv, kv[..., :c], attn_mask=mask[None, None], scale=layer.scaling,
                                               enable_gqa=True)
            out[q0:q0 + e] = o[0].transpose(0, 1)
        return out
