"""Triton elementwise kernels (norms, activation, rotary, KV store) against their torch references.

On CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py before triton is imported); on a
GPU the compiled kernels run and are compared the same way. Outputs are poisoned (NaN) before every run so an
element a kernel fails to write shows up; inputs are strided views where the engine passes views.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels import triton_ops  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# Triton's interpreter truncates float32 -> bfloat16 instead of rounding to nearest even (triton 3.9), so values the
# GPU rounds exactly like torch may differ by one bfloat16 ulp on CPU.
ROUNDING_TOL = dict(atol=0, rtol=0) if DEV.type == "cuda" else dict(atol=0, rtol=2 ** -7)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


# ------------------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (37, 128), (3, 2500)])
def test_rms_norm(dtype, rows, hidden):
    g = _gen(rows * 1000 + hidden)
    base = _randn(rows, hidden + 8, dtype=dtype, g=g, scale=3.0)
    x = base[:, 3:3 + hidden]  # row-strided view, as a split of a fused projection
    w = _randn(hidden, dtype=dtype, g=g) + 1.0
    out = _poisoned((rows, hidden), dtype)
    got = triton_ops.rms_norm(x, w, 1e-6, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_strided_view(dtype):
    """q of a fused projection as [T, heads, D] with row stride > heads * D (and a gate after each head's query):
    read in place."""
    g = _gen(6)
    proj = _randn(7, 4, 2 * 32, dtype=dtype, g=g, scale=2.0)  # per head: query then gate
    q = proj[..., :32]  # strides (256, 64, 1)
    w = _randn(32, dtype=dtype, g=g)
    for offset in (0.0, 1.0):
        got = triton_ops.rms_norm(q, w, 1e-6, weight_offset=offset)
        assert got.shape == q.shape and got.is_contiguous()
        torch.testing.assert_close(got, ref.rms_norm(q.contiguous(), w, 1e-6, offset), **TOL[dtype])


def test_rms_norm_per_head_3d():
    """q/k norms run over [T, heads, head_dim]: many short rows packed per program."""
    g = _gen(5)
    x = _randn(9, 6, 64, dtype=torch.bfloat16, g=g)
    w = _randn(64, dtype=torch.bfloat16, g=g)
    got = triton_ops.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, ref.rms_norm(x.reshape(-1, 64), w, 1e-5).view_as(x), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (13, 96), (33, 256)])
def test_add_rms_norm(dtype, rows, hidden):
    g = _gen(rows * 7 + hidden)
    x = _randn(rows, hidden, dtype=dtype, g=g, scale=2.0)
    residual = _randn(rows, hidden, dtype=dtype, g=g, scale=5.0)
    w = _randn(hidden, dtype=dtype, g=g)
    out, res_out = _poisoned((rows, hidden), dtype), _poisoned((rows, hidden), dtype)
    normed, s = triton_ops.add_rms_norm(x, residual, w, 1e-6, out=out, residual_out=res_out)
    ref_normed, ref_s = ref.add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(s, ref_s, **ROUNDING_TOL)  # one rounding of x + residual, like torch
    torch.testing.assert_close(normed, ref_normed, **TOL[dtype])
    assert normed.data_ptr() == out.data_ptr() and s.data_ptr() == res_out.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_norms_match_reference_and_transformers(dtype):
    """weight_offset 1: (1 + w) in float32 inside the kernel, as transformers' Qwen3NextRMSNorm computes it."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    g = _gen(77)
    x = _randn(11, 96, dtype=dtype, g=g, scale=2.0)
    residual = _randn(11, 96, dtype=dtype, g=g)
    w = 0.1 * _randn(96, dtype=dtype, g=g)
    hf = Qwen3NextRMSNorm(96, eps=1e-6).to(dtype).to(DEV)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x)
        want_add = hf(x + residual)
    got = triton_ops.rms_norm(x, w, 1e-6, weight_offset=1.0)
    torch.testing.assert_close(got, ref.rms_norm(x, w, 1e-6, 1.0), **TOL[dtype])
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6, 1.0), want, rtol=0, atol=0)  # the reference is HF's
    torch.testing.assert_close(got, want, **TOL[dtype])
    normed, _ = triton_ops.add_rms_norm(x, residual, w, 1e-6, weight_offset=1.0)
    torch.testing.assert_close(normed, want_add, **TOL[dtype])


# ------------------------------------------------------------------------------------------------ SiLU-and-mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 96), (3, 2500)])
def test_silu_and_mul(dtype, rows, inter):
    g = _gen(rows + inter)
    x = _randn(rows, 2 * inter, dtype=dtype, g=g, scale=3.0)
    out = _poisoned((rows, inter), dtype)
    got = triton_ops.silu_and_mul(x, out=out)
    torch.testing.assert_close(got, ref.silu_and_mul(x), **TOL[dtype])


