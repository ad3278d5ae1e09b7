"""The FP8 MLA latent cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2 for DeepSeek-V3 / V3.2 / GLM-5: LatentPool rows in
fp8 with a float32 scale per 128 latent values and one for the rope part; kernels/reference_latent_fp8.py).

1. The rule: each value within the format's rounding of its group's max; the groups' layout (a rope part 1000x
   smaller than the latent keeps its relative precision); a zero row reads as zeros; the pool's and the spec's
   layout and bytes (576-wide rows: 5 scales, 596 bytes a token).
2. The absorbed-MLA kernel (kernels/triton_mla.py) over an fp8 cache, under the interpreter on CPU: decode (width
   1), verify (width 4), a draft extend (width 3), token rows (prefill graphs) and a sparse selection's slot lists
   (DSA), with and without key splits: bit-equal in float32 to the same kernel over the dequantised rows, within
   the bf16-cache tests' bound of the float32 reference over those rows for bf16 queries; against attention over
   the unquantised (bf16) rows within a measured bound.
3. --mla-prefill mha (attention/mla_prefill.py) over fp8 rows == over the dequantised rows bit for bit, within the
   kernel test's bound of the bf16 rows; in the engine == the absorbed prefill over the same cache.
4. The engine: greedy MTP == greedy plain with fp8 latents (DeepSeek-V3; DeepSeek-V3.2 with a sparse top-k, the
   draft's own pool fp8 too); Triton backends == the torch reference on the same fp8 cache (V3.2); the pool holds
   about 1152 / 596 = 1.93x the tokens of a bf16 cache in the same budget.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from deepseek_helpers import build_tiny_deepseek, build_tiny_dsa  # noqa: E402
from spec_fixtures import build_scheduler, run_greedy  # noqa: E402
from test_deepseek_dsa import _with_mtp  # noqa: E402
from test_spec_greedy import _prompts  # noqa: E402
from test_triton_mla import reference  # noqa: E402

from specserve.attention.mla_prefill import mha_prefill_attention  # noqa: E402
from specserve.attention.torch_backend import _ExtendMeta  # noqa: E402
from specserve.batch import CacheKind  # noqa: E402
from specserve.kernels.reference_latent_fp8 import (  # noqa: E402
    dequantize_latent,
    quantize_latent,
    read_latent,
    scale_columns,
    store_latent,
)
from specserve.kernels.triton_mla import mla_decode_triton  # noqa: E402
from specserve.kvcache.cache_spec import LatentCacheSpec, bytes_per_token  # noqa: E402
from specserve.kvcache.kv_pool import LatentPool  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
# The kernel comparisons build CPU tensors for Triton's interpreter; on a GPU: tests/test_gpu_mla.py
# test_fp8_latents_triton_gpu.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors under Triton's interpreter")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MANTISSA = {E4M3: 3, E5M2: 2}
CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------------ 1. the rule

@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("c,r", [(256, 64), (160, 16), (32, 8)])
def test_round_trip_within_the_group_rounding(dtype, c, r):
    """Every value comes back within half an ulp of the format at its group's max: |err| <= 2^-(m+1) amax_group
    (e4m3: 2^-4). Rows of magnitudes 1e-5 .. 1e3, and a zero row."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, c + r, generator=g) * torch.logspace(-5, 3, 12)[:, None]
    x[3] = 0.0
    stored, scales = quantize_latent(x, r, dtype)
    groups = -(-c // 128) + 1
    assert stored.dtype == dtype and scales.shape == (12, groups) and scales.dtype == torch.float32
    back = dequantize_latent(stored, scales, r, torch.float32)
    cols = scale_columns(c + r, r, CPU)  # [C + R] each value's group
    amax = torch.zeros(12, groups).scatter_reduce(1, cols.expand(12, -1), x.abs(), "amax")  # [12, G]
    bound = 2.0 ** -(MANTISSA[dtype] + 1) * amax[:, cols]
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[3], torch.zeros(c + r))


