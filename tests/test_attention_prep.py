"""The decode / verify attention kernel doing the q/k prep itself (kernels/triton_attention.py fixed_width_attention
with an AttnPrep) against the prep kernel followed by the same attention (kernels/triton_qk_prep.py), and the
Triton backend's use of it (attention/triton_backend.py prep_in_attention).

On CPU under Triton's interpreter (conftest.py): outputs and both caches must be bit-equal to the two launches,
since the prep's arithmetic is the same per element. Caches hold random keys and values in slots the batch does not
write, so a slot written that should not be, or a new key read before it was stored, shows up.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers import make_qk_prep  # noqa: E402

from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.batch import ForwardBatch, ForwardMode, fixed_width_out_cache_loc  # noqa: E402
from specserve.kernels.triton_attention import AttnPrep, fixed_width_attention  # noqa: E402
from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton  # noqa: E402
from specserve.kvcache.kv_pool import KVPool  # noqa: E402
from specserve.kvcache.req_to_token import ReqToTokenPool  # noqa: E402
from specserve.layers.attention import PagedAttention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_POS = 128
# On a GPU the compiler may contract the rotation to FMAs differently in the two kernels and sums a head's squares
# in another order: a rounding step of the dtype, not bit-equality.
EXACT = DEV.type == "cpu"


def _cos_sin(d: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEV)  # [P, D]


def _case(bs: int, width: int, hq: int, hkv: int, d: int, seq_lens: list[int], dtype, g):
    """A page table of scattered slots for rows 1..bs, caches of random K/V, a fused q|k|v projection output."""
    table = torch.zeros(bs + 1, MAX_POS, dtype=torch.int64)
    perm = torch.randperm(bs * MAX_POS, generator=g) + 1
    for r, s in enumerate(seq_lens, start=1):
        table[r, :s] = perm[(r - 1) * MAX_POS:(r - 1) * MAX_POS + s]
    slots = bs * MAX_POS + 1
    k_cache = torch.randn(slots, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, hkv, d, generator=g).to(dtype)
    rows, lens = torch.arange(1, bs + 1), torch.tensor(seq_lens)
    t = bs * width
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    positions = (lens[:, None] - width + torch.arange(width)[None, :]).reshape(-1)  # [T] the new tokens' indices
    table, k_cache, v_cache, rows, lens, qkv, positions = (x.to(DEV) for x in (table, k_cache, v_cache, rows, lens,
                                                                              qkv, positions))
    loc = fixed_width_out_cache_loc(table, rows, lens, width)
    return table, k_cache, v_cache, rows, lens, qkv, positions, loc


def _split(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _norm_weights(norm: str, d: int, g):
    if norm == "none":
        return None, None, 0.0
    offset = 1.0 if norm == "zero_centred" else 0.0
    w = [(torch.randn(d, generator=g) * 0.3 + (1.0 - offset)).to(DEV) for _ in range(2)]
    return w[0], w[1], offset


@pytest.mark.parametrize("bs,width,hq,hkv,splits,norm,dtype", [
    (1, 1, 4, 2, 1, "none", torch.float32),
    (2, 1, 4, 2, 3, "plain", torch.float32),
    (3, 1, 8, 2, 4, "plain", torch.bfloat16),
    (2, 4, 4, 1, 3, "zero_centred", torch.bfloat16),  # verify's width: new keys that straddle splits
    (1, 5, 6, 3, 2, "plain", torch.float32),
])
def test_prep_in_attention_equals_prep_then_attention(bs, width, hq, hkv, splits, norm, dtype):
    g = torch.Generator().manual_seed(bs * 100 + width * 10 + splits)
    d = 32
    seq_lens = [17, 40, 9][:bs] if width == 1 else [37, 21][:bs]
    table, kc, vc, rows, lens, qkv, positions, loc = _case(bs, width, hq, hkv, d, seq_lens, dtype, g)
    cs = _cos_sin(d)
    qw, kw, offset = _norm_weights(norm, d, g)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()

    q, k, v = _split(qkv.clone(), hq, hkv, d)
    qk_norm_rope_store_triton(q, k, v, kc1, vc1, loc, cs, positions, None, qw, kw, 1e-6, offset)
    want = fixed_width_attention(q, kc1, vc1, table, rows, lens, width, splits, d ** -0.5, block_n=16)

    q, k, v = _split(qkv.clone(), hq, hkv, d)
    prep = AttnPrep(k, v, loc, cs, positions, qw, kw, 1e-6, offset)
    got = fixed_width_attention(q, kc2, vc2, table, rows, lens, width, splits, d ** -0.5, block_n=16, prep=prep)

    assert torch.equal(q, _split(qkv, hq, hkv, d)[0]), "q was written: the attention must prep it in registers"
    written = torch.zeros(kc.shape[0], dtype=torch.bool, device=DEV)
    written[loc] = True
    assert torch.equal(kc2[~written], kc[~written]) and torch.equal(vc2[~written], vc[~written])
    assert not torch.equal(kc2[loc], kc[loc])
    if EXACT:
        assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)
        assert torch.equal(got, want)
    else:
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(kc2, kc1, **tol)
        assert torch.equal(vc2, vc1)
        torch.testing.assert_close(got, want, **tol)


def test_fits_only_full_rotary_power_of_two_heads_and_flat_positions():
    cs, pos = _cos_sin(32), torch.zeros(3, dtype=torch.int64)
    assert AttnPrep.fits(32, cs, pos)
    assert not AttnPrep.fits(64, cs, pos)  # partial rotary (Qwen3-Next)
    assert not AttnPrep.fits(32, cs, torch.zeros(3, 3, dtype=torch.int64))  # mRoPE rows
    assert not AttnPrep.fits(48, _cos_sin(48), pos)  # a head dim that is not a power of two
    assert not AttnPrep.fits(32, cs.double(), pos)


# ------------------------------------------------------------------------------------------------ the backend

@pytest.mark.parametrize("width,rot_dim,norms", [(1, 32, True), (3, 32, False), (1, 16, True)])
def test_backend_prep_in_attention_equals_the_prep_kernel(width, rot_dim, norms):
    """The backend with prep_in_attention gives the outputs and caches of the one without (the prep kernel and
    then attention); with partial rotary (rot_dim 16 of 32) it falls back to the prep kernel."""
    g = torch.Generator().manual_seed(width + rot_dim)
    hq, hkv, d, dtype = 4, 2, 32, torch.float32
    bs, seq_lens = 3, [9, 30, 17]
    r2t = ReqToTokenPool(bs + 1, MAX_POS, DEV)
    perm = torch.randperm(200, generator=g) + 1
    for r, s in enumerate(seq_lens, start=1):
        r2t.table[r, :s] = perm[sum(seq_lens[:r - 1]):sum(seq_lens[:r])].to(DEV)
    rows, lens = torch.arange(1, bs + 1, device=DEV), torch.tensor(seq_lens, device=DEV)
    positions = (lens[:, None] - width + torch.arange(width, device=DEV)[None, :]).reshape(-1)
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    fb = ForwardBatch(mode=mode, batch_size=bs, input_ids=torch.zeros_like(positions), positions=positions,
                      out_cache_loc=fixed_width_out_cache_loc(r2t.table, rows, lens, width), req_pool_indices=rows,
                      seq_lens=lens, max_seq_len=max(seq_lens), width=width)
    prep = make_qk_prep(d, rot_dim, norms, False, positions, g, MAX_POS)
    layer = PagedAttention(hq, hkv, d, d ** -0.5, cache_index=0)
    qkv = torch.randn(bs * width, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEV)
    k0, v0 = (torch.randn(201, hkv, d, generator=g).to(dtype).to(DEV) for _ in range(2))
    results = []
    for fused in (False, True):
        pool = KVPool(1, 201, hkv, d, dtype, DEV)
        pool.k[0].copy_(k0)
        pool.v[0].copy_(v0)
        be = TritonAttentionBackend(r2t, pool, num_sms=4, min_split_keys=8, block_n=16, prep_in_attention=fused)
        be.init_forward_metadata(fb)
        q, k, v = _split(qkv.clone(), hq, hkv, d)
        results.append((be.forward(q, k, v, layer, fb, prep), pool.k[0], pool.v[0]))
    (want, want_k, want_v), (got, got_k, got_v) = results
    assert not torch.equal(got_k, k0)
    exact = dict(atol=0, rtol=0) if EXACT else dict(atol=1e-5, rtol=1e-5)
    for a, b in ((got, want), (got_k, want_k), (got_v, want_v)):
        torch.testing.assert_close(a, b, **exact)
