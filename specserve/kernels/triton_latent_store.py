"""Triton store of new MLA latent rows (reference: kernels/reference_latent_fp8.py store_latent):
rows[loc[t]] = x[t], quantised for an fp8 cache by the latent rule (a float32 scale per 128 latent values, the rope
part its own group), else cast to the cache's dtype.

One program per token: the latent part as a [groups, 128] tile (each group a row of kernels/triton_kv_fp8.py's store
rule, padding columns 0), the rope part as one more row. One launch a layer, where the torch rule takes a dozen small
ones (pad, amax, divide, clamp, cast, concatenate, two scattered writes): an MLA model's decode graph holds one
store per layer, target and draft. Padded tokens all write the dummy slot 0; which one wins is irrelevant.
Whether the cache is fp8 is read from its element type at compile time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton_kv_fp8 import store_rows_fp8
from specserve.kvcache.cache_spec import LATENT_SCALE_GROUP, latent_scale_groups


@triton.jit
def _store_latent_kernel(x_ptr, rows_ptr, scales_ptr, loc_ptr, c, rope_dim, stride_x, stride_r, stride_s,
                         LAT_GROUPS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, RNE: tl.constexpr):
    """x [T, c + rope_dim] -> rows [S, c + rope_dim] at slots loc [T]; an fp8 cache's scales [S, G] (G = the
    latent's groups + 1 with a rope part): latent group g at column g, the rope part's at column cdiv(c, GROUP)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    x_row = x_ptr + t * stride_x
    dst = rows_ptr + slot * stride_r
    g = tl.arange(0, LAT_GROUPS)  # [LAT_GROUPS]
    col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [LAT_GROUPS, GROUP] the latent part's columns
    ok = col < c
    lat = tl.load(x_row + col, mask=ok, other=0.0).to(tl.float32)
    r = tl.arange(0, BLOCK_R)[None, :]  # [1, BLOCK_R] the rope part's columns after c
    r_ok = r < rope_dim
    rope = tl.load(x_row + c + r, mask=r_ok, other=0.0).to(tl.float32)
    if rows_ptr.dtype.element_ty.is_fp8():
        s_row = scales_ptr + slot * stride_s
        store_rows_fp8(dst + col, lat, ok, s_row + g, g * GROUP < c, RNE)
        n_lat = tl.cdiv(c, GROUP)
        one = tl.arange(0, 1)  # [1]: the rope part is one row of one scale
        store_rows_fp8(dst + c + r, rope, r_ok, s_row + n_lat + one, one < rope_dim, RNE)
    else:
        dt = rows_ptr.dtype.element_ty
        tl.store(dst + col, lat.to(dt), mask=ok)
        tl.store(dst + c + r, rope.to(dt), mask=r_ok)


def store_latent_triton(rows: torch.Tensor, scales: torch.Tensor | None, loc: torch.Tensor, x: torch.Tensor,
                        rope_dim: int) -> None:
    """rows [S, C + R] a layer's latent cache; scales [S, G] float32 for an fp8 cache, else None; loc [T] int;
    x [T, C + R]: as reference_latent_fp8.store_latent (bit for bit: the same rule, rounded to nearest even)."""
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    c = width - rope_dim
    fp8 = rows.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert rows.shape[1] == width and rows.stride(-1) == 1 and x.stride(-1) == 1
    if fp8:
        assert scales is not None and scales.dtype == torch.float32 and scales.stride(-1) == 1
        assert scales.shape == (rows.shape[0], latent_scale_groups(width, rope_dim))
    else:
        assert scales is None, f"scales given for a {rows.dtype} latent cache"
    lat_groups = triton.next_power_of_2(max(1, triton.cdiv(c, LATENT_SCALE_GROUP)))
    _store_latent_kernel[(num_tokens,)](
        x, rows, scales if fp8 else rows, loc, c, rope_dim, x.stride(0), rows.stride(0),
        scales.stride(0) if fp8 else 0, LAT_GROUPS=lat_groups, GROUP=LATENT_SCALE_GROUP,
        BLOCK_R=triton.next_power_of_2(max(1, rope_dim)), RNE=not x.is_cuda,
        num_warps=4 if lat_groups * LATENT_SCALE_GROUP <= 512 else 8)
