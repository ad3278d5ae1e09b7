"""The FP8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2; kvcache/kv_pool.py KVPool with row scales).

1. The store rule (kernels/reference_kv_fp8.py) round-trips each (token, head) row within the format's rounding.
2. Every Triton writer and reader against the torch reference on the same FP8 pool contents, under the interpreter
   on CPU: stores bit-equal (store_kv, the q/k prep kernel, the attention kernel's in-kernel prep store), attention
   outputs within a float32 rounding bound (bf16: the bf16-cache tests' bound, and bit-equal to the same kernel over
   a bf16 cache of the dequantized rows) - fixed width 1 and 4 with and without key splits and the fused prep,
   varlen over a paged prefix, page sizes 1 and 4.
3. FP8-KV attention against float32-KV attention on Gaussian data: a measured error bound.
4. The engine: greedy MTP == greedy plain with an FP8 cache (llama, Qwen3-Next); the pool holds about twice the
   tokens of a 16-bit cache; an MLA model (DeepSeek-V3) gets fp8 latents (tests/test_fp8_mla_cache.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from helpers import build_tiny_model, make_qk_prep  # noqa: E402

from specserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.batch import ForwardBatch, ForwardMode, fixed_width_out_cache_loc  # noqa: E402
from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.reference_kv_fp8 import FP8_MAX, dequantize_kv, quantize_kv  # noqa: E402
from specserve.kernels.triton_kv import store_kv  # noqa: E402
from specserve.kernels.triton_qk_prep import qk_norm_rope_store_triton  # noqa: E402
from specserve.kvcache.cache_spec import MHACacheSpec  # noqa: E402
from specserve.kvcache.kv_pool import KVPool  # noqa: E402
from specserve.kvcache.req_to_token import ReqToTokenPool  # noqa: E402
from specserve.layers.attention import PagedAttention  # noqa: E402

# The kernel-vs-reference tests build CPU tensors for Triton's interpreter; on a GPU machine the same comparisons run
# on CUDA tensors in tests/test_gpu_fp8_kv.py.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under Triton's interpreter")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MANTISSA = {E4M3: 3, E5M2: 2}
MIN_NORMAL_EXP = {E4M3: -6, E5M2: -14}
ROW_WIDTH = 64  # page-table row width (max context)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.element_size() == 1 else x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------------------------------ 1. the rule

@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_round_trip_within_the_format_rounding(dtype):
    """Each element of a row comes back within half an ulp of the format at its scaled magnitude: relative
    2^-(m+1) for normal values, absolute half the subnormal ulp (times the scale) below; rows of very different
    magnitudes (1e-6 .. 1e3) and a row of zeros."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, 64, generator=g) * torch.logspace(-6, 3, 16)[:, None, None]
    x[3, 1] = 0.0
    stored, s = quantize_kv(x, dtype)
    assert stored.dtype == dtype and s.shape == (16, 4) and s.dtype == torch.float32
    back = dequantize_kv(stored, s, torch.float32)
    m = MANTISSA[dtype]
    sub_half_ulp = 2.0 ** (MIN_NORMAL_EXP[dtype] - m - 1)
    bound = torch.maximum(x.abs() * 2.0 ** -(m + 1), sub_half_ulp * s[..., None]) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[3, 1], torch.zeros(64))
    # each row's largest magnitude maps onto the format's largest value: nothing saturates, the range is used
    assert torch.allclose(stored.float().abs().amax(-1)[s > 1e-9], torch.tensor(FP8_MAX[dtype]))


# ------------------------------------------------------------------------------------------------ 2. Triton vs torch

def _rand_rows(shape, g, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-4, 4, shape[:-1] + (1,), generator=g)).to(dtype)


