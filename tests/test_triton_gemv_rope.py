"""The q/k prep in the epilogue of the qkv projection's row GEMV (kernels/triton_gemv.py norm_gemv_rope_store, its
epilogue kernels/triton_gemv_rope.py) against norm_gemv followed by the q/k prep kernel (kernels/triton_qk_prep.py):
the q|k|v output, the new residual and both caches, without and with per-head q/k norms, and the launches the
epilogue can take (RopeStore.fits). On CPU under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels.triton_gemv import norm_gemv  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16 = torch.bfloat16


def to_dev(*ts):
    return [t.to(DEV) if t is not None else None for t in ts]


def _rope_case(m: int, hq: int, hkv: int, d: int, k: int, bias: bool, g):
    """x, residual, norm weight, a q|k|v weight (and bias), a cos/sin table, positions and distinct cache slots."""
    n = (hq + 2 * hkv) * d
    x, r = torch.randn(m, k, generator=g).to(BF16), torch.randn(m, k, generator=g).to(BF16)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(BF16)
    w = (torch.randn(n, k, generator=g) / 8).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    cs = torch.randn(64, d, generator=g)
    pos = torch.randperm(64, generator=g)[:m]
    loc = torch.randperm(9, generator=g)[:m]
    return x, r, nw, w, b, cs, pos, loc


@pytest.mark.parametrize("m,block_n,residual,bias,late", [(1, 8, True, False, 0), (1, 4, False, True, 0),
                                                           (1, 2, True, True, 0), (1, 16, True, False, 0),
                                                           (3, 8, True, True, 0), (1, 4, True, False, 1),
                                                           (3, 8, False, True, 1)])
def test_norm_gemv_rope_store_equals_gemv_then_prep(m, block_n, residual, bias, late):
    """norm_gemv_rope_store (rotary and the K/V store in the GEMV's epilogue; rotation pairs split over programs as
    _rope_columns lays them out) gives exactly what norm_gemv and then the q/k prep kernel give: the q|k|v output
    (q and k rotated), the new residual, and both caches (other slots untouched); with the norm's statistics in the
    K loop (LATE_RSTD, SmolLM2's qkv launch) as without."""
    from specserve.kernels.rope_store import RopeStore
    from specserve.kernels.triton_gemv import norm_gemv_rope_store
    from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton

    g = torch.Generator().manual_seed(140 + m + block_n)
    hq, hkv, d = 4, 2, 16
    x, r, nw, w, b, cs, pos, loc = _rope_case(m, hq, hkv, d, 64, bias, g)
    r = r if residual else None
    cfg = dict(BLOCK_N=block_n, BLOCK_K=32, num_warps=4, num_stages=2, LATE_RSTD=late,
               **({"GEMV": 1} if m > 1 else {}))
    fill = torch.randn(9, hkv, d, generator=g).to(BF16).to(DEV)  # [S, Hkv, D] caches, distinct values
    kc1, vc1, kc2, vc2 = (fill.clone() for _ in range(4))
    cs, pos, loc = to_dev(cs, pos, loc)
    want, want_h = norm_gemv(*to_dev(x, r, nw), 1e-5, 0.0, *to_dev(w, b), config=cfg)
    q, k, v = want.split([hq * d, hkv * d, hkv * d], -1)
    qk_norm_rope_store_triton(q.view(m, hq, d), k.view(m, hkv, d), v.view(m, hkv, d), kc1, vc1, loc, cs, pos, None)
    rope = RopeStore(cs, pos, loc, kc2, vc2, hq, hkv, d)
    got, got_h = norm_gemv_rope_store(*to_dev(x, r, nw), 1e-5, 0.0, *to_dev(w, b), rope, config=cfg)
    assert torch.equal(got, want) and torch.equal(got_h, want_h)
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
    written = set(loc.tolist())
    assert not torch.equal(kc1, fill) and all(torch.equal(kc1[s], fill[s]) for s in range(9) if s not in written)


@pytest.mark.parametrize("m,block_n,offset,dtype", [(1, 8, 0.0, BF16), (1, 2, 0.0, BF16), (1, 16, 1.0, BF16),
                                                    (3, 4, 0.0, BF16), (2, 8, 0.0, torch.float32)])
def test_norm_gemv_rope_store_with_qk_norms_equals_gemv_then_prep(m, block_n, offset, dtype):
    """With per-head q/k RMSNorms (Qwen3; a zero-centred weight too) the epilogue's programs each hold part of a
    head, so the last of them norms and rotates it (_norm_rope_head): the result is the q/k prep kernel's after
    norm_gemv, up to the sum of squares' order (its partial sums by program; bf16: one rounding step where a value
    sits on a boundary), the caches' other slots untouched, and the arrival counters back at 0 for the next launch
    (a second launch gives the same)."""
    from specserve.kernels.rope_store import RopeStore
    from specserve.kernels.triton_gemv import norm_gemv_rope_store
    from specserve.kernels.triton_gemv_rope import _counters
    from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton

    g = torch.Generator().manual_seed(160 + m + block_n)
    hq, hkv, d = 4, 2, 16
    x, r, nw, w, b, cs, pos, loc = (t.to(dtype) if t.is_floating_point() and t.dtype == BF16 else t
                                    for t in _rope_case(m, hq, hkv, d, 64, True, g))
    qn, kn = ((offset == 0) + 0.3 * torch.randn(d, generator=g).to(dtype) for _ in range(2))
    cfg = dict(BLOCK_N=block_n, BLOCK_K=32, num_warps=4, num_stages=2, **({"GEMV": 1} if m > 1 else {}))
    fill = torch.randn(9, hkv, d, generator=g).to(dtype).to(DEV)  # [S, Hkv, D] caches, distinct values
    kc1, vc1, kc2, vc2 = (fill.clone() for _ in range(4))
    cs, pos, loc, qn, kn = to_dev(cs, pos, loc, qn, kn)
    want, want_h = norm_gemv(*to_dev(x, r, nw), 1e-5, 0.0, *to_dev(w, b), config=cfg)
    q, k, v = want.split([hq * d, hkv * d, hkv * d], -1)
    qk_norm_rope_store_triton(q.view(m, hq, d), k.view(m, hkv, d), v.view(m, hkv, d), kc1, vc1, loc, cs, pos, None,
                              qn, kn, 1e-6, offset)
    rope = RopeStore(cs, pos, loc, kc2, vc2, hq, hkv, d, qn, kn, 1e-6, offset)
    assert rope.fits(x, w, cfg)
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    for _ in range(2):  # the counters reset themselves: a second launch counts from 0 again
        got, got_h = norm_gemv_rope_store(*to_dev(x, r, nw), 1e-5, 0.0, *to_dev(w, b), rope, config=cfg)
        assert torch.equal(got_h, want_h) and torch.equal(got[:, (hq + hkv) * d:], want[:, (hq + hkv) * d:])  # v
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(kc2, kc1, atol=1e-6, rtol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), **tol)
            torch.testing.assert_close(kc2.float(), kc1.float(), **tol)
            assert (got != want).float().mean() < 0.05  # a few rounding steps, not another result
        assert torch.equal(vc2, vc1) and int(_counters(got.device)[: hq + hkv].abs().sum()) == 0
    written = set(loc.tolist())
    assert all(torch.equal(kc2[s], fill[s]) for s in range(9) if s not in written)
    assert not torch.equal(got[:, : hq * d], norm_gemv(*to_dev(x, r, nw), 1e-5, 0.0, *to_dev(w, b),
                                                        config=cfg)[0][:, : hq * d])  # q was normed and rotated


