"""Triton attention backend against the torch reference backend (the oracle), on the engine's paged layout.

Cases: DECODE (split-KV with one and several splits), TARGET_VERIFY (width 4), DRAFT_EXTEND, a DRAFT_DECODE loop
that re-initialises the graph metadata as seq_lens advance, and EXTEND with a prefix (chunked prefill) - through
both init_forward_metadata and init_forward_metadata_graph, with GQA ratios 1/3/4, head_dim 64/128, float32 /
bfloat16 / float16, page tables of scattered slots, and padded rows per the padding contract (row 0, slot 0,
seq_len == width). Table entries past each request's length point at NaN-poisoned slots in the Triton pool (zero
in the oracle's pool), so any key read beyond a request's length turns the output NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from specserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from specserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from specserve.batch import ForwardBatch, ForwardMode, fixed_width_out_cache_loc  # noqa: E402
from specserve.kernels.triton_attention import fixed_width_attention, varlen_attention  # noqa: E402
from specserve.kvcache.kv_pool import KVPool  # noqa: E402
from specserve.kvcache.req_to_token import ReqToTokenPool  # noqa: E402
from specserve.layers.attention import PagedAttention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
# (Hq, Hkv, head_dim, dtype): GQA ratios 1, 3, 4; head_dim 64 and 128
CONFIGS = [(2, 2, 64, torch.float32), (6, 2, 128, torch.bfloat16), (8, 2, 64, torch.float16)]
ROW_WIDTH = 96  # page-table row width (max context)
LIVE_SLOTS = 400  # slots 1..LIVE_SLOTS hold real keys; slot 0 is the dummy
POISON_SLOTS = 40  # slots after the live ones: NaN in the Triton pool


@dataclass
class Setup:
    table: ReqToTokenPool
    ref_pool: KVPool
    tri_pool: KVPool
    layer: PagedAttention
    g: torch.Generator


def _setup(hq: int, hkv: int, head_dim: int, dtype: torch.dtype, seq_lens: list[int], seed: int) -> Setup:
    """Rows 1..len(seq_lens): positions below seq_len -> distinct scattered live slots; the rest -> poison slots."""
    g = torch.Generator().manual_seed(seed)
    r2t = ReqToTokenPool(len(seq_lens) + 1, ROW_WIDTH, DEV)
    live = torch.randperm(LIVE_SLOTS, generator=g) + 1
    used = 0
    for r, s in enumerate(seq_lens, start=1):
        r2t.table[r, :s] = live[used:used + s].to(DEV)
        r2t.table[r, s:] = (LIVE_SLOTS + 1 + torch.randint(0, POISON_SLOTS, (ROW_WIDTH - s,), generator=g)).to(DEV)
        used += s
    num_slots = LIVE_SLOTS + 1 + POISON_SLOTS
    ref_pool = KVPool(1, num_slots, hkv, head_dim, dtype, DEV)
    tri_pool = KVPool(1, num_slots, hkv, head_dim, dtype, DEV)
    for ref_c, tri_c in ((ref_pool.k[0], tri_pool.k[0]), (ref_pool.v[0], tri_pool.v[0])):
        ref_c.copy_(torch.randn(ref_c.shape, generator=g).to(dtype))
        ref_c[LIVE_SLOTS + 1:] = 0.0
        tri_c.copy_(ref_c)
        tri_c[LIVE_SLOTS + 1:] = float("nan")
    layer = PagedAttention(hq, hkv, head_dim, head_dim ** -0.5, cache_index=0)
    return Setup(r2t, ref_pool, tri_pool, layer, g)


def _qkv(su: Setup, num_tokens: int, dtype: torch.dtype):
    hq, hkv, d = su.layer.num_heads, su.layer.num_kv_heads, su.layer.head_dim
    mk = lambda h: (torch.randn((num_tokens, h, d), generator=su.g) * 0.5).to(dtype).to(DEV)
    return mk(hq), mk(hkv), mk(hkv)


def _fixed_batch(su: Setup, mode: ForwardMode, rows: list[int], seq_lens: list[int], width: int,
                 pool: KVPool) -> ForwardBatch:
    rows_t = torch.tensor(rows, dtype=torch.int64, device=DEV)
    seq_t = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    t = len(rows) * width
    return ForwardBatch(mode=mode, batch_size=len(rows), input_ids=torch.zeros(t, dtype=torch.int64, device=DEV),
                        positions=torch.zeros(t, dtype=torch.int64, device=DEV),
                        out_cache_loc=fixed_width_out_cache_loc(su.table.table, rows_t, seq_t, width),
                        req_pool_indices=rows_t, seq_lens=seq_t, max_seq_len=max(seq_lens), width=width)


def _run_fixed(su: Setup, mode: ForwardMode, rows: list[int], seq_lens: list[int], width: int, graph: bool,
               dtype: torch.dtype, **backend_kw) -> TritonAttentionBackend:
    """Oracle vs Triton on one fixed-width batch; padded rows (row 0) only need finite output."""
    q, k, v = _qkv(su, len(rows) * width, dtype)
    ref_be = TorchAttentionBackend(su.table, su.ref_pool)
    fb_ref = _fixed_batch(su, mode, rows, seq_lens, width, su.ref_pool)
    ref_be.init_forward_metadata(fb_ref)
    want = ref_be.forward(q, k, v, su.layer, fb_ref)

    tri = TritonAttentionBackend(su.table, su.tri_pool, **backend_kw)
    fb = _fixed_batch(su, mode, rows, seq_lens, width, su.tri_pool)
    if graph:
        tri.alloc_graph_buffers(len(rows) + 2, width, ROW_WIDTH)
        tri.init_forward_metadata_graph(fb)
        assert tri.meta.rows.data_ptr() == tri.graph_buffers["rows"].data_ptr()  # its own buffers
    else:
        tri.init_forward_metadata(fb)
    got = tri.forward(q, k, v, su.layer, fb)
    _compare(got, want, rows, width, dtype)
    return tri


def _compare(got, want, rows, width, dtype):
    live = torch.tensor([r != 0 for r in rows], device=DEV).repeat_interleave(width)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[live], want[live], **TOL[dtype])


@pytest.mark.parametrize("hq,hkv,head_dim,dtype", CONFIGS)
@pytest.mark.parametrize("graph", [False, True])
def test_decode(hq, hkv, head_dim, dtype, graph):
    seq_lens = [1, 37, 70, 90]
    su = _setup(hq, hkv, head_dim, dtype, seq_lens, seed=hq + head_dim)
    rows, lens = [3, 1, 4, 2, 0], [70, 1, 90, 37, 1]  # last row padded: row 0, seq_len == width
    # several splits: 16-key splits of 16-key blocks
    tri = _run_fixed(su, ForwardMode.DECODE, rows, lens, 1, graph, dtype, num_sms=8, min_split_keys=16, block_n=16)
    assert tri.meta.num_splits > 1
    # one split (written directly, no merge)
    tri = _run_fixed(su, ForwardMode.DECODE, rows, lens, 1, graph, dtype, num_sms=1)
    assert tri.meta.num_splits == 1


@pytest.mark.parametrize("hq,hkv,head_dim,dtype", CONFIGS)
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND])
def test_verify_and_draft_extend(hq, hkv, head_dim, dtype, graph, mode):
    seq_lens = [4, 23, 50]
    su = _setup(hq, hkv, head_dim, dtype, seq_lens, seed=7 * hq + head_dim)
    rows, lens = [2, 0, 1, 3, 0], [23, 4, 4, 50, 4]  # padded rows in the middle and at the end
    tri = _run_fixed(su, mode, rows, lens, 4, graph, dtype, num_sms=16, min_split_keys=16, block_n=16)
    assert tri.meta.num_splits > 1


def test_draft_decode_loop_reinitialises_graph_metadata():
    """The draft loop calls init_forward_metadata_graph once per step with seq_lens + i on one backend."""
    dtype = torch.float32
    seq_lens = [40, 9]
    su = _setup(4, 1, 64, dtype, seq_lens, seed=5)
    tri = TritonAttentionBackend(su.table, su.tri_pool, num_sms=4, min_split_keys=16, block_n=16)
    tri.alloc_graph_buffers(4, 1, ROW_WIDTH)
    ref_be = TorchAttentionBackend(su.table, su.ref_pool)
    rows, base = [1, 2, 0], [37, 6, 1]
    for step in range(3):
        lens = [s + step if r else 1 for r, s in zip(rows, base, strict=True)]
        q, k, v = _qkv(su, len(rows), dtype)
        fb_ref = _fixed_batch(su, ForwardMode.DRAFT_DECODE, rows, lens, 1, su.ref_pool)
        ref_be.init_forward_metadata(fb_ref)
        want = ref_be.forward(q, k, v, su.layer, fb_ref)
        fb = _fixed_batch(su, ForwardMode.DRAFT_DECODE, rows, lens, 1, su.tri_pool)
        tri.init_forward_metadata_graph(fb)
        _compare(tri.forward(q, k, v, su.layer, fb), want, rows, 1, dtype)


def test_graph_metadata_is_private_to_each_backend():
    """A second backend (another runner) filling its metadata must not change the first one's."""
    dtype = torch.float32
    su = _setup(2, 2, 64, dtype, [30, 12], seed=8)
    a = TritonAttentionBackend(su.table, su.tri_pool, num_sms=4, min_split_keys=16, block_n=16)
    b = TritonAttentionBackend(su.table, su.tri_pool, num_sms=4, min_split_keys=16, block_n=16)
    a.alloc_graph_buffers(2, 4, ROW_WIDTH)
    b.alloc_graph_buffers(2, 1, ROW_WIDTH)
    fa = _fixed_batch(su, ForwardMode.TARGET_VERIFY, [1, 2], [30, 12], 4, su.tri_pool)
    a.init_forward_metadata_graph(fa)
    b.init_forward_metadata_graph(_fixed_batch(su, ForwardMode.DRAFT_DECODE, [2, 1], [5, 7], 1, su.tri_pool))
    assert a.meta.rows.tolist() == [1, 2] and a.meta.seq_lens.tolist() == [30, 12]
    assert a.graph_buffers["rows"].data_ptr() != b.graph_buffers["rows"].data_ptr()