@INTERPRETER_ONLY
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_equals_reference(kv_dtype, x_dtype):
    g = torch.Generator().manual_seed(1)
    t, h, d, slots = 9, 3, 64, 24
    k, v = _rand_rows((t, h, d), g, x_dtype), _rand_rows((t, h, d), g, x_dtype)
    k[0, 0] = 0.0
    loc = torch.randperm(slots - 1, generator=g)[:t] + 1
    pools = [KVPool(1, slots, h, d, kv_dtype, torch.device("cpu")) for _ in range(2)]
    store_kv(pools[0].k[0], pools[0].v[0], loc, k, v, pools[0].k_scale[0], pools[0].v_scale[0])
    ref.store_kv(pools[1].k[0], pools[1].v[0], loc, k, v, pools[1].k_scale[0], pools[1].v_scale[0])
    for name in ("k", "v", "k_scale", "v_scale"):
        assert _same(getattr(pools[0], name)[0], getattr(pools[1], name)[0]), name


@INTERPRETER_ONLY
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rot_dim,norms", [(64, False), (32, False), (64, True)])
def test_qk_prep_store_equals_reference(kv_dtype, rot_dim, norms):
    """The q/k prep kernel's K (normed, rotated; partial rotary: three tiles under one scale) and V stores. With
    q/k norms the interpreter's rsqrt differs from torch's in the last bit, so then the scales agree to float32
    rounding and the stored codes to one step."""
    g = torch.Generator().manual_seed(rot_dim + norms)
    t, hq, h, d, slots = 5, 4, 2, 64, 20
    q, k, v = _rand_rows((t, hq, d), g), _rand_rows((t, h, d), g), _rand_rows((t, h, d), g)
    positions = torch.randint(0, 50, (t,), generator=g)
    prep = make_qk_prep(d, rot_dim, norms, False, positions, g, 64)
    cs, pos, qw, kw, eps, offset = prep.kernel_args()
    loc = torch.randperm(slots - 1, generator=g)[:t] + 1
    pools = [KVPool(1, slots, h, d, kv_dtype, torch.device("cpu")) for _ in range(2)]
    outs = []
    for fn, p in ((qk_norm_rope_store_triton, pools[0]), (ref.qk_norm_rope_store, pools[1])):
        qq, kk = q.clone(), k.clone()
        fn(qq, kk, v, p.k[0], p.v[0], loc, cs, pos, None, qw, kw, eps, offset, False, p.k_scale[0], p.v_scale[0])
        outs.append(qq)
    assert _same(pools[0].v[0], pools[1].v[0]) and _same(pools[0].v_scale[0], pools[1].v_scale[0])
    if not norms:
        assert torch.equal(outs[0], outs[1])
        assert _same(pools[0].k[0], pools[1].k[0]) and _same(pools[0].k_scale[0], pools[1].k_scale[0])
    else:
        torch.testing.assert_close(pools[0].k_scale[0], pools[1].k_scale[0], rtol=1e-6, atol=0)
        steps = (pools[0].k[0].view(torch.uint8).int() - pools[1].k[0].view(torch.uint8).int()).abs()
        assert steps.max() <= 1 and steps.float().mean() < 0.05


def _paged_table(seq_lens: list[int], page_size: int, g) -> tuple[ReqToTokenPool, int]:
    """Rows 1..n: whole pages of page_size consecutive slots, the pages scattered; slot 0 the dummy. -> (table,
    number of slots)."""
    pages_per_row = ROW_WIDTH // page_size
    num_pages = len(seq_lens) * pages_per_row
    perm = torch.randperm(num_pages, generator=g) + 1  # page 0: the dummy page
    r2t = ReqToTokenPool(len(seq_lens) + 1, ROW_WIDTH, torch.device("cpu"))
    for r in range(1, len(seq_lens) + 1):
        pages = perm[(r - 1) * pages_per_row:r * pages_per_row]
        r2t.table[r] = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return r2t, (num_pages + 1) * page_size


