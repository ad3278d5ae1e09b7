"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-5), absorbed, over a latent cache of kv_lora_rank +
qk_rope_head_dim values per token.

    q = q_b_proj(rms(q_a_proj(h)))   (or q_proj(h) without q-LoRA)      [T, H, nope + rope]
    [c ; k_rope] = kv_a_proj_with_mqa(h),  c = rms(c)                   [T, C], [T, R]; one rope key for all heads
    kv_b_proj.weight = per head [W_UK (nope rows) ; W_UV (v rows)] x C
    score(q, t) = q_nope . (W_UK c_t) + q_rope . k_rope_t = (W_UK^T q_nope) . c_t + q_rope . k_rope_t
    out = o_proj(W_UV (sum_t p_t c_t))

The up-projections are absorbed into the query (W_UK^T) and the output (W_UV), so only [c ; k_rope] is cached and
attention is one shared key/value head of C + R dims (values: the first C); attention/torch_mla_backend.py. Rope
layout: DeepSeek's checkpoints rotate interleaved pairs (rope_interleave); both q_rope and k_rope are de-interleaved
into the rotate-half layout before the rotation, which leaves every q . k unchanged.

Eager prefill of dense layers may instead decompress the cached rows into per-head keys and values and attend
without the absorption (--mla-prefill; attention/mla_prefill.py): the same cache, the same scores.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.batch import CacheKind, ForwardBatch
from specserve.distributed.tp import TP1, TPGroup
from specserve.kvcache.cache_spec import LatentCacheSpec
from specserve.layers.linear import Linear
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import ColumnParallelLinear, RowParallelLinear
from specserve.layers.rotary import RotaryEmbedding


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (the rotate-half layout)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, eps: float, scaling: float,
                 rope_interleave: bool, bias: bool, cache_index: int, rotary: RotaryEmbedding,
                 indexer: nn.Module | None = None, shared_index: bool = False, tp: TPGroup = TP1):
        """indexer: a DSA indexer (layers/dsa_indexer.py) restricting attention to its top-k keys; shared_index:
        reuse the previous indexed layer's selection instead (GLM-5's "shared" layers); tp: above one rank each
        keeps num_heads / size heads (their q_b / kv_b rows, o_proj columns); the latent (one head for all) and
        the indexer are computed and cached whole on every rank."""
        super().__init__()
        full_heads = num_heads
        num_heads = tp.split(num_heads, "attention heads")
        if (indexer is not None or shared_index) and not q_lora_rank:
            raise ValueError("sparse attention's indexer reads the q-LoRA residual: it needs q_lora_rank")
        self.indexer = indexer
        self.shared_index = shared_index
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scaling = scaling
        self.rope_interleave = rope_interleave
        self.cache_index = cache_index
        self.q_lora_rank = q_lora_rank
        def heads_out(in_features: int, per_head: int) -> Linear:  # rows grouped by head: a rank's heads
            if tp.size == 1:
                return Linear(in_features, full_heads * per_head)
            return ColumnParallelLinear(in_features, full_heads * per_head, tp)

        if q_lora_rank:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = heads_out(q_lora_rank, self.qk_head_dim)
        else:
            self.q_proj = heads_out(hidden_size, self.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = heads_out(kv_lora_rank, qk_nope_head_dim + v_head_dim)
        self.kv_b_proj.fp8_capable = False  # absorbed: its weight is read per head (below), not through forward
        self.o_proj = (Linear(num_heads * v_head_dim, hidden_size, bias=bias) if tp.size == 1
                       else RowParallelLinear(full_heads * v_head_dim, hidden_size, tp, bias=bias))
        self.rotary = rotary  # shared module, over the rope dims

    def cache_specs(self) -> list[LatentCacheSpec]:
        mla = LatentCacheSpec(self.kv_lora_rank + self.rope, CacheKind.MLA, self.rope)
        return [mla] if self.indexer is None else [mla, self.indexer.cache_spec()]

    def forward(self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """h [T, H_model] -> [T, H_model]; writes this layer's latent rows at fb.out_cache_loc."""
        t, nh, c = h.shape[0], self.num_heads, self.kv_lora_rank
        q_resid = self.q_a_layernorm(self.q_a_proj(h)) if self.q_lora_rank else None  # [T, q_lora]
        q = self.q_b_proj(q_resid) if self.q_lora_rank else self.q_proj(h)
        q_nope, q_rope = q.view(t, nh, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        c_new, k_rope = self.kv_a_proj_with_mqa(h).split([c, self.rope], dim=-1)  # [T, C], [T, R]
        c_new = self.kv_a_layernorm(c_new)
        k_rope = k_rope.reshape(t, 1, self.rope)
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        else:
            q_rope, k_rope = q_rope.contiguous(), k_rope.contiguous()
        q_rope, k_rope = self.rotary(positions, q_rope, k_rope)  # [T, H, R], [T, 1, R]
        w = self.kv_b_proj.weight.view(nh, self.nope + self.v_head_dim, c)  # [H, nope + v, C]: [W_UK ; W_UV]
        latent = torch.cat((c_new, k_rope.view(t, self.rope)), dim=-1)  # [T, C + R]
        mla = fb.backend(CacheKind.MLA)
        if self.indexer is None and not self.shared_index and mla.prefill_mha:  # dense layer, eager prefill
            out = mla.forward_mha(q_nope, q_rope, latent, w, self, fb)  # [T, H, V]: decompressed keys and values
            return self.o_proj(out.reshape(t, nh * self.v_head_dim))
        q_abs = torch.einsum("thn,hnc->thc", q_nope, w[:, :self.nope])  # [T, H, C]: W_UK absorbed
        selection = None
        if self.indexer is not None:
            selection = fb.backend(CacheKind.INDEX_KEYS).select(self.indexer(positions, h, q_resid), self.indexer, fb)
        elif self.shared_index:
            selection = fb.backend(CacheKind.INDEX_KEYS).last
        out = mla.forward(torch.cat((q_abs, q_rope), dim=-1), latent, self, fb, selection)
        out = torch.einsum("thc,hvc->thv", out, w[:, self.nope:])  # [T, H, V]: W_UV absorbed
        return self.o_proj(out.reshape(t, nh * self.v_head_dim))