@pytest.mark.parametrize("hq,hkv,head_dim,dtype", CONFIGS)
@pytest.mark.parametrize("blocks", [(16, 16), (64, 64)])
def test_extend_with_prefix(hq, hkv, head_dim, dtype, blocks):
    """Variable-length prefill; requests with a prefix already in the cache (chunked prefill) and without."""
    su = _setup(hq, hkv, head_dim, dtype, [17, 37, 70, 5], seed=3 * hq + head_dim)  # KV length of rows 1..4
    rows = [2, 1, 3, 4]
    seq_lens = [37, 17, 70, 5]
    ext = [5, 17, 1, 5]  # prefixes 32, 0, 69, 0
    table = su.table.table
    loc = torch.cat([table[r, s - e:s] for r, s, e in zip(rows, seq_lens, ext, strict=True)])
    q, k, v = _qkv(su, sum(ext), dtype)

    def batch(pool):
        return ForwardBatch(mode=ForwardMode.EXTEND, batch_size=len(rows),
                            input_ids=torch.zeros(sum(ext), dtype=torch.int64, device=DEV),
                            positions=torch.zeros(sum(ext), dtype=torch.int64, device=DEV), out_cache_loc=loc,
                            req_pool_indices=torch.tensor(rows, device=DEV),
                            seq_lens=torch.tensor(seq_lens, device=DEV), max_seq_len=max(seq_lens),
                            extend_lens_cpu=ext, seq_lens_cpu=seq_lens)

    ref_be = TorchAttentionBackend(su.table, su.ref_pool)
    fb_ref = batch(su.ref_pool)
    ref_be.init_forward_metadata(fb_ref)
    want = ref_be.forward(q, k, v, su.layer, fb_ref)
    tri = TritonAttentionBackend(su.table, su.tri_pool, block_m=blocks[0], block_n=blocks[1])
    fb = batch(su.tri_pool)
    tri.init_forward_metadata(fb)
    got = tri.forward(q, k, v, su.layer, fb)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL[dtype])
    # the new keys were stored where the oracle stored them
    torch.testing.assert_close(su.tri_pool.k[0][loc], su.ref_pool.k[0][loc], atol=0, rtol=0)


