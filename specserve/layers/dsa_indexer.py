"""The DeepSeek Sparse Attention (DSA) indexer of DeepSeek-V3.2 and GLM-5: a light scorer that picks, for every
query, the `index_topk` earlier tokens its MLA attention may see.

    q = wq_b(q_resid)  [T, Hi, Di]  (q_resid: the MLA's q_a_layernorm(q_a_proj(h)));  k = LayerNorm(wk(h))  [T, Di]
    rope on the first qk_rope_head_dim dims of q and k (rotate-half for DeepSeek-V3.2, interleaved pairs for GLM-5)
    w = weights_proj(h) * Hi^-0.5  [T, Hi]   (float32, as transformers keeps weights_proj)
    score(q, t) = sum_h w_h * relu(Di^-0.5 * q_h . k_t)

k is cached per token (CacheKind.INDEX_KEYS, on the one page table); the scores, the top-k and the mask it makes
are the backend's (attention/torch_mla_backend.py TorchIndexBackend), with one deterministic tie-break for every
phase: equal scores keep the earlier token (ReLU makes exact ties common, and a choice that differs between prefill,
decode, verify and the draft phases would break lossless speculation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.batch import CacheKind
from specserve.kvcache.cache_spec import LatentCacheSpec
from specserve.layers.linear import Linear
from specserve.layers.mla import deinterleave
from specserve.layers.rotary import RotaryEmbedding


@dataclass
class IndexQuery:
    q: torch.Tensor  # [T, Hi, Di] rotated queries
    weights: torch.Tensor  # [T, Hi] float32 per-head weights (Hi^-0.5 and the score scale Di^-0.5 folded in)
    k: torch.Tensor  # [T, Di] this batch's rotated keys (to cache)


class DSAIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 rope_interleave: bool, cache_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.rope_interleave = rope_interleave
        self.cache_index = cache_index
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim)
        self.wk = Linear(hidden_size, head_dim)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = Linear(hidden_size, n_heads)
        self.weights_proj.fp8_capable = False  # float32 (loader.keep_float32_params); its input is cast to it
        self.rotary = rotary  # shared module, over the rope dims

    def cache_spec(self) -> LatentCacheSpec:
        return LatentCacheSpec(self.head_dim, CacheKind.INDEX_KEYS)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, q_resid: torch.Tensor) -> IndexQuery:
        t, r = h.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(h)).view(t, 1, self.head_dim)
        q_rot, k_rot = q[..., :r], k[..., :r]
        if self.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        else:
            q_rot, k_rot = q_rot.contiguous(), k_rot.contiguous()
        q_rot, k_rot = self.rotary(positions, q_rot, k_rot)
        q = torch.cat((q_rot, q[..., r:]), dim=-1)  # [T, Hi, Di]
        k = torch.cat((k_rot, k[..., r:]), dim=-1).view(t, self.head_dim)  # [T, Di]
        w = self.weights_proj(h.to(self.weights_proj.weight.dtype)).float()
        w = w * (self.n_heads ** -0.5 * self.head_dim ** -0.5)  # [T, Hi]
        return IndexQuery(q, w, k)