def _twin_pools(num_slots: int, hkv: int, d: int, kv_dtype, g) -> tuple[KVPool, KVPool]:
    """Two FP8 pools with the same random contents (quantized Gaussian rows of varied magnitudes)."""
    a, b = (KVPool(1, num_slots, hkv, d, kv_dtype, torch.device("cpu")) for _ in range(2))
    for cache, scale in ((a.k[0], a.k_scale[0]), (a.v[0], a.v_scale[0])):
        stored, s = quantize_kv(_rand_rows((num_slots, hkv, d), g), kv_dtype)
        cache.copy_(stored)
        scale.copy_(s)
    for name in ("k", "v", "k_scale", "v_scale"):
        getattr(b, name)[0].copy_(getattr(a, name)[0])
    return a, b


def _check_outputs(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    """float32: the same dequantized operands, only the summation order differs. bfloat16: the torch oracle's bf16
    SDPA rounds its own intermediates, so the bound of the bf16-cache tests (tests/test_triton_attention.py); the
    FP8 read itself is checked bit for bit against a bf16 cache of the dequantized rows (_dequantized_run)."""
    assert torch.isfinite(got).all()
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, want, **tol)


def _dequantized_run(r2t, fp8_pool: KVPool, qkv, dtype, fb, layer, **backend_kw) -> torch.Tensor:
    """The Triton backend over a `dtype` cache holding fp8_pool's rows dequantized, the new k, v quantized and
    dequantized first (what the FP8 store keeps of them): reading the FP8 cache must give exactly this output."""
    pool = KVPool(1, fp8_pool.num_slots, fp8_pool.num_kv_heads, fp8_pool.head_dim, dtype, torch.device("cpu"))
    pool.k[0].copy_(dequantize_kv(fp8_pool.k[0], fp8_pool.k_scale[0], dtype))
    pool.v[0].copy_(dequantize_kv(fp8_pool.v[0], fp8_pool.v_scale[0], dtype))
    q, k, v = (x.clone() for x in qkv)
    k, v = (dequantize_kv(*quantize_kv(x, fp8_pool.dtype), dtype) for x in (k, v))
    be = TritonAttentionBackend(r2t, pool, **backend_kw)
    be.init_forward_metadata(fb)
    return be.forward(q, k, v, layer, fb)


def _check_pools(a: KVPool, b: KVPool) -> None:
    for name in ("k", "v", "k_scale", "v_scale"):
        assert _same(getattr(a, name)[0], getattr(b, name)[0]), name


FIXED_CASES = [  # (width, kv dtype, q dtype, prep: None | "kernel" | "in_attention", page size, several splits)
    (1, E4M3, torch.float32, None, 1, True),
    (1, E4M3, torch.float32, None, 4, False),
    (1, E5M2, torch.bfloat16, None, 4, True),
    (4, E4M3, torch.float32, None, 1, True),
    (4, E5M2, torch.float32, "kernel", 4, True),
    (1, E4M3, torch.float32, "in_attention", 1, True),
    (4, E4M3, torch.float32, "in_attention", 4, True),
    (4, E5M2, torch.float32, "in_attention", 1, False),
]


