"""Training attention: dense SDPA over a padded [B, L] batch with an explicit boolean mask and no KV store.

It provides the one method of the attention-backend interface (specserve.attention.backend) that model code calls,
`forward(q, k, v, layer, fb, prep)`, so the target (no grad) and the draft (with grad) run their own model code
unchanged. Paging, metadata and graph capture have no meaning here, so it does not derive from AttentionBackend.

Chained drafting (docs/architecture.md) runs the draft layer once per depth over the whole batch. To give each
depth the keys inference would see, the backend can keep the keys and values of earlier depths (with their autograd
history) and attend over the concatenation [depth 1 | depth 2 | ... | depth k] under `chain_mask(L, k)`.

Sequences are right-padded. Every real query only sees keys at indices <= its own, all real, so the masks need no
per-sequence padding term; padded queries see real or padded keys and are masked out of the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.batch import CacheKind, ForwardBatch, ForwardMode


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[L, L] bool, True where query i may attend key t (t <= i)."""
    idx = torch.arange(seq_len, device=device)
    return idx[None, :] <= idx[:, None]


def chain_mask(seq_len: int, depth: int, device: torch.device) -> torch.Tensor:
    """[L, depth * L] bool: what the draft at chain depth `depth` sees at inference, for a query at index i.

    Keys are the concatenated per-depth keys [depth 1 | ... | depth k], each over indices 0..L-1. At inference the
    depth-k draft step at index i runs after the draft extend (depth-1, "clean" keys from the target's hidden
    states) has filled indices <= i-(k-1), and after the earlier draft steps j = 2..k-1 wrote their keys at
    indices i-(k-j); the step's own key (j = k) is at i. So the allowed keys are:
        depth 1:          t <= i - (k - 1)
        depth j (2..k):   t == i - (k - j)
    Every query row has at least its own key, so SDPA never sees an empty row.
    """
    i = torch.arange(seq_len, device=device)[:, None]  # [L, 1] query index
    t = torch.arange(seq_len, device=device)[None, :]  # [1, L] key index
    parts = [t <= i - (depth - 1)]
    for j in range(2, depth + 1):
        parts.append(t == i - (depth - j))
    return torch.cat(parts, dim=1)


class TrainAttentionBackend:
    """Attention for a padded batch of `batch_size` sequences of `seq_len` tokens (tokens flattened row-major)."""

    def __init__(self, batch_size: int, seq_len: int, mask: torch.Tensor, keep_keys: bool = False):
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.mask = mask  # [L, Lk] bool
        self.keep_keys = keep_keys
        # cache_index -> keys/values of earlier calls ([B, Hkv, L, D] each), kept with grad for chained depths
        self._past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def set_mask(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, fb, prep=None) -> torch.Tensor:
        """q [B*L, Hq, D], k/v [B*L, Hkv, D] -> [B*L, Hq, D]; prep (layers/attention.py QKPrep): q and k's norms and
        rotary, applied first by the unfused (differentiable) ops, as there is no store to fuse them with."""
        if prep is not None:
            q, k = prep.apply(q, k)
        b, n = self.batch_size, self.seq_len
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qq = q.view(b, n, hq, d).transpose(1, 2)  # [B, Hq, L, D]
        kk = k.view(b, n, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        vv = v.view(b, n, hkv, d).transpose(1, 2)
        if self.keep_keys:
            past = self._past.setdefault(layer.cache_index, [])
            past.append((kk, vv))
            kk = torch.cat([p[0] for p in past], dim=2)  # [B, Hkv, depth * L, D]
            vv = torch.cat([p[1] for p in past], dim=2)
        if self.mask.shape != (n, kk.shape[2]):
            raise ValueError(f"attention mask {tuple(self.mask.shape)} does not fit {n} queries x {kk.shape[2]} keys")
        if hq != hkv:
            # Expanded explicitly (instead of SDPA's enable_gqa) so the fused masked kernels stay eligible on CUDA.
            kk = kk.repeat_interleave(hq // hkv, dim=1)
            vv = vv.repeat_interleave(hq // hkv, dim=1)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=self.mask, scale=layer.scaling)
        return o.transpose(1, 2).reshape(b * n, hq, d)


def train_forward_batch(mode: ForwardMode, input_ids: torch.Tensor, positions: torch.Tensor,
                        backend: TrainAttentionBackend, hidden_in: torch.Tensor | None = None) -> ForwardBatch:
    """A ForwardBatch for a padded training batch: input_ids/positions [B*L], hidden_in [B*L, H]. The paging fields
    are empty: the training backend stores no KV."""
    none = torch.empty(0, dtype=torch.int64, device=input_ids.device)
    return ForwardBatch(mode=mode, batch_size=backend.batch_size, input_ids=input_ids, positions=positions,
                        out_cache_loc=none, req_pool_indices=none, seq_lens=none, max_seq_len=backend.seq_len,
                        hidden_in=hidden_in, backends={CacheKind.MHA: backend})
