"""Torch reference of the FP8 MLA latent cache (kvcache/kv_pool.py LatentPool of kind MLA in float8_e4m3fn /
float8_e5m2): the store rule and the read. The one store of every writer of latent rows (the MLA backends,
attention/torch_mla_backend.py, target and draft, eager and under graphs) and the oracle of the readers that
dequantise inside a kernel (kernels/triton_mla.py).

A latent row is [c ; k_rope]: kv_lora_rank values of the compressed (normed) latent, then rope_dim rotated rope-key
values (DeepSeek: 512 + 64). It is stored in the fp8 dtype with one float32 scale per group of values: the latent
part in groups of 128 (kvcache/cache_spec.py LATENT_SCALE_GROUP; the last one shorter when kv_lora_rank is not a
multiple), the rope part its own group after them, so 512 + 64 keeps 5 scales, [slots, 5] per layer. Within a group
the rule of the MHA rows (kernels/reference_kv_fp8.py):

    amax = max(|x_group|);  s = max(amax, 1e-10) / FMAX;  stored = fp8(clamp(x_group / s, -FMAX, FMAX))

read as stored * s in float32, then rounded to the query's dtype (so a kernel reading an fp8 row sees the values a
16-bit cache of those dequantised rows would hold).

Why groups, not one scale a row: the rope key and the compressed latent have different magnitudes (the latent is
RMS-normed, the rope key is not), and one scale for the row would map the smaller part onto few fp8 steps or into
subnormals; a scale per 128 values keeps each group's relative precision (DeepSeek's FlashMLA FP8 cache likewise
scales the latent per 128 values and keeps the rope part apart).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels.reference_kv_fp8 import quantize_kv
from specserve.kvcache.cache_spec import LATENT_SCALE_GROUP, latent_scale_groups


def scale_columns(width: int, rope_dim: int, device: torch.device) -> torch.Tensor:
    """[width] int64: the scale group of each value of a row (c // 128 for the latent part, the last group for the
    rope part)."""
    col = torch.arange(width, device=device)
    groups = latent_scale_groups(width, rope_dim)
    return torch.where(col < width - rope_dim, col // LATENT_SCALE_GROUP, groups - 1)


def quantize_latent(x: torch.Tensor, rope_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C + R] -> (stored [..., C + R] in dtype, scales [..., G] float32) by the rule above."""
    width = x.shape[-1]
    c = width - rope_dim
    g = -(-c // LATENT_SCALE_GROUP)
    xf = x.float()
    # the latent part as [..., g, 128] (zero padded: zeros change no group's max), one scale per group
    lat = F.pad(xf[..., :c], (0, g * LATENT_SCALE_GROUP - c)).unflatten(-1, (g, LATENT_SCALE_GROUP))
    s_lat, sc_lat = quantize_kv(lat, dtype)  # [..., g, 128], [..., g]
    parts, scales = [s_lat.flatten(-2)[..., :c]], [sc_lat]
    if rope_dim:
        s_rope, sc_rope = quantize_kv(xf[..., c:], dtype)  # [..., R], [...]
        parts.append(s_rope)
        scales.append(sc_rope[..., None])
    return torch.cat(parts, dim=-1), torch.cat(scales, dim=-1)


def dequantize_latent(stored: torch.Tensor, scales: torch.Tensor, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """stored [..., C + R] fp8, scales [..., G] float32 -> [..., C + R] in dtype (the product in float32, then
    rounded)."""
    cols = scale_columns(stored.shape[-1], rope_dim, stored.device)
    return (stored.float() * scales[..., cols]).to(dtype)


def store_latent(rows: torch.Tensor, scales: torch.Tensor | None, loc: torch.Tensor, x: torch.Tensor,
                 rope_dim: int) -> None:
    """rows [S, C + R] a layer's latent cache; scales [S, G] float32 for an fp8 cache, else None: x [T, C + R]
    stored at slots loc [T] (quantised by the rule above, or cast to the cache's dtype)."""
    if scales is None:
        rows[loc] = x.to(rows.dtype)
        return
    stored, s = quantize_latent(x, rope_dim, rows.dtype)
    rows[loc] = stored
    scales[loc] = s


def read_latent(rows: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, rope_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The cached rows of slots [n] -> [n, C + R] in dtype (dequantised from an fp8 cache)."""
    got = rows.index_select(0, slots)
    if scales is None:
        return got.to(dtype)
    return dequantize_latent(got, scales.index_select(0, slots), rope_dim, dtype)