@INTERPRETER_ONLY
@pytest.mark.parametrize("width,kv_dtype,dtype,prep_kind,page_size,split", FIXED_CASES)
def test_fixed_width_equals_torch_backend(width, kv_dtype, dtype, prep_kind, page_size, split):
    """DECODE (width 1) / TARGET_VERIFY (width 4): the new K/V stored by store_kv, the prep kernel or the attention
    kernel itself (AttnPrep), keys read from the FP8 pool; the pools after the step are bit-equal."""
    g = torch.Generator().manual_seed(width * 100 + page_size * 10 + split)
    hq, hkv, d = 4, 2, 32
    seq_lens = [37, 9, 50]
    r2t, num_slots = _paged_table(seq_lens, page_size, g)
    ref_pool, tri_pool = _twin_pools(num_slots, hkv, d, kv_dtype, g)
    rows, lens = torch.tensor([1, 2, 3, 0]), torch.tensor(seq_lens + [width])  # last row padded
    t = rows.shape[0] * width
    positions = (lens[:, None] - width + torch.arange(width)[None, :]).reshape(-1)
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    fb = ForwardBatch(mode=mode, batch_size=rows.shape[0], input_ids=torch.zeros(t, dtype=torch.int64),
                      positions=positions, out_cache_loc=fixed_width_out_cache_loc(r2t.table, rows, lens, width),
                      req_pool_indices=rows, seq_lens=lens, max_seq_len=max(seq_lens), width=width)
    prep = make_qk_prep(d, d, False, False, positions, g, ROW_WIDTH) if prep_kind else None
    layer = PagedAttention(hq, hkv, d, d ** -0.5, cache_index=0)
    qkv = [_rand_rows((t, h, d), g, dtype) for h in (hq, hkv, hkv)]

    splits = dict(num_sms=16, min_split_keys=8, block_n=8) if split else dict(num_sms=1)
    exact = None if prep else _dequantized_run(r2t, tri_pool, qkv, dtype, fb, layer, **splits)
    ref_be = TorchAttentionBackend(r2t, ref_pool)
    ref_be.init_forward_metadata(fb)
    want = ref_be.forward(*(x.clone() for x in qkv), layer, fb, prep)
    tri = TritonAttentionBackend(r2t, tri_pool, prep_in_attention=prep_kind == "in_attention", **splits)
    tri.init_forward_metadata(fb)
    assert (tri.meta.num_splits > 1) == split
    got = tri.forward(*(x.clone() for x in qkv), layer, fb, prep)
    live = slice(0, 3 * width)  # the padded row's output is only finite
    _check_outputs(got[live], want[live], dtype)
    assert torch.isfinite(got).all()
    if exact is not None:
        assert torch.equal(got, exact)
    # the dummy slot 0 is written by the padded row in both; compare every other slot
    ref_pool.k[0][0], ref_pool.v[0][0], ref_pool.k_scale[0][0], ref_pool.v_scale[0][0] = (
        tri_pool.k[0][0], tri_pool.v[0][0], tri_pool.k_scale[0][0], tri_pool.v_scale[0][0])
    _check_pools(ref_pool, tri_pool)


@INTERPRETER_ONLY
@pytest.mark.parametrize("kv_dtype,dtype,page_size,with_prep", [
    (E4M3, torch.float32, 1, False), (E5M2, torch.float32, 4, True), (E4M3, torch.bfloat16, 4, False)])
def test_varlen_equals_torch_backend(kv_dtype, dtype, page_size, with_prep):
    """EXTEND over a paged FP8 prefix (chunked prefill) and without one; the new tokens' K/V stored first."""
    g = torch.Generator().manual_seed(page_size + with_prep)
    hq, hkv, d = 6, 2, 32
    rows, seq_lens, ext = [2, 1, 3], [37, 17, 40], [5, 17, 1]  # prefixes 32, 0, 39
    r2t, num_slots = _paged_table([17, 37, 40], page_size, g)
    ref_pool, tri_pool = _twin_pools(num_slots, hkv, d, kv_dtype, g)
    loc = torch.cat([r2t.table[r, s - e:s] for r, s, e in zip(rows, seq_lens, ext, strict=True)])
    positions = torch.cat([torch.arange(s - e, s) for s, e in zip(seq_lens, ext, strict=True)])
    t = sum(ext)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=torch.zeros(t, dtype=torch.int64),
                      positions=positions, out_cache_loc=loc, req_pool_indices=torch.tensor(rows),
                      seq_lens=torch.tensor(seq_lens), max_seq_len=max(seq_lens), extend_lens_cpu=ext,
                      seq_lens_cpu=seq_lens)
    prep = make_qk_prep(d, d, False, False, positions, g, ROW_WIDTH) if with_prep else None
    layer = PagedAttention(hq, hkv, d, d ** -0.5, cache_index=0)
    qkv = [_rand_rows((t, h, d), g, dtype) for h in (hq, hkv, hkv)]
    blocks = dict(block_m=16, block_n=16)
    exact = None if prep else _dequantized_run(r2t, tri_pool, qkv, dtype, fb, layer, **blocks)
    outs = []
    for be in (TorchAttentionBackend(r2t, ref_pool), TritonAttentionBackend(r2t, tri_pool, **blocks)):
        be.init_forward_metadata(fb)
        outs.append(be.forward(*(x.clone() for x in qkv), layer, fb, prep))
    _check_outputs(outs[1], outs[0], dtype)
    if exact is not None:
        assert torch.equal(outs[1], exact)
    _check_pools(ref_pool, tri_pool)