def test_rope_part_keeps_its_precision():
    """A rope part 1000x smaller than its latent keeps e4m3's relative precision (2^-4 of its own max) and the
    format's whole range (its largest value stored as 448); 1e5x smaller, where one scale for the whole row would
    push it into e4m3's subnormals, its own scale keeps it 4x more precise than the row scale would."""
    g = torch.Generator().manual_seed(2)
    c, r = 256, 64
    for smaller in (1e3, 1e5):
        x = torch.randn(8, c + r, generator=g)
        x[:, c:] /= smaller
        stored, scales = quantize_latent(x, r, E4M3)
        back = dequantize_latent(stored, scales, r, torch.float32)
        rope, rope_max = x[:, c:], x[:, c:].abs().amax(dim=1, keepdim=True)
        rel = ((back[:, c:] - rope).abs() / rope_max).max().item()
        assert rel <= 2.0 ** -4
        assert torch.equal(stored[:, c:].float().abs().amax(dim=1), torch.full((8,), 448.0))
        assert (scales[:, -1] < 3.0 / smaller * scales[:, :-1].min(dim=1).values).all()  # its own, small scale
    one_scale = x.abs().amax(dim=1, keepdim=True) / 448.0  # what a row scale would do to the rope part
    rope_one = (rope / one_scale).to(E4M3).float() * one_scale
    assert ((rope_one - rope).abs() / rope_max).max().item() > 4 * rel


def test_store_and_read_through_slots():
    """store_latent writes the quantised rows and their scales at the slots; read_latent gives them back
    dequantised in the asked dtype; with no scales (a 16-bit cache) both are a cast."""
    g = torch.Generator().manual_seed(3)
    rows = torch.zeros(10, 40, dtype=E4M3)
    scales = torch.ones(10, 2)
    x = torch.randn(3, 40, generator=g)
    loc = torch.tensor([7, 2, 5])
    store_latent(rows, scales, loc, x, 8)
    want_rows, want_scales = quantize_latent(x, 8, E4M3)
    assert torch.equal(rows[loc].view(torch.uint8), want_rows.view(torch.uint8))
    assert torch.equal(scales[loc], want_scales) and torch.equal(scales[0], torch.ones(2))
    got = read_latent(rows, scales, torch.tensor([5, 0]), 8, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got[1], torch.zeros(40, dtype=torch.bfloat16))
    assert torch.equal(got[0], dequantize_latent(want_rows[2], want_scales[2], 8, torch.bfloat16))
    plain = torch.zeros(10, 40, dtype=torch.bfloat16)
    store_latent(plain, None, loc, x, 8)
    assert torch.equal(read_latent(plain, None, loc, 8, torch.float32), x.to(torch.bfloat16).float())