def test_rope_store_fits_only_launches_it_can_take():
    """RopeStore.fits refuses what the epilogue cannot do (pairs that do not tile half a head, regions that are not
    whole programs, partial rotary, 2-D positions, caches in another dtype, the skinny GEMM's rows), and a launch it
    refuses raises instead of computing something else."""
    from specserve.kernels.rope_store import RopeStore
    from specserve.kernels.triton_gemv import norm_gemv_rope_store

    g = torch.Generator().manual_seed(150)
    hq, hkv, d = 4, 2, 16
    x, r, nw, w, b, cs, pos, loc = _rope_case(1, hq, hkv, d, 64, False, g)
    kc, vc = torch.zeros(9, hkv, d, dtype=BF16), torch.zeros(9, hkv, d, dtype=BF16)
    rope = RopeStore(cs, pos, loc, kc, vc, hq, hkv, d)
    cfg = dict(BLOCK_N=8, BLOCK_K=32, num_warps=4, num_stages=2)
    assert rope.fits(x, w, cfg)
    assert not rope.fits(x, w, dict(cfg, BLOCK_N=32))  # 16 pair dims a program, but half a head is 8
    assert not rope.fits(x, w[:-8], cfg)  # not q|k|v of these heads
    assert not RopeStore(cs[:, :8], pos, loc, kc, vc, hq, hkv, d).fits(x, w, cfg)  # partial rotary
    assert not RopeStore(cs, pos[None].repeat(3, 1), loc, kc, vc, hq, hkv, d).fits(x, w, cfg)  # mRoPE rows
    assert not RopeStore(cs, pos, loc, kc.float(), vc, hq, hkv, d).fits(x, w, cfg)  # a float32 cache
    qn = torch.ones(d, dtype=BF16)
    assert RopeStore(cs, pos, loc, kc, vc, hq, hkv, d, qn, qn).fits(x, w, cfg)  # q/k norms
    assert not RopeStore(cs, pos, loc, kc, vc, hq, hkv, d, qn.float(), qn.float()).fits(x, w, cfg)  # fp32 weights
    assert RopeStore(cs, pos, loc, kc, vc, hq, hkv, d, qn.float(), qn.float(), weight_offset=1.0).fits(x, w, cfg)
    assert not RopeStore(cs, pos, loc, kc, vc, hq, hkv, d, qn[:8], qn[:8]).fits(x, w, cfg)  # not [D]
    with pytest.raises(ValueError, match="both"):
        RopeStore(cs, pos, loc, kc, vc, hq, hkv, d, qn)
    x3 = torch.randn(3, 64, generator=g).to(BF16)
    three = RopeStore(cs, torch.arange(3), torch.arange(3), kc, vc, hq, hkv, d)
    assert not three.fits(x3, w, cfg) and three.fits(x3, w, dict(cfg, GEMV=1))  # the skinny GEMM has no epilogue
    with pytest.raises(ValueError, match="epilogue"):
        norm_gemv_rope_store(*to_dev(x, r, nw), 1e-5, 0.0, *to_dev(w, b), RopeStore(*to_dev(cs, pos, loc, kc, vc),
                                                                                     hq, hkv, 2 * d),
                             config=cfg)