# ------------------------------------------------------------------------------------------------ 3. FP8 vs float

@INTERPRETER_ONLY
@pytest.mark.parametrize("kv_dtype,rms_bound,abs_bound", [(E4M3, 0.06, 0.05), (E5M2, 0.12, 0.09)])
def test_fp8_attention_error_against_float32_cache(kv_dtype, rms_bound, abs_bound):
    """The same Gaussian K/V (unit variance) and q attended through a float32 cache and an FP8 cache (torch
    backend, decode over 200 keys, GQA 2). Measured over 10 seeds (this data, scaled dot products): relative RMS
    error of the outputs at most 0.038 (e4m3) / 0.074 (e5m2), largest element error 0.027 / 0.046 (in units of V's
    standard deviation). That is the format's rounding: a uniform relative error of up to 2^-4 (e4m3) / 2^-3 (e5m2)
    per element has an RMS of 2^-4 / sqrt(3) = 0.036 (0.072), which the softmax-weighted average keeps relative to
    its (equally averaged) output. Bounds: about 1.6x (RMS) and 1.8x (largest) the worst measurement."""
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, s = 8, 4, 64, 4, 200
    r2t = ReqToTokenPool(bs + 1, 256, torch.device("cpu"))
    for r in range(1, bs + 1):
        r2t.table[r, :s] = torch.arange(s) + 1 + (r - 1) * s
    num_slots = bs * s + 1
    k, v = torch.randn(num_slots, hkv, d, generator=g), torch.randn(num_slots, hkv, d, generator=g)
    q = torch.randn(bs, hq, d, generator=g)
    rows, lens = torch.arange(1, bs + 1), torch.full((bs,), s)
    fb = ForwardBatch(mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64),
                      positions=lens - 1, out_cache_loc=fixed_width_out_cache_loc(r2t.table, rows, lens, 1),
                      req_pool_indices=rows, seq_lens=lens, max_seq_len=s, width=1)
    layer = PagedAttention(hq, hkv, d, d ** -0.5, cache_index=0)
    outs = []
    for cache_dtype in (torch.float32, kv_dtype):
        pool = KVPool(1, num_slots, hkv, d, cache_dtype, torch.device("cpu"))
        ref.store_kv(pool.k[0], pool.v[0], torch.arange(num_slots), k, v,
                     *((pool.k_scale[0], pool.v_scale[0]) if pool.is_fp8 else ()))
        be = TorchAttentionBackend(r2t, pool)
        be.init_forward_metadata(fb)
        new = fb.out_cache_loc
        outs.append(be.forward(q.clone(), k[new], v[new], layer, fb))
    err = outs[1] - outs[0]  # [bs, Hq, D]
    rms = (err.pow(2).mean().sqrt() / outs[0].pow(2).mean().sqrt()).item()
    assert rms < rms_bound and err.abs().max().item() < abs_bound, (rms, err.abs().max().item())


def test_bytes_per_token_counts_the_scales():
    spec = MHACacheSpec(8, 128)
    assert spec.bytes_per_token(torch.bfloat16) == 2 * 8 * 128 * 2
    assert spec.bytes_per_token(E4M3) == spec.bytes_per_token(E5M2) == 2 * 8 * (128 + 4)
    pool = KVPool(2, 10, 8, 128, E4M3, torch.device("cpu"))
    assert pool.k_scale[1].shape == (10, 8) and pool.k_scale[1].dtype == torch.float32
    assert KVPool(1, 10, 8, 128, torch.bfloat16, torch.device("cpu")).k_scale is None


