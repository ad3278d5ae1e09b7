"""The fused q/k RMSNorm + rotary + K/V store (kernels/triton_qk_prep.py) against its torch reference
(kernels/reference.py qk_norm_rope_store), and the attention backends' use of it (layers/attention.py QKPrep).

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py). q, k, v are strided
views of one fused projection, as the attention layers pass them; caches are NaN-poisoned so a slot the kernel
should not write, or an element it fails to write, shows up.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers import make_qk_prep  # noqa: E402

from specserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.batch import ForwardBatch, ForwardMode, fixed_width_out_cache_loc  # noqa: E402
from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton  # noqa: E402
from specserve.kvcache.kv_pool import KVPool  # noqa: E402
from specserve.kvcache.req_to_token import ReqToTokenPool  # noqa: E402
from specserve.layers.attention import PagedAttention, QKPrep  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_TOKENS, NUM_SLOTS, MAX_POS = 7, 24, 64
# float32 rotary and copies are the reference's exact math (on a GPU the compiler may contract to FMAs); the norm
# sums in another order. bfloat16: a few ulps, and the interpreter truncates float32 -> bfloat16 (triton 3.9).
EXACT = dict(atol=0, rtol=0) if DEV.type == "cpu" else dict(atol=1e-6, rtol=1e-6)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cos_sin_cache(rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEV)  # [P, rot_dim]


def _positions(rot_dim: int, mrope: bool, g: torch.Generator):
    """-> (positions [T] or [3, T], mrope_section or None)."""
    if not mrope:
        return torch.randint(0, MAX_POS, (NUM_TOKENS,), generator=g).to(DEV), None
    half = rot_dim // 2
    section = [half // 4, half // 4 + 1, half - 2 * (half // 4) - 1]
    return torch.randint(0, MAX_POS, (3, NUM_TOKENS), generator=g).to(DEV), section


def _split(qkv: torch.Tensor, hq: int, hkv: int, d: int):
    """[T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D] strided views."""
    t = qkv.shape[0]
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _caches(hkv: int, d: int, dtype: torch.dtype):
    return tuple(torch.full((NUM_SLOTS, hkv, d), float("nan"), dtype=dtype, device=DEV) for _ in range(2))


def _run_both(qkv, hq, hkv, d, cache_dtype, cos_sin, positions, section, qw, kw, offset, seed):
    """The reference and the kernel on copies of qkv -> (reference (qkv, k_cache, v_cache), kernel's, loc)."""
    loc = (torch.randperm(NUM_SLOTS - 1, generator=_gen(seed))[:NUM_TOKENS] + 1).to(DEV)  # distinct, not slot 0
    out = []
    for fn in (ref.qk_norm_rope_store, qk_norm_rope_store_triton):
        buf = qkv.clone()
        q, k, v = _split(buf, hq, hkv, d)
        k_cache, v_cache = _caches(hkv, d, cache_dtype)
        fn(q, k, v, k_cache, v_cache, loc, cos_sin, positions, section, qw, kw, 1e-6, offset)
        out.append((buf, k_cache, v_cache))
    return out[0], out[1], loc


def _check_caches(want, got, loc, tol):
    for w, g in zip(want[1:], got[1:]):
        torch.testing.assert_close(g[loc], w[loc], **tol)
        others = torch.ones(NUM_SLOTS, dtype=torch.bool, device=DEV)
        others[loc] = False
        assert torch.isnan(g[others]).all(), "the kernel wrote a slot outside loc"


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("norm", ["none", "plain", "zero_centred"])
@pytest.mark.parametrize("hq,hkv,d,rot_dim", [(4, 2, 16, 16), (4, 2, 32, 8), (6, 2, 32, 32), (6, 2, 16, 4)])
@pytest.mark.parametrize("mrope", [False, True])
def test_matches_reference(dtype, cache_dtype, norm, hq, hkv, d, rot_dim, mrope):
    seed = hq * 1000 + d * 10 + rot_dim + int(mrope)
    g = _gen(seed)
    qkv = (torch.randn(NUM_TOKENS, (hq + 2 * hkv) * d, generator=g) * 2.0).to(dtype).to(DEV)
    positions, section = _positions(rot_dim, mrope, g)
    offset = 1.0 if norm == "zero_centred" else 0.0
    qw = kw = None
    if norm != "none":  # zero-centred weights are stored as (w - 1)
        qw, kw = ((torch.randn(d, generator=g) * 0.3 + 1.0 - offset).to(dtype).to(DEV) for _ in range(2))
    want, got, loc = _run_both(qkv, hq, hkv, d, cache_dtype, _cos_sin_cache(rot_dim), positions, section, qw, kw,
                               offset, seed)
    tol = EXACT if dtype == torch.float32 and norm == "none" else TOL[dtype]
    q_k = slice(0, (hq + hkv) * d)
    torch.testing.assert_close(got[0][:, q_k], want[0][:, q_k], **tol)  # q and k in place
    torch.testing.assert_close(got[0][:, q_k.stop:], qkv[:, q_k.stop:], atol=0, rtol=0)  # v untouched
    _check_caches(want, got, loc, tol)
    torch.testing.assert_close(got[2][loc], _split(qkv, hq, hkv, d)[2].to(cache_dtype), atol=0, rtol=0)  # v exact


def test_float32_weight_on_bfloat16_heads():
    """A plain norm with a float32 weight on bfloat16 heads: the reference's normed, rotated heads stay float32 (the
    dtype of x * w), so a float32 cache gets them unrounded; q and k in place are rounded once."""
    hq, hkv, d, rot_dim = 4, 2, 32, 16
    g = _gen(9)
    qkv = torch.randn(NUM_TOKENS, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16).to(DEV)
    positions, _ = _positions(rot_dim, False, g)
    qw, kw = ((torch.randn(d, generator=g) * 0.3 + 1.0).to(DEV) for _ in range(2))
    want, got, loc = _run_both(qkv, hq, hkv, d, torch.float32, _cos_sin_cache(rot_dim), positions, None, qw, kw, 0.0,
                               9)
    torch.testing.assert_close(got[0], want[0], **TOL[torch.bfloat16])
    # the normed heads are rounded to bfloat16 before the weight multiply: by truncation under the interpreter
    _check_caches(want, got, loc, TOL[torch.float32] if DEV.type == "cuda" else TOL[torch.bfloat16])


def test_zero_tokens():
    q, k, v = _split(torch.zeros(0, 4 * 16, device=DEV), 2, 1, 16)
    k_cache, v_cache = _caches(1, 16, torch.float32)
    loc = torch.zeros(0, dtype=torch.int64, device=DEV)
    qk_norm_rope_store_triton(q, k, v, k_cache, v_cache, loc, _cos_sin_cache(16), loc, None)
    assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


# ------------------------------------------------------------------------------------------------ backends
def _backend_setup(hq: int, hkv: int, d: int, dtype: torch.dtype, seq_lens: list[int], seed: int):
    """Rows 1..: positions below seq_len -> distinct scattered slots; a pool of random K/V."""
    g = _gen(seed)
    r2t = ReqToTokenPool(len(seq_lens) + 1, 64, DEV)
    live = torch.randperm(200, generator=g) + 1
    used = 0
    for r, s in enumerate(seq_lens, start=1):
        r2t.table[r, :s] = live[used:used + s].to(DEV)
        used += s
    pool = KVPool(1, 201, hkv, d, dtype, DEV)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g).to(dtype))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g).to(dtype))
    return r2t, pool, g