# ------------------------------------------------------------------------------------------------ rotary
def _cos_sin_cache(max_pos: int, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEV)  # [P, D]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,head_dim", [(4, 4, 64), (6, 2, 128), (8, 2, 64)])
@pytest.mark.parametrize("mrope", [False, True])
def test_rope(dtype, hq, hkv, head_dim, mrope):
    g = _gen(hq * 100 + head_dim + int(mrope))
    t = 11
    cache = _cos_sin_cache(300, head_dim)
    # q and k are strided views into one fused qkv buffer, as DenseAttention produces them
    qkv = _randn(t, (hq + 2 * hkv) * head_dim, dtype=dtype, g=g)
    q = qkv[:, :hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(t, hkv, head_dim)
    v_before = qkv[:, (hq + hkv) * head_dim:].clone()
    if mrope:
        positions = torch.randint(0, 300, (3, t), generator=g).to(DEV)
        half = head_dim // 2
        section = [half // 4, half // 4 + 3, half - 2 * (half // 4) - 3]
    else:
        positions = torch.randint(0, 300, (t,), generator=g).to(DEV)
        section = None
    cos, sin = ref.rope_cos_sin(cache, positions, section)
    ref_q, ref_k = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    got_q, got_k = triton_ops.rope(q, k, cache, positions, section)
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])
    torch.testing.assert_close(qkv[:, (hq + hkv) * head_dim:], v_before, atol=0, rtol=0)  # v untouched


def test_rope_positions_row_view():
    """1-D positions taken as a row of a 3-row mRoPE buffer (a model without mRoPE fed mRoPE positions)."""
    g = _gen(77)
    cache = _cos_sin_cache(64, 64)
    rows3 = torch.randint(0, 64, (3, 5), generator=g).to(DEV)
    q, k = _randn(5, 2, 64, g=g), _randn(5, 1, 64, g=g)
    cos, sin = ref.rope_cos_sin(cache, rows3[1], None)
    ref_q, ref_k = ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)
    got_q, got_k = triton_ops.rope(q.clone(), k.clone(), cache, rows3[1], None)
    torch.testing.assert_close(got_q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(got_k, ref_k, **TOL[torch.float32])


# ------------------------------------------------------------------------------------------------ KV store
@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.float16)])
@pytest.mark.parametrize("hkv,head_dim", [(1, 64), (3, 128)])
def test_store_kv(src_dtype, cache_dtype, hkv, head_dim):
    g = _gen(hkv * 10 + head_dim)
    t, slots = 9, 40
    kv = _randn(t, 2 * hkv * head_dim + 16, dtype=src_dtype, g=g)  # k and v as strided views of one buffer
    k = kv[:, :hkv * head_dim].view(t, hkv, head_dim)
    v = kv[:, hkv * head_dim:2 * hkv * head_dim].view(t, hkv, head_dim)
    loc = torch.randperm(slots - 1, generator=g)[:t].to(DEV) + 1  # distinct, non-contiguous slots
    k_cache, v_cache = _poisoned((slots, hkv, head_dim), cache_dtype), _poisoned((slots, hkv, head_dim), cache_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(ref_k, ref_v, loc, k, v)
    triton_ops.store_kv(k_cache, v_cache, loc, k, v)
    torch.testing.assert_close(k_cache, ref_k, atol=0, rtol=0, equal_nan=True)  # untouched slots stay NaN
    torch.testing.assert_close(v_cache, ref_v, atol=0, rtol=0, equal_nan=True)
    assert torch.isfinite(k_cache[loc]).all()


def test_store_kv_padded_tokens_write_dummy_slot():
    """Padded graph rows all write slot 0: that must not touch any other slot."""
    g = _gen(3)
    k, v = _randn(6, 2, 64, g=g), _randn(6, 2, 64, g=g)
    loc = torch.tensor([5, 7, 0, 0, 0, 0], device=DEV)
    k_cache, v_cache = _poisoned((10, 2, 64), torch.float32), _poisoned((10, 2, 64), torch.float32)
    triton_ops.store_kv(k_cache, v_cache, loc, k, v)
    torch.testing.assert_close(k_cache[[5, 7]], k[:2], atol=0, rtol=0)
    assert torch.isfinite(k_cache[0]).all() and torch.isfinite(v_cache[0]).all()
    others = [i for i in range(10) if i not in (0, 5, 7)]
    assert torch.isnan(k_cache[others]).all() and torch.isnan(v_cache[others]).all()