def test_kernels_write_every_output_element():
    """Poisoned output buffers: every element of the launchers' outputs is written."""
    dtype = torch.float32
    su = _setup(4, 2, 64, dtype, [20, 33], seed=11)
    q, _, _ = _qkv(su, 2 * 3, dtype)
    rows = torch.tensor([1, 2], device=DEV)
    seq = torch.tensor([20, 33], device=DEV)
    k_cache, v_cache = su.tri_pool.k[0], su.tri_pool.v[0]
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        fixed_width_attention(q, k_cache, v_cache, su.table.table, rows, seq, 3, splits, 0.125, block_n=16, out=out)
        assert torch.isfinite(out).all()
    meta = torch.tensor([[0, 2], [2, 4]], device=DEV)  # q_starts, ext_lens
    q6 = q[:6]
    out = torch.full_like(q6, float("nan"))
    varlen_attention(q6, k_cache, v_cache, su.table.table, rows, seq, meta[0], meta[1], 4, 0.125, block_m=16,
                     block_n=16, out=out)
    assert torch.isfinite(out).all()


def test_in_kernel_merge_equals_the_merge_kernel():
    """Split-KV decode and verify: the last split's in-kernel merge == the separate merge kernel, call after call
    (the arrival counters are left at 0 by every launch)."""
    from specserve.kernels.triton_attention import _merge_counters

    dtype = torch.float32
    su = _setup(8, 2, 64, dtype, [20, 33, 70], seed=5)
    rows = torch.tensor([1, 2, 3], device=DEV)
    k_cache, v_cache = su.tri_pool.k[0], su.tri_pool.v[0]
    for width, seq_lens in ((1, [20, 33, 70]), (4, [20, 30, 70]), (1, [5, 33, 1])):  # <= live lengths
        q, _, _ = _qkv(su, 3 * width, dtype)
        seq = torch.tensor(seq_lens, device=DEV)
        for splits in (2, 5):
            want = fixed_width_attention(q, k_cache, v_cache, su.table.table, rows, seq, width, splits, 0.125,
                                         block_n=16, merge_in_kernel=False)
            got = fixed_width_attention(q, k_cache, v_cache, su.table.table, rows, seq, width, splits, 0.125,
                                        block_n=16)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            assert not _merge_counters(q.device).any()