def _decode_batch(r2t: ReqToTokenPool, rows: list[int], seq_lens: list[int], positions: torch.Tensor) -> ForwardBatch:
    rows_t, seq_t = torch.tensor(rows, device=DEV), torch.tensor(seq_lens, device=DEV)
    return ForwardBatch(mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=torch.zeros_like(positions),
                        positions=positions, out_cache_loc=fixed_width_out_cache_loc(r2t.table, rows_t, seq_t, 1),
                        req_pool_indices=rows_t, seq_lens=seq_t, max_seq_len=max(seq_lens), width=1)


def _extend_batch(r2t: ReqToTokenPool, rows: list[int], seq_lens: list[int], ext: list[int],
                  positions: torch.Tensor) -> ForwardBatch:
    loc = torch.cat([r2t.table[r, s - e:s] for r, s, e in zip(rows, seq_lens, ext)])
    return ForwardBatch(mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=torch.zeros_like(positions),
                        positions=positions, out_cache_loc=loc, req_pool_indices=torch.tensor(rows, device=DEV),
                        seq_lens=torch.tensor(seq_lens, device=DEV), max_seq_len=max(seq_lens),
                        extend_lens_cpu=ext, seq_lens_cpu=seq_lens)


def _old_sequence(backend, q, k, v, layer, fb, prep: QKPrep) -> torch.Tensor:
    """What the attention layers did before the fusion: norms, rotary, then the backend's store + attention."""
    if prep.q_norm is not None:
        q, k = prep.q_norm(q), prep.k_norm(k)
    q, k = prep.rotary(prep.positions, q, k)
    return backend.forward(q, k, v, layer, fb)


