"""The absorbed-MLA decode kernel (kernels/triton_mla.py) against a plain torch reference (float32 softmax over the
masked scores): float32 and bfloat16, widths 1 and 4, up to 5 requests of different lengths including padded ones
(seq_lens == width, slots 0), H = 4 / 16 / 40 (40: three head blocks, the last one partial), C + R = 32 + 8 and
48 + 16 (neither a power of two), 70 keys (several key blocks), dense or with a random DSA selection (dense-ish,
and sparse enough to hide whole key blocks from a query). Keys past a request's length point at NaN-poisoned cache
rows, so reading one shows up; q, the cache and kv_slots are strided views, as slices of larger buffers. On a GPU,
the kernel captured in a CUDA graph and replayed with new lengths, slots and selections. On CPU the kernels run
under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels.triton_mla import default_block_h, mla_decode_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bfloat16 is compared against the output's scale: the kernel rounds the probabilities to bfloat16 before the value
# product (as the GPU does) while the reference keeps them in float32, and Triton's interpreter truncates
# float32 -> bfloat16 where the GPU rounds to nearest (triton 3.9): looser on CPU.
BF16_SCALE_TOL = 2e-2 if DEV.type == "cuda" else 4e-2
MAX_KV = 70
NUM_SLOTS = 300  # live cache rows; the rows past them are NaN-poisoned
POISON = 8


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=BF16_SCALE_TOL * scale, rtol=0)


def reference(q, rows, kv_slots, seq_lens, width, scale, c, selection=None):
    """q [bs * w, H, C + R]; rows [S, C + R]; kv_slots [bs, kv]; seq_lens [bs] -> [bs * w, H, C] in q's dtype."""
    bs, kv = kv_slots.shape
    pos = torch.arange(kv, device=q.device)
    kv_rows = rows[kv_slots].float()  # [bs, kv, C + R]
    kv_rows = torch.where((pos[None, :] < seq_lens[:, None])[..., None], kv_rows, 0.0)  # past the length: unread
    qq = q.float().view(bs, width, q.shape[1], -1)  # [bs, w, H, C + R]
    scores = torch.einsum("bwhd,bkd->bwhk", qq, kv_rows) * scale  # [bs, w, H, kv]
    q_len = seq_lens[:, None] - width + torch.arange(width, device=q.device)[None, :] + 1  # [bs, w]
    allowed = pos[None, None, :] < q_len[:, :, None]  # [bs, w, kv]
    if selection is not None:
        allowed = allowed & selection[:, 0]
    p = torch.softmax(scores.masked_fill(~allowed[:, :, None, :], float("-inf")), dim=-1)
    o = torch.einsum("bwhk,bkc->bwhc", p, kv_rows[..., :c])  # [bs, w, H, C]
    return o.reshape(bs * width, q.shape[1], c).to(q.dtype)


def _batch(seq_lens: list[int], width: int, heads: int, c: int, r: int, dtype: torch.dtype, g: torch.Generator,
           selection: str | None):
    """-> (q, rows, kv_slots, seq_lens, selection) on DEV; q, rows and kv_slots are strided views."""
    bs, d = len(seq_lens), c + r
    base = torch.randn((bs * width, heads, d + 3), generator=g)
    q = base.to(dtype).to(DEV)[..., 2:2 + d]  # [T, H, C + R], a slice of a fused buffer
    cache = torch.randn((NUM_SLOTS + POISON, d + 5), generator=g)
    cache[NUM_SLOTS:] = float("nan")
    rows = cache.to(dtype).to(DEV)[:, :d]  # [S, C + R], row stride d + 5
    table = torch.zeros((bs + 2, MAX_KV + 6), dtype=torch.int64)  # a graph buffer wider than the batch
    for b, s in enumerate(seq_lens):
        if s > width:  # padded requests (s == width) keep slot 0
            table[b, :s] = torch.randperm(NUM_SLOTS, generator=g)[:s]
        table[b, s:] = NUM_SLOTS + torch.randint(0, POISON, (MAX_KV + 6 - s,), generator=g)  # never read
    kv_slots = table.to(DEV)[:bs, :MAX_KV]  # [bs, max_kv], row stride MAX_KV + 6
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    sel = None
    if selection is not None:
        keep = 0.5 if selection == "random" else 0.03
        sel = torch.rand((bs, 1, width, MAX_KV), generator=g) < keep
        for b, s in enumerate(seq_lens):
            sel[b, 0, torch.arange(width), s - width + torch.arange(width)] = True  # each query's own last key
        sel = sel.to(DEV)
    return q, rows, kv_slots, lens, sel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("heads", [4, 16, 40])