def test_head_dim_not_power_of_two():
    """head_dim 80 (padded to a 128-wide tile and masked) through both kernels, with GQA ratio 3."""
    dtype = torch.float32
    su = _setup(3, 1, 80, dtype, [26, 9], seed=12)
    _run_fixed(su, ForwardMode.DECODE, [1, 2], [26, 9], 1, False, dtype, num_sms=8, min_split_keys=16, block_n=16)
    ext, seq_lens, rows = [4, 9], [26, 9], [1, 2]
    table = su.table.table
    loc = torch.cat([table[r, s - e:s] for r, s, e in zip(rows, seq_lens, ext, strict=True)])
    q, k, v = _qkv(su, sum(ext), dtype)
    fbs = [ForwardBatch(mode=ForwardMode.EXTEND, batch_size=2, input_ids=torch.zeros(13, dtype=torch.int64,
                                                                                      device=DEV),
                        positions=torch.zeros(13, dtype=torch.int64, device=DEV), out_cache_loc=loc,
                        req_pool_indices=torch.tensor(rows, device=DEV), seq_lens=torch.tensor(seq_lens, device=DEV),
                        max_seq_len=26, extend_lens_cpu=ext, seq_lens_cpu=seq_lens)
           for pool in (su.ref_pool, su.tri_pool)]
    ref_be = TorchAttentionBackend(su.table, su.ref_pool)
    ref_be.init_forward_metadata(fbs[0])
    want = ref_be.forward(q, k, v, su.layer, fbs[0])
    tri = TritonAttentionBackend(su.table, su.tri_pool, block_m=16, block_n=16)
    tri.init_forward_metadata(fbs[1])
    torch.testing.assert_close(tri.forward(q, k, v, su.layer, fbs[1]), want, **TOL[dtype])