def _compare_backends(make_backend, batch, hq, hkv, d, rot_dim, norms, zero_centred, dtype, tol):
    """The backend with prep vs the old explicit sequence on the same pool contents: outputs and caches."""
    r2t, pool, g = _backend_setup(hq, hkv, d, dtype, [9, 30, 17], seed=hq + d + rot_dim)
    fb = batch(r2t)
    t = fb.num_tokens
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEV)
    prep = make_qk_prep(d, rot_dim, norms, zero_centred, fb.positions, g, MAX_POS)
    layer = PagedAttention(hq, hkv, d, d ** -0.5, cache_index=0)
    results = []
    for fused in (False, True):
        p = KVPool(1, pool.k[0].shape[0], hkv, d, dtype, DEV)
        p.k[0].copy_(pool.k[0])
        p.v[0].copy_(pool.v[0])
        be = make_backend(r2t, p)
        be.init_forward_metadata(fb)
        q, k, v = _split(qkv.clone(), hq, hkv, d)
        out = be.forward(q, k, v, layer, fb, prep) if fused else _old_sequence(be, q, k, v, layer, fb, prep)
        results.append((out, p.k[0], p.v[0]))
    (want, want_k, want_v), (got, got_k, got_v) = results
    assert not torch.equal(got_k[fb.out_cache_loc], qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)), "k not prepped"
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)


@pytest.mark.parametrize("norms,zero_centred,rot_dim", [(False, False, 32), (True, False, 32), (True, True, 8)])
@pytest.mark.parametrize("phase", ["decode", "extend"])
def test_torch_backend_prep_equals_old_sequence(norms, zero_centred, rot_dim, phase):
    """The torch backend with prep (reference composition on CPU) reproduces the unfused ops exactly."""
    hq, hkv, d, dtype = 6, 2, 32, torch.float32
    positions = torch.tensor([8, 29, 16], device=DEV) if phase == "decode" else torch.arange(9, device=DEV) % 7
    if phase == "decode":
        batch = lambda r2t: _decode_batch(r2t, [1, 2, 3], [9, 30, 17], positions)
    else:
        batch = lambda r2t: _extend_batch(r2t, [2, 1, 3], [30, 9, 17], [3, 4, 2], positions)
    tol = dict(atol=0, rtol=0) if DEV.type == "cpu" else TOL[dtype]
    _compare_backends(TorchAttentionBackend, batch, hq, hkv, d, rot_dim, norms, zero_centred, dtype, tol)


@pytest.mark.parametrize("norms,zero_centred,rot_dim,dtype", [(False, False, 32, torch.float32),
                                                              (True, True, 8, torch.bfloat16)])
def test_triton_backend_prep_equals_old_sequence(norms, zero_centred, rot_dim, dtype):
    """The Triton backend with prep runs the fused kernel: same caches and outputs as the unfused ops."""
    hq, hkv, d = 4, 2, 32
    positions = torch.tensor([8, 29, 16], device=DEV)
    batch = lambda r2t: _decode_batch(r2t, [1, 2, 3], [9, 30, 17], positions)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else TOL[dtype]
    make = lambda r2t, pool: TritonAttentionBackend(r2t, pool, num_sms=4, min_split_keys=16, block_n=16)
    _compare_backends(make, batch, hq, hkv, d, rot_dim, norms, zero_centred, dtype, tol)