@pytest.mark.parametrize("c,r", [(32, 8), (48, 16)])
@pytest.mark.parametrize("selection", [None, "random", "sparse"])
def test_mla_decode_matches_reference(dtype, width, heads, c, r, selection):
    g = torch.Generator().manual_seed(width * 1000 + heads * 10 + c + (len(selection) if selection else 0))
    seq_lens = [MAX_KV, width, 33, 17 + width, width] if width == 1 else [width, 65, MAX_KV, 9]
    q, rows, kv_slots, lens, sel = _batch(seq_lens, width, heads, c, r, dtype, g, selection)
    scale = (c + r) ** -0.5
    got = mla_decode_triton(q, rows, kv_slots, lens, width, scale, c, sel)
    assert got.shape == (len(seq_lens) * width, heads, c) and got.dtype == dtype
    _assert_close(got, reference(q, rows, kv_slots, lens, width, scale, c, sel))
    assert torch.equal(mla_decode_triton(q, rows, kv_slots, lens, width, scale, c, sel), got)  # deterministic


def test_default_head_blocks_from_shapes():
    """64 heads a program from 4 query tokens on (16-bit q, 64+ heads; from 8 over at most 2048 keys), 32 below 64
    heads or for float32 q; 16 or 32 heads (long contexts) in smaller launches."""
    assert default_block_h(4, 64, 4096, wide=False) == 64 and default_block_h(256, 128, 2048, wide=False) == 64
    assert default_block_h(4, 64, 2048, wide=False) == 16 and default_block_h(8, 64, 2048, wide=False) == 64
    assert default_block_h(4, 64, 4096, wide=True) == 32 and default_block_h(8, 40, 4096, wide=False) == 32
    assert default_block_h(8, 16, 4096, wide=False) == 16
    assert default_block_h(1, 64, 4096, wide=False) == 16 and default_block_h(3, 64, 32768, wide=False) == 32
    assert default_block_h(1, 16, 32768, wide=False) == 16


