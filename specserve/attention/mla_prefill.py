"""MLA prefill without the absorption (--mla-prefill mha): each request's latent rows are decompressed into per-head
keys and values and the batch runs ordinary causal attention, for eager EXTEND batches of dense MLA layers.

The absorbed form (torch_mla_backend.py) scores every key over its whole latent row and takes values from it:
(C + R) + C multiply-adds per key and head (1088 at C = 512, R = 64). Decompressed, a key costs (nope + R) + v (320
at nope = v = 128), after one [S, C] x [C, H (nope + v)] up-projection of the request's S keys. A long prefill chunk
spreads that GEMM over many queries; decode, verify and draft rows (a few queries over a long context) cannot, so
they stay absorbed, as do prefill graphs (token rows through the Triton kernel) and DSA layers (each query attends
only its own top-k rows).

    k_nope | v = W_kv c        per head, from the cached (already normed) c        [S, H, nope], [S, H, v]
    k = [k_nope ; k_rope]      the one rotated rope key broadcast over the heads   [S, H, nope + R]
    o = softmax(scaling q k^T, causal) v                                           [T, H, v] -> o_proj (no W_UV)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.attention.eager_blocks import MAX_SCORES, query_blocks
from specserve.attention.torch_backend import _ExtendMeta
from specserve.kernels.reference_latent_fp8 import read_latent

# The most decompressed values (keys and values, [S, heads, nope + v] plus the keys' [S, heads, nope + R]) one
# request piece materialises at once: its heads go in groups under it (heads attend independently, nothing to merge).
# One head at least: a 200k-token context at nope = v = 128, R = 64 is 90 M values per head.
MAX_KV_VALUES = 1 << 28


def prefill_is_mha(choice: str) -> bool:
    """The one place that picks the form of an eager EXTEND batch's dense MLA attention: --mla-prefill absorbed or
    mha as asked; auto is mha, measured faster on the H200 at every chunk and prefix length
    scripts/gpu/bench_mla_prefill.py tries; small chunks on a GPU mostly run as prefill graphs
    (absorbed) anyway."""
    return choice in ("auto", "mha")


@dataclass
class MHAPrefillMeta(_ExtendMeta):
    """An eager EXTEND batch whose dense MLA layers attend decompressed (prefill_is_mha chose it). The same request
    pieces, so a layer that stays absorbed (a DSA layer) runs over it unchanged."""


def mha_prefill_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, w_kv: torch.Tensor,
                          meta: _ExtendMeta, scaling: float, max_scores: int = MAX_SCORES,
                          max_kv: int = MAX_KV_VALUES, scales: torch.Tensor | None = None) -> torch.Tensor:
    """q_nope [T, H, nope] and q_rope [T, H, R] (rotated): the query before absorption; rows [slots, C + R] the
    layer's latent cache, this batch's rows already stored; w_kv [H, nope + v, C] kv_b_proj's weight by head ->
    [T, H, v]. scales [slots, G] float32: an fp8 cache's group scales (the rows read dequantised, in q's dtype:
    kernels/reference_latent_fp8.py), else None. Per request piece: heads in groups of at most max_kv
    decompressed values, each group's queries in blocks of at most max_scores scores (the absorbed path's bound)."""
    t, heads, nope = q_nope.shape
    r, c = q_rope.shape[-1], w_kv.shape[2]
    v_dim = w_kv.shape[1] - nope
    q = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, nope + R]
    out = q.new_empty((t, heads, v_dim))
    for q0, e, slots, mask in meta.pieces:
        lat = read_latent(rows, scales, slots, r, q.dtype)  # [s, C + R]: the request's prefix and this chunk
        s = lat.shape[0]
        for h0, h1 in query_blocks(heads, s * (2 * nope + r + v_dim), max_kv):
            hb = h1 - h0
            kv = F.linear(lat[:, :c], w_kv[h0:h1].reshape(-1, c)).view(s, hb, nope + v_dim).transpose(0, 1)
            k = torch.cat((kv[..., :nope], lat[None, :, c:].expand(hb, s, r)), dim=-1)  # [hb, s, nope + R]
            v = kv[..., nope:]  # [hb, s, v]
            for a, b in query_blocks(e, hb * s, max_scores):
                qq = q[q0 + a:q0 + b, h0:h1].transpose(0, 1)  # [hb, b - a, nope + R]
                o = F.scaled_dot_product_attention(qq[None], k[None], v[None], attn_mask=mask[a:b][None, None],
                                                   scale=scaling)  # [1, hb, b - a, v]
                out[q0 + a:q0 + b, h0:h1] = o[0].transpose(0, 1)
    return out