# ------------------------------------------------------------------------------------------------ 4. the engine

def _greedy(path: str, **kw) -> tuple[list[list[int]], object]:
    from specserve.engine.engine import Engine

    eng = Engine(model_path=path, dtype="float32", max_total_tokens=2048, **kw)
    prompts = [[1, 5, 9, 14, 3, 22, 7], [2, 40, 41, 8, 8, 31]]
    out = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True})
    return [o["output_ids"] for o in out], eng


def _mtp_equals_plain(path: str) -> None:
    plain, eng = _greedy(path, kv_cache_dtype="fp8_e4m3")
    assert eng.core.model_runner.caches.kv.is_fp8
    spec, eng = _greedy(path, kv_cache_dtype="fp8_e4m3", speculative_algorithm="MTP", speculative_num_steps=2)
    assert eng.core.model_runner.spec.caches.kv.is_fp8  # the draft's own pool too
    assert spec == plain


def test_engine_llama_mtp_greedy_equals_plain_with_fp8_cache(tmp_path):
    _mtp_equals_plain(build_tiny_model(str(tmp_path / "llama"), "llama", seed=31, mtp_layout="deepseek",
                                       logit_scale=3.0))


def test_engine_qwen3_next_mtp_greedy_equals_plain_with_fp8_cache(tmp_path):
    from hybrid_helpers import build_tiny_hybrid

    _mtp_equals_plain(build_tiny_hybrid(str(tmp_path / "qwen3_next"), "qwen3_next", mtp=True, logit_scale=3.0))


def test_engine_fp8_pool_holds_about_twice_the_tokens(tmp_path):
    """Same memory budget: the FP8 pool's slots against a bfloat16 cache's (and a float32 one's, the model's
    dtype here), with bytes per token as the pool sizing counts them, scales included."""
    from specserve.engine.model_runner import kv_cache_torch_dtype
    from specserve.kvcache.cache_spec import bytes_per_token

    path = build_tiny_model(str(tmp_path / "llama"), "llama", seed=32)
    _, eng = _greedy(path, kv_cache_dtype="fp8_e4m3")
    mr = eng.core.model_runner
    specs = mr.caches.specs
    per_tok = {n: bytes_per_token(specs, kv_cache_torch_dtype(n, torch.float32)) for n in
               ("fp8_e4m3", "bfloat16", "float32")}
    head_dim = mr.caches.kv.head_dim
    assert per_tok["bfloat16"] / per_tok["fp8_e4m3"] == pytest.approx(2 * head_dim / (head_dim + 4))
    assert per_tok["float32"] / per_tok["fp8_e4m3"] == pytest.approx(4 * head_dim / (head_dim + 4))
    pool = mr.caches.kv
    held = sum(t.numel() * t.element_size() for t in pool.k + pool.v + pool.k_scale + pool.v_scale)
    assert held == pool.num_slots * per_tok["fp8_e4m3"]  # the accounting is what the pool allocates


def test_engine_builds_fp8_latents_for_mla(tmp_path):
    """An MLA model (DeepSeek-V3) is no longer refused: its latents are fp8 with group scales (the MLA cache's
    own tests: tests/test_fp8_mla_cache.py)."""
    from deepseek_helpers import build_tiny_deepseek

    from specserve.batch import CacheKind
    from specserve.engine.engine import Engine

    path = build_tiny_deepseek(str(tmp_path / "dsv3"))
    eng = Engine(model_path=path, dtype="float32", max_total_tokens=2048, kv_cache_dtype="fp8_e4m3")
    pool = eng.core.model_runner.caches.pools[CacheKind.MLA]
    assert pool.rows[0].dtype == E4M3 and pool.scales[0].shape == (pool.num_slots, 2)  # 32 latent + 8 rope