@INTERPRETER_ONLY
@pytest.mark.parametrize("rows_dtype", [E4M3, E5M2, torch.bfloat16])
@pytest.mark.parametrize("c,r", [(512, 64), (160, 16), (32, 0)])
def test_triton_store_equals_reference(rows_dtype, c, r):
    """The Triton store (kernels/triton_latent_store.py, the Triton MLA backend's) writes the reference store's rows
    and scales bit for bit, at the slots only: full latent groups (512 + 64), a short last group (160 = 128 + 32)
    and no rope part; values spanning 10 binades, so both formats' subnormals and every group's max are met; a
    16-bit cache is a cast."""
    from specserve.kernels.triton_latent_store import store_latent_triton

    g = torch.Generator().manual_seed(c + r)
    x = (torch.randn(5, c + r, generator=g) * torch.exp2(torch.randint(-6, 4, (5, c + r), generator=g))).bfloat16()
    loc = torch.tensor([9, 1, 4, 0, 6])
    fp8 = rows_dtype in (E4M3, E5M2)
    groups = -(-c // 128) + (1 if r else 0)
    got, want = (torch.zeros(12, c + r, dtype=rows_dtype) for _ in range(2))
    got_s, want_s = ((torch.full((12, groups), 7.0) if fp8 else None) for _ in range(2))
    store_latent_triton(got, got_s, loc, x, r)
    store_latent(want, want_s, loc, x, r)
    assert torch.equal(got.view(torch.uint8) if fp8 else got, want.view(torch.uint8) if fp8 else want)
    if fp8:
        assert torch.equal(got_s, want_s) and torch.equal(got_s[2], torch.full((groups,), 7.0))  # slot 2: untouched

def test_pool_layout_and_bytes_per_token():
    mla, index = LatentCacheSpec(576, CacheKind.MLA, 64), LatentCacheSpec(128, CacheKind.INDEX_KEYS)
    assert mla.scale_groups == 5 and index.scale_groups == 1
    assert mla.bytes_per_token(torch.bfloat16) == 1152 and mla.bytes_per_token(E4M3) == 576 + 5 * 4
    assert index.bytes_per_token(E4M3) == 128 + 4  # the indexer keys' layout is unchanged
    assert mla.bytes_per_token(torch.bfloat16) / mla.bytes_per_token(E4M3) == pytest.approx(1.933, abs=1e-3)
    pool = LatentPool([mla, mla], 6, E5M2, CPU)
    assert [s.shape for s in pool.scales] == [(6, 5)] * 2 and torch.equal(pool.scales[0], torch.ones(6, 5))
    assert LatentPool([index], 6, E4M3, CPU).scales[0].shape == (6,)
    assert LatentPool([mla], 6, torch.bfloat16, CPU).scales is None
    with pytest.raises(ValueError, match="rope_dim"):
        LatentCacheSpec(128, CacheKind.INDEX_KEYS, 8)


# ------------------------------------------------------------------------------------------------ 2. the kernel

NUM_SLOTS = 200
MAX_KV = 40


def _fp8_batch(seq_lens, width, heads, c, r, kv_dtype, g):
    """-> (q float32 [bs * w, H, C + R], x float32 [S, C + R] the unquantised rows, stored, scales, kv_slots, lens)."""
    bs = len(seq_lens)
    q = torch.randn(bs * width, heads, c + r, generator=g)
    x = torch.randn(NUM_SLOTS, c + r, generator=g)
    x[:, c:] *= 4.0  # rope keys of another magnitude than the normed latent
    x[0] = 0.0  # padded requests read slot 0
    stored, scales = quantize_latent(x, r, kv_dtype)
    table = torch.zeros(bs, MAX_KV, dtype=torch.int64)
    for b, s in enumerate(seq_lens):
        if s > width:
            table[b, :s] = 1 + torch.randperm(NUM_SLOTS - 1, generator=g)[:s]
    return q, x, stored, scales, table, torch.tensor(seq_lens)


def _selection(seq_lens, width, g):
    sel = torch.rand(len(seq_lens), 1, width, MAX_KV, generator=g) < 0.4
    for b, s in enumerate(seq_lens):
        sel[b, 0, torch.arange(width), s - width + torch.arange(width)] = True
    return sel


# (width, seq_lens, selection, num_splits): decode, verify, a draft extend, with a DSA mask, key splits
KERNEL_CASES = [(1, [17, 1, 33], False, None), (4, [12, 4, 40], False, 1), (3, [9, 30], False, 3),
                (4, [12, 40], True, None)]


@INTERPRETER_ONLY
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("width,seq_lens,sparse,num_splits", KERNEL_CASES)
def test_kernel_over_fp8_rows_equals_dequantised_rows(kv_dtype, width, seq_lens, sparse, num_splits):
    """float32 q: the fp8 kernel == the same kernel over the dequantised float32 rows, bit for bit (the key tile's
    dequantisation is the reference's), and the float32 reference within float32 rounding; bf16 q: the
    reference over the rows dequantised to bf16 within the bf16-cache tests' bound."""
    g = torch.Generator().manual_seed(10 + width)
    c, r, heads = 160, 16, 4  # two latent groups (the second partial) and the rope group
    q, _, stored, scales, table, lens = _fp8_batch(seq_lens, width, heads, c, r, kv_dtype, g)
    sel = _selection(seq_lens, width, g) if sparse else None
    kw = dict(num_splits=num_splits)
    got = mla_decode_triton(q, stored, table, lens, width, 0.125, c, sel, scales=scales, **kw)
    deq = dequantize_latent(stored, scales, r, torch.float32)
    assert torch.equal(got, mla_decode_triton(q, deq, table, lens, width, 0.125, c, sel, **kw))
    torch.testing.assert_close(got, reference(q, deq, table, lens, width, 0.125, c, sel), atol=1e-5, rtol=1e-4)
    qb = q.to(torch.bfloat16)
    got_b = mla_decode_triton(qb, stored, table, lens, width, 0.125, c, sel, scales=scales, **kw)
    want_b = reference(qb, dequantize_latent(stored, scales, r, torch.bfloat16), table, lens, width, 0.125, c, sel)
    tol = 4e-2 * want_b.float().abs().max().item()  # test_triton_mla.py's bf16 bound on CPU
    torch.testing.assert_close(got_b.float(), want_b.float(), atol=tol, rtol=0)


@INTERPRETER_ONLY
def test_kernel_token_rows_and_slot_lists():
    """The other two ways the backend reads rows: token rows over the page table (prefill graphs: kv_rows) and a
    DSA selection's per-query slot lists (width 1, each query its own count) - both bit-equal in float32 to the
    dequantised rows."""
    g = torch.Generator().manual_seed(20)
    c, r = 32, 8  # the tiny DeepSeek checkpoints' latent: one latent group and the rope group
    q, _, stored, scales, table, _ = _fp8_batch([30, 12], 1, 4, c, r, E4M3, g)
    deq = dequantize_latent(stored, scales, r, torch.float32)
    rows_of, lens = torch.tensor([1, 0, 1, 0, 0]), torch.tensor([5, 30, 12, 1, 17])  # 5 tokens over 2 table rows
    qt = torch.randn(5, 4, c + r, generator=g)
    a = mla_decode_triton(qt, stored, table, lens, 1, 0.2, c, scales=scales, kv_rows=rows_of)
    assert torch.equal(a, mla_decode_triton(qt, deq, table, lens, 1, 0.2, c, kv_rows=rows_of))
    slots = torch.randint(1, NUM_SLOTS, (5, 6), generator=g)  # the chosen rows of each query
    counts = torch.tensor([6, 1, 3, 6, 2])
    a = mla_decode_triton(qt, stored, slots, counts, 1, 0.2, c, scales=scales)
    assert torch.equal(a, mla_decode_triton(qt, deq, slots, counts, 1, 0.2, c))


@INTERPRETER_ONLY
@pytest.mark.parametrize("kv_dtype,rms_bound", [(E4M3, 0.06), (E5M2, 0.12)])
def test_kernel_fp8_against_bf16_cache(kv_dtype, rms_bound):
    """The fp8 cache against a bf16 cache of the same rows (verify, width 4): the relative RMS error of the
    outputs stays under the bound of the MHA cache's test (measured 0.041 for e4m3)."""
    g = torch.Generator().manual_seed(30)
    c, r = 160, 16
    q, x, stored, scales, table, lens = _fp8_batch([12, 30, 40], 4, 4, c, r, kv_dtype, g)
    qb = q.to(torch.bfloat16)
    got = mla_decode_triton(qb, stored, table, lens, 4, 0.125, c, scales=scales).float()
    want = mla_decode_triton(qb, x.to(torch.bfloat16), table, lens, 4, 0.125, c).float()
    rms = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert rms < rms_bound, rms


# ------------------------------------------------------------------------------------------------ 3. mha prefill

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_mla")
    return {"v3": build_tiny_deepseek(str(root / "v3"), seed=81, mtp=True),
            "v32": _with_mtp(build_tiny_dsa(str(root / "v32"), "deepseek_v32", seed=82, index_topk=5), 83)}


def _pieces(prefix_lens, new_lens, num_slots, g) -> _ExtendMeta:
    """Request pieces of an eager prefill: each request's slots (its cached prefix, then its new tokens) and the
    causal mask of its new tokens."""
    pieces, q0 = [], 0
    for p, e in zip(prefix_lens, new_lens):
        slots = torch.randperm(num_slots, generator=g)[:p + e]
        mask = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]  # [e, p + e]
        pieces.append((q0, e, slots, mask))
        q0 += e
    return _ExtendMeta(pieces)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_mha_prefill_function_over_fp8_rows(kv_dtype):
    """mha_prefill_attention over fp8 rows and their scales == over the dequantised rows, bit for bit (float32
    and bf16 queries, heads in groups); against the unquantised rows in bf16 within a relative RMS of 0.06 (e4m3)
    / 0.12 (e5m2), the kernel test's bounds."""
    g = torch.Generator().manual_seed(40)
    c, r, heads, nope, v = 160, 16, 4, 16, 16
    x = torch.randn(64, c + r, generator=g)
    stored, scales = quantize_latent(x, r, kv_dtype)
    meta = _pieces([0, 7, 20], [9, 5, 12], 64, g)
    w_kv = torch.randn(heads, nope + v, c, generator=g) / c ** 0.5
    for dtype in (torch.float32, torch.bfloat16):
        q_nope = torch.randn(26, heads, nope, generator=g).to(dtype)
        q_rope = torch.randn(26, heads, r, generator=g).to(dtype)
        w = w_kv.to(dtype)
        got = mha_prefill_attention(q_nope, q_rope, stored, w, meta, 0.15, max_kv=5000, scales=scales)
        deq = dequantize_latent(stored, scales, r, dtype)
        assert torch.equal(got, mha_prefill_attention(q_nope, q_rope, deq, w, meta, 0.15, max_kv=5000))
    want = mha_prefill_attention(q_nope, q_rope, x.to(torch.bfloat16), w, meta, 0.15).float()
    rms = ((got.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert rms < {E4M3: 0.06, E5M2: 0.12}[kv_dtype], rms


def test_mha_prefill_over_fp8_latents(models):
    """--mla-prefill mha in the engine decompresses the dequantised rows: the absorbed prefill's logits over the
    same fp8 cache within float32 rounding. (Against a 16-bit cache the tiny random MoE's expert choice flips
    on fp8 rounding, so its logits are compared nowhere: the function test above bounds the attention.)"""
    from test_mla_prefill import _prefill_logits, _prompt_ids

    prompts = _prompt_ids()
    mha, mla = _prefill_logits(models["v3"], prompts, "mha", kv_cache_dtype="fp8_e4m3")
    assert mla.prefill_mha and mla.kv_pool.scales is not None and mla.kv_pool.rows[0].dtype == E4M3
    absorbed, _ = _prefill_logits(models["v3"], prompts, "absorbed", kv_cache_dtype="fp8_e4m3")
    for m, a in zip(mha, absorbed):
        torch.testing.assert_close(m, a, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ 4. the engine

def _greedy(path, **kw):
    sched, _ = build_scheduler(path, max_total_tokens=4096, kv_cache_dtype="fp8_e4m3", **kw)
    out = [r.output_ids for r in run_greedy(sched, _prompts()[:3], 8)]
    sched.check_idle_invariants()
    return out, sched


@pytest.mark.parametrize("key", ["v3", "v32"])
def test_mtp_greedy_equals_plain_with_fp8_latents(models, key):
    plain, sched = _greedy(models[key])
    pool = sched.model_runner.caches.pools[CacheKind.MLA]
    assert pool.rows[0].dtype == E4M3 and pool.scales[0].shape == (pool.num_slots, 2)
    if key == "v32":  # the indexer keys keep their own dtype (--indexer-cache-dtype auto: the model's)
        assert sched.model_runner.caches.pools[CacheKind.INDEX_KEYS].scales is None
    spec, sched = _greedy(models[key], speculative_algorithm="MTP", speculative_num_steps=2)
    assert sched.model_runner.spec.caches.pools[CacheKind.MLA].scales is not None  # the draft's own pool
    assert spec == plain


@INTERPRETER_ONLY
def test_triton_backends_equal_the_reference_on_fp8_latents(models):
    """--attention-backend triton over fp8 latents (the MLA kernel dequantising in its key tile, the sparse rows
    of the DSA selection, prefill graphs) against the torch reference reading the same cache: the same greedy MTP
    tokens (fp8 index keys too)."""
    from specserve.attention.torch_mla_backend import TritonMLABackend

    outs = []
    for backend in ("torch", "triton"):
        sched, _ = build_scheduler(models["v32"], max_total_tokens=4096, kv_cache_dtype="fp8_e4m3",
                                   indexer_cache_dtype="fp8_e4m3", attention_backend=backend,
                                   speculative_algorithm="MTP", speculative_num_steps=2)
        mla = sched.model_runner.spec.phases.target_verify.backends[CacheKind.MLA]
        assert isinstance(mla, TritonMLABackend) == (backend == "triton") and mla.kv_pool.scales is not None
        outs.append([r.output_ids for r in run_greedy(sched, _prompts()[:3], 4)])
        sched.check_idle_invariants()
    assert outs[0] == outs[1]


def test_pool_holds_about_1_93x_the_tokens(models):
    """The same budget: bytes per token as the sizing counts them (scales included) against a bf16 cache's, and
    what the fp8 pool allocates."""
    from specserve.engine.model_runner import token_kind_dtypes

    _, sched = _greedy(models["v3"])
    mr = sched.model_runner
    specs = mr.caches.specs
    kinds = token_kind_dtypes("auto", E4M3, torch.float32)
    fp8, bf16 = bytes_per_token(specs, E4M3, kinds), bytes_per_token(specs, torch.bfloat16)
    width = specs[0].width  # 32 + 8: 2 scales a row
    assert bf16 / fp8 == pytest.approx(2 * width / (width + 8))
    assert LatentCacheSpec(576, CacheKind.MLA, 64).bytes_per_token(torch.bfloat16) / 596 == pytest.approx(1.933,
                                                                                                           abs=1e-3)
    pool = mr.caches.pools[CacheKind.MLA]
    held = sum(t.numel() * t.element_size() for t in pool.rows + pool.scales)
    assert held == pool.num_slots * fp8