@pytest.mark.parametrize("selection", [None, "sparse"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_64_head_blocks_match_reference(selection, num_splits):
    """The default launch of a 64-head model at 4 query tokens in bfloat16 (one block of 64 heads, 4 warps or 8):
    == the reference, key splits or not, dense or sparse."""
    g = torch.Generator().manual_seed(64 + num_splits)
    q, rows, kv_slots, lens, sel = _batch([MAX_KV, 4, 33], 4, 64, 32, 16, torch.bfloat16, g, selection)
    assert default_block_h(q.shape[0], 64, MAX_KV, wide=False) == 64  # 12 query tokens
    want = reference(q, rows, kv_slots, lens, 4, 0.1, 32, sel)
    for warps in (None, 4):
        got = mla_decode_triton(q, rows, kv_slots, lens, 4, 0.1, 32, sel, num_splits=num_splits, num_warps=warps,
                                num_stages=1 if warps else 2)
        _assert_close(got, want)


def test_small_key_blocks_and_out_buffer():
    """BLOCK_N = 16 (five key blocks), written into a given strided output buffer."""
    g = torch.Generator().manual_seed(7)
    q, rows, kv_slots, lens, sel = _batch([MAX_KV, 2, 40], 2, 8, 48, 16, torch.float32, g, "random")
    buf = torch.full((6, 8, 48 + 4), float("nan"), device=DEV)
    out = buf[..., :48]
    got = mla_decode_triton(q, rows, kv_slots, lens, 2, 0.1, 48, sel, block_n=16, out=out)
    assert got.data_ptr() == out.data_ptr()
    _assert_close(out, reference(q, rows, kv_slots, lens, 2, 0.1, 48, sel))
    assert torch.isnan(buf[..., 48:]).all()  # nothing written past C


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("selection", [None, "sparse"])
@pytest.mark.parametrize("c", [48, 160])
def test_key_splits_match_reference(dtype, num_splits, selection, c):
    """Keys split over the grid and merged by the combine kernel: 2, 3 and 7 runs of 16-key blocks, so short
    queries leave whole splits empty (and a sparse selection hides some splits' every key); heads 40 (a partial
    head block); C = 160: one partial [splits, 256] tile in the combine."""
    g = torch.Generator().manual_seed(num_splits)
    q, rows, kv_slots, lens, sel = _batch([MAX_KV, 3, 33, 50], 3, 40, c, 16, dtype, g, selection)
    want = reference(q, rows, kv_slots, lens, 3, 0.1, c, sel)
    got = mla_decode_triton(q, rows, kv_slots, lens, 3, 0.1, c, sel, block_n=16, num_splits=num_splits)
    _assert_close(got, want)


def test_many_splits_merge_in_dim_blocks():
    """20 splits: the combine's [32 splits, 128 dims] tiles, the second of C = 160 partial."""
    g = torch.Generator().manual_seed(20)
    q, rows, kv_slots, lens, sel = _batch([MAX_KV, 3, 33, 50], 3, 40, 160, 16, torch.bfloat16, g, "sparse")
    want = reference(q, rows, kv_slots, lens, 3, 0.1, 160, sel)
    _assert_close(mla_decode_triton(q, rows, kv_slots, lens, 3, 0.1, 160, sel, block_n=16, num_splits=20), want)


def test_split_count_from_shapes():
    from specserve.kernels.triton_mla import num_key_splits

    assert num_key_splits(4, 32768, 32, 264) == 66  # batch 1: split until about 2 programs per SM
    assert num_key_splits(4, 2048, 32, 264) == 64  # up to 2048 keys: one split per key block at most
    assert num_key_splits(4, 4096, 32, 264) == 32  # longer: capped at one split per 4 key blocks
    assert num_key_splits(4, 64, 64, 264) == 1
    assert num_key_splits(512, 32768, 32, 264) == 1  # the batch fills the GPU by itself
    assert num_key_splits(32, 2048, 64, 132) == 4  # within the target: 128 programs, not 160
    assert num_key_splits(64, 2048, 64, 132) == 2


def test_64_head_programs_aim_for_half_the_programs():
    """64-head programs run one to an SM: their key splits aim for half the programs of smaller head blocks."""
    from specserve.kernels.triton_mla import split_target

    cpu = torch.device("cpu")
    assert split_target(cpu, 64) * 2 == split_target(cpu, 32) == split_target(cpu, 16) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_mla_decode_cuda_graph_replay(dtype, sparse, num_splits):
    """Captured once with fixed shapes; replays with new seq_lens, kv_slots (and selections) copied into the same
    tensors equal the reference. DeepSeek's row width: C = 512, R = 64."""
    width, heads, c, r = 2, 16, 512, 64
    g = torch.Generator().manual_seed(0)
    q, rows, kv_slots, lens, sel = _batch([MAX_KV, width, 30], width, heads, c, r, dtype, g,
                                          "random" if sparse else None)
    scale = (c + r) ** -0.5
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        mla_decode_triton(q, rows, kv_slots, lens, width, scale, c, sel, num_splits=num_splits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode_triton(q, rows, kv_slots, lens, width, scale, c, sel, num_splits=num_splits)
    for seed in range(4):
        g.manual_seed(100 + seed)
        new_lens = [int(x) for x in torch.randint(width, MAX_KV + 1, (3,), generator=g)]
        new_lens[seed % 3] = width  # a padded request
        q2, _, slots2, lens2, sel2 = _batch(new_lens, width, heads, c, r, dtype, g, "random" if sparse else None)
        q.copy_(q2)
        kv_slots.copy_(slots2)
        lens.copy_(lens2)
        if sparse:
            sel.copy_(sel2)
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, reference(q, rows, kv_slots, lens, width, scale, c, sel))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_rows_read_the_table_through_kv_rows(dtype):
    """kv_rows (a prefill's token rows): request b reads row kv_rows[b] of a wider table (the page table); exactly
    the result of passing the gathered rows as kv_slots."""
    g = torch.Generator().manual_seed(7)
    seq_lens = [MAX_KV, 1, 33, 18, 1, 64]
    q, rows, kv_slots, lens, _ = _batch(seq_lens, 1, 16, 32, 8, dtype, g, None)
    table = torch.cat([kv_slots.flip(0), torch.zeros_like(kv_slots[:2])])  # request b's keys at row bs - 1 - b
    kv_rows = torch.arange(len(seq_lens) - 1, -1, -1, device=DEV)
    scale = 40 ** -0.5
    got = mla_decode_triton(q, rows, table, lens, 1, scale, 32, kv_rows=kv_rows)
    assert torch.equal(got, mla_decode_triton(q, rows, kv_slots, lens, 1, scale, 32))
    _assert_close(got, reference(q, rows, kv_slots, lens, 1, scale, 32))
