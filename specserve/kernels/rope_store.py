"""What an attention layer's q/k prep does after its q|k|v projection (optional per-head q/k RMSNorms, neox rotary
on the q and k heads, K and V stored into the paged caches), described for a kernel that does it in the
projection's epilogue (kernels/triton_gemv.py norm_gemv_rope_store; kernels/ops.py norm_gemv_rope_store)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NORM_MAX_HEADS = 1024  # q + k heads a launch with q/k norms may have: one arrival counter each (triton_gemv)


@dataclass
class RopeStore:
    """Rotary on all D dims of the q and k heads at positions [M], K and V stored at cache slots loc [M] of
    k_cache / v_cache [S, Hkv, D]. cos_sin_cache [P, D] float32: cos in the first half of a row, sin in the second
    (layers/rotary.py). q_norm_w / k_norm_w [D] (both or neither): each q and k head RMS-normed first (eps,
    weight_offset as layers/norm.py RMSNorm's), as kernels/triton_qk_prep.py does. k_scale / v_scale [S, Hkv]
    float32: an FP8 cache's row scales (kernels/reference_kv_fp8.py); the GEMV epilogue does not quantize, so
    `fits` refuses them and the caller runs the unfused ops, which do."""
    cos_sin_cache: torch.Tensor
    positions: torch.Tensor
    loc: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm_w: torch.Tensor | None = None
    k_norm_w: torch.Tensor | None = None
    eps: float = 1e-6
    weight_offset: float = 0.0
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self):
        if (self.q_norm_w is None) != (self.k_norm_w is None):
            raise ValueError("RopeStore takes both q and k norm weights, or neither")

    @property
    def has_norm(self) -> bool:
        return self.q_norm_w is not None

    def fits(self, x: torch.Tensor, w: torch.Tensor, config: dict[str, int]) -> bool:
        """Whether the GEMV launch `config` (triton_gemv.gemv_config's) on x [M, K], w [(Hq + 2 Hkv) D, K] can take
        the epilogue: the row GEMV (one row, or rows unrolled), a rotation-pair block (BLOCK_N / 2 dims) that
        tiles half a head, q|k and v regions of whole programs, full rotary, positions and slots [M], caches in
        x's dtype (no fp8 scales) with unit strides along D; q/k norm weights [D] with a unit stride, in x's dtype
        unless zero-centred (a plain weight in another dtype would make the reference's normed head float32), and
        no more q and k heads than the kernel's arrival counters (NORM_MAX_HEADS)."""
        m, d = x.shape[0], self.head_dim
        block_n = config["BLOCK_N"]
        qk_cols, v_cols = (self.num_q_heads + self.num_kv_heads) * d, self.num_kv_heads * d
        return (
            self.k_scale is None and self.v_scale is None and (m == 1 or bool(config.get("GEMV")))
            and block_n >= 2 and d % 2 == 0 and (d // 2) % (block_n // 2) == 0
            and w.shape[0] == qk_cols + v_cols and qk_cols % block_n == 0 and v_cols % block_n == 0
            and self.cos_sin_cache.shape[1] == d and self.cos_sin_cache.dtype == torch.float32
            and self.cos_sin_cache.stride(-1) == 1 and self.positions.shape == (m,) and self.loc.shape == (m,)
            and self.positions.is_contiguous() and self.loc.is_contiguous()
            and all(c.dtype == x.dtype and c.stride(-1) == 1 and c.shape[1:] == (self.num_kv_heads, d)
                    for c in (self.k_cache, self.v_cache))
            and (not self.has_norm or (
                self.num_q_heads + self.num_kv_heads <= NORM_MAX_HEADS
                and all(n.shape == (d,) and n.stride(-1) == 1 and (self.weight_offset or n.dtype == x.dtype)
                        for n in (self.q_norm_w, self.k_norm_w)))))
