"""The DSA indexer-score kernel (kernels/triton_indexer.py) against a plain torch reference (float32 einsums over the
dequantised keys, -inf past each query's causal length): float32 and bfloat16 q / cache, and fp8 (e4m3) caches with
a float32 scale per row under bfloat16 and float32 q; widths 1 and 4; Hi = 2 and 32 index heads; D = 16 and 128;
up to 5 requests of different lengths including padded ones (seq_lens == width, slots 0) and lengths that end on
and across key-block edges, over 150 keys (three 64-key blocks, the last partial). Keys past a request's length
point at NaN-poisoned cache rows (and NaN scales: the interpreter reads an fp8 NaN as 480), so reading one shows up;
q, weights, the cache and kv_slots are strided views, as slices of larger buffers. On a GPU, the kernel captured in
a CUDA graph and replayed with new queries, lengths and slots. On CPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels.reference import quantise_rows_fp8  # noqa: E402
from specserve.kernels.triton_indexer import index_scores_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
# bf16 / fp8 inputs are exact in float32 and both sides accumulate in float32, so only the summation order differs;
# compared against the scores' scale all the same (the sum over heads mixes signs).
BF16_SCALE_TOL = 1e-3
MAX_KV = 150
NUM_SLOTS = 400  # live cache rows; the rows past them are NaN-poisoned
POISON = 8


def reference(q, weights, rows, scales, kv_slots, seq_lens, width):
    """q [bs * w, Hi, D]; weights [bs * w, Hi]; rows [S, D]; scales None or [S]; kv_slots [bs, kv]; seq_lens [bs]
    -> [bs, w, kv] float32, -inf where hidden."""
    bs, kv = kv_slots.shape
    pos = torch.arange(kv, device=q.device)
    flat = kv_slots.reshape(-1)
    keys = rows.index_select(0, flat).float()  # [bs * kv, D]
    if scales is not None:
        keys = keys * scales.index_select(0, flat)[:, None]
    keys = keys.view(bs, kv, -1)
    keys = torch.where((pos[None, :] < seq_lens[:, None])[..., None], keys, 0.0)  # past the length: unread
    qq = q.float().view(bs, width, q.shape[1], -1)  # [bs, w, Hi, D]
    s = torch.einsum("bwhd,bkd->bwhk", qq, keys).relu()  # [bs, w, Hi, kv]
    scores = torch.einsum("bwh,bwhk->bwk", weights.view(bs, width, -1), s)
    q_len = seq_lens[:, None] - width + torch.arange(width, device=q.device)[None, :] + 1  # [bs, w]
    allowed = pos[None, None, :] < q_len[:, :, None]  # [bs, w, kv]
    return scores.masked_fill(~allowed, float("-inf"))




def _batch(seq_lens: list[int], width: int, heads: int, dim: int, q_dtype: torch.dtype, cache: str,
           g: torch.Generator):
    """cache: "q" (q's dtype) or "fp8" -> (q, weights, rows, scales, kv_slots, seq_lens) on DEV; q, weights, rows
    and kv_slots are strided views."""
    bs = len(seq_lens)
    base = torch.randn((bs * width, heads, dim + 3), generator=g)
    q = base.to(q_dtype).to(DEV)[..., 1:1 + dim]  # [T, Hi, D], a slice of a fused buffer
    wbuf = torch.randn((bs * width, heads + 2), generator=g) * (heads * dim) ** -0.5
    weights = wbuf.to(DEV)[:, :heads]  # [T, Hi], row stride Hi + 2
    keys = torch.randn((NUM_SLOTS + POISON, dim + 5), generator=g)
    if cache == "fp8":
        stored = torch.zeros((NUM_SLOTS + POISON, dim + 5), dtype=FP8)
        stored[:, :dim], scale = quantise_rows_fp8(keys[:, :dim])
        stored[NUM_SLOTS:] = float("nan")
        scale[NUM_SLOTS:] = float("nan")
        rows, scales = stored.to(DEV)[:, :dim], scale.to(DEV)  # [S, D] fp8, row stride D + 5; [S] float32
    else:
        keys[NUM_SLOTS:] = float("nan")
        rows, scales = keys.to(q_dtype).to(DEV)[:, :dim], None  # [S, D], row stride D + 5
    table = torch.zeros((bs + 2, MAX_KV + 6), dtype=torch.int64)  # a graph buffer wider than the batch
    for b, s in enumerate(seq_lens):
        if s > width:  # padded requests (s == width) keep slot 0
            table[b, :s] = torch.randperm(NUM_SLOTS, generator=g)[:s]
        table[b, s:] = NUM_SLOTS + torch.randint(0, POISON, (MAX_KV + 6 - s,), generator=g)  # never read
    kv_slots = table.to(DEV)[:bs, :MAX_KV]  # [bs, max_kv], row stride MAX_KV + 6
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    return q, weights, rows, scales, kv_slots, lens


def _check(got: torch.Tensor, want: torch.Tensor, exact_f32: bool) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    hidden = torch.isneginf(want)
    assert torch.equal(torch.isneginf(got), hidden)  # -inf exactly where a query may not see the key
    assert torch.isfinite(got[~hidden]).all()
    if exact_f32:
        torch.testing.assert_close(got[~hidden], want[~hidden], atol=1e-5, rtol=1e-4)
    else:
        scale = want[~hidden].abs().max().item()
        torch.testing.assert_close(got[~hidden], want[~hidden], atol=BF16_SCALE_TOL * scale, rtol=0)


@pytest.mark.parametrize("q_dtype,cache", [(torch.float32, "q"), (torch.bfloat16, "q"), (torch.bfloat16, "fp8"),
                                           (torch.float32, "fp8")])
@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("heads", [2, 32])
@pytest.mark.parametrize("dim", [16, 128])
def test_index_scores_match_reference(q_dtype, cache, width, heads, dim):
    g = torch.Generator().manual_seed(width * 1000 + heads * 10 + dim + (1 if cache == "fp8" else 0))
    # block edges at 64 and 128: lengths ending on them, and widths-4 requests whose queries straddle them
    seq_lens = [MAX_KV, width, 64, 65, width] if width == 1 else [width, 66, MAX_KV, 9, 130]
    q, weights, rows, scales, kv_slots, lens = _batch(seq_lens, width, heads, dim, q_dtype, cache, g)
    got = index_scores_triton(q, weights, rows, scales, kv_slots, lens, width)
    want = reference(q, weights, rows, scales, kv_slots, lens, width)
    _check(got, want, q_dtype == torch.float32)
    assert torch.equal(index_scores_triton(q, weights, rows, scales, kv_slots, lens, width), got)  # deterministic
    if dim == 128 and width == 4:  # the tile's dot as [keys, heads] (keys_m), the head sum along its N
        _check(index_scores_triton(q, weights, rows, scales, kv_slots, lens, width, keys_m=True), want,
               q_dtype == torch.float32)


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("heads,block_h", [(2, None), (32, None), (40, 16)])
def test_q_fp8_scores_match_the_reference_over_rounded_queries(width, heads, block_h):
    """q_fp8 (fp8 caches): each head's q row rounded to e4m3 with its own scale in the kernel equals the reference
    over q rounded the same way in torch (quantise_rows_fp8); differs from the unrounded q's scores. One head block
    (rounded once a program) and three (rounded in the key loop)."""
    g = torch.Generator().manual_seed(8000 + width * 100 + heads)
    seq_lens = [MAX_KV, width, 64, 65, width] if width == 1 else [width, 66, MAX_KV, 9, 130]
    q, weights, rows, scales, kv_slots, lens = _batch(seq_lens, width, heads, 128, torch.bfloat16, "fp8", g)
    got = index_scores_triton(q, weights, rows, scales, kv_slots, lens, width, q_fp8=True, block_h=block_h)
    q8, q_scale = quantise_rows_fp8(q)  # [T, Hi, D], [T, Hi]
    rounded = q8.float() * q_scale[..., None]
    want = reference(rounded, weights, rows, scales, kv_slots, lens, width)
    _check(got, want, True)
    _check(index_scores_triton(q, weights, rows, scales, kv_slots, lens, width, q_fp8=True, block_h=block_h,
                               keys_m=True), want, True)
    seen = ~torch.isneginf(want)
    assert not torch.allclose(got[seen], reference(q, weights, rows, scales, kv_slots, lens, width)[seen], atol=1e-3)
    with pytest.raises(AssertionError, match="fp8 cache"):
        index_scores_triton(q, weights, rows.float().to(torch.bfloat16), None, kv_slots, lens, width, q_fp8=True)


@pytest.mark.parametrize("heads", [32, 64])
def test_fast_acc_scores_are_the_same_in_every_launch(heads):
    """fast_acc (fp8 sums kept in the tensor core over the head dimension): close to the float32 reference over the
    rounded queries (5e-3 of the largest score), and the same score for each (query, key) pair to float32 rounding
    of the head sum (1e-6) whatever the launch: key tiles of 64 / 128 / 256, 1-4 blocks a program, the top-k's first
    pass fused or not, and the verify-shaped batch (width 4) against the same queries as token rows (a prefill's
    layout): the tensor core's fp8 sums do not depend on the tiling, so the phases choose alike."""
    from specserve.kernels.triton_topk import topk_workspace

    g = torch.Generator().manual_seed(9100 + heads)
    width = 4
    seq_lens = [width, 66, MAX_KV, 9, 130]
    q, weights, rows, scales, kv_slots, lens = _batch(seq_lens, width, heads, 128, torch.bfloat16, "fp8", g)
    kw = dict(q_fp8=True, keys_m=True, fast_acc=True)
    got = index_scores_triton(q, weights, rows, scales, kv_slots, lens, width, **kw)  # [bs, W, max_kv]
    q8, q_scale = quantise_rows_fp8(q)
    want = reference(q8.float() * q_scale[..., None], weights, rows, scales, kv_slots, lens, width)
    seen = ~torch.isneginf(want)
    assert torch.equal(~torch.isneginf(got), seen)
    scale = want[seen].abs().max().item()
    torch.testing.assert_close(got[seen], want[seen], atol=5e-3 * scale, rtol=0)
    n = q.shape[0]
    for opts in (dict(block_n=64), dict(block_n=256), dict(steps=1), dict(steps=2, block_n=64),
                 dict(hist=topk_workspace(n, DEV), k=8, block_n=64)):
        other = index_scores_triton(q, weights, rows, scales, kv_slots, lens, width, **kw, **opts)
        torch.testing.assert_close(other[seen], got[seen], atol=1e-6 * scale, rtol=0, msg=str(opts))
    # the same queries as token rows: query b * W + i, its own causal length, its request's row of the table
    rows_of = torch.arange(len(seq_lens), device=DEV).repeat_interleave(width)
    causal = (lens[:, None] - width + torch.arange(width, device=DEV) + 1).reshape(-1)
    tokens = index_scores_triton(q, weights, rows, scales, kv_slots, causal, 1, kv_rows=rows_of, **kw)
    torch.testing.assert_close(tokens.view(n, -1)[seen.view(n, -1)], got[seen], atol=1e-6 * scale, rtol=0)


def test_head_blocks_small_key_blocks_and_out_buffer():
    """Hi = 40 over 16-head blocks (three, the last partial), BLOCK_N = 16 (ten key blocks), written into a given
    strided output buffer."""
    g = torch.Generator().manual_seed(7)
    q, weights, rows, scales, kv_slots, lens = _batch([MAX_KV, 2, 40], 2, 40, 48, torch.float32, "fp8", g)
    buf = torch.full((3, 2, MAX_KV + 4), float("nan"), device=DEV)
    out = buf[..., :MAX_KV]
    got = index_scores_triton(q, weights, rows, scales, kv_slots, lens, 2, block_n=16, block_h=16, out=out)
    assert got.data_ptr() == out.data_ptr()
    _check(out, reference(q, weights, rows, scales, kv_slots, lens, 2), True)
    assert torch.isnan(buf[..., MAX_KV:]).all()  # nothing written past max_kv


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["q", "fp8"])
def test_index_scores_cuda_graph_replay(cache):
    """Captured once with fixed shapes; replays with new q, weights, seq_lens and kv_slots copied into the same
    tensors equal the reference. DeepSeek-V3.2's indexer: Hi = 64, D = 128, bfloat16 queries."""
    width, heads, dim = 2, 64, 128
    g = torch.Generator().manual_seed(0)
    q, weights, rows, scales, kv_slots, lens = _batch([MAX_KV, width, 30], width, heads, dim, torch.bfloat16,
                                                      cache, g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        index_scores_triton(q, weights, rows, scales, kv_slots, lens, width)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = index_scores_triton(q, weights, rows, scales, kv_slots, lens, width)
    for seed in range(4):
        g.manual_seed(100 + seed)
        new_lens = [int(x) for x in torch.randint(width, MAX_KV + 1, (3,), generator=g)]
        new_lens[seed % 3] = width  # a padded request
        q2, w2, _, _, slots2, lens2 = _batch(new_lens, width, heads, dim, torch.bfloat16, cache, g)
        q.copy_(q2)
        weights.copy_(w2)
        kv_slots.copy_(slots2)
        lens.copy_(lens2)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, reference(q, weights, rows, scales, kv_slots, lens, width), False)


def test_token_rows_read_the_table_through_kv_rows():
    """kv_rows (a prefill's token rows): request b reads row kv_rows[b] of a wider table; exactly the result of
    passing the gathered rows as kv_slots."""
    g = torch.Generator().manual_seed(9)
    seq_lens = [MAX_KV, 1, 64, 65, 1]
    q, weights, rows, scales, kv_slots, lens = _batch(seq_lens, 1, 4, 32, torch.float32, "q", g)
    table = torch.cat([torch.zeros_like(kv_slots[:1]), kv_slots.flip(0)])  # request b's keys at row bs - b
    kv_rows = torch.arange(len(seq_lens), 0, -1, device=DEV)
    got = index_scores_triton(q, weights, rows, scales, table, lens, 1, kv_rows=kv_rows)
    assert torch.equal(got, index_scores_triton(q, weights, rows, scales, kv_slots, lens, 1))


def _first_pass_hist(scores: torch.Tensor, lens: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """[bs * width, 256] int32: per selecting query (causal length > k), its visible keys' top 8 bits of the
    order-preserving key (the top-k's first radix digit); zeros for the others."""
    bs, w, max_kv = scores.shape
    s = scores.reshape(bs * w, max_kv).cpu().clone()
    s[s == 0.0] = 0.0  # -0.0 as +0.0
    bits = s.view(torch.int32).to(torch.int64)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits) + 2 ** 31  # [T, max_kv] in [0, 2^32)
    q_len = (lens.cpu()[:, None] - width + torch.arange(width)[None, :] + 1).reshape(-1).clamp(max=max_kv)
    out = torch.zeros((bs * w, 256), dtype=torch.int32)
    for t in range(bs * w):
        n = int(q_len[t])
        if n > k:
            out[t] = torch.bincount(ordered[t, :n] >> 24, minlength=256).to(torch.int32)
    return out


@pytest.mark.parametrize("width,kv_rows_path", [(1, False), (4, False), (1, True)])
def test_first_topk_pass_inside_the_scores_kernel(width, kv_rows_path):
    """With the top-k's workspace the scores kernel adds the top-k's first histogram pass as it writes the scores
    (for queries that select): that histogram is the first radix digit's counts of the written scores, and the top-k
    that takes it over chooses what the top-k doing all four passes itself chooses, exact ties (ReLU zeros of
    zeroed keys) included."""
    from specserve.kernels.triton_topk import index_topk_triton, topk_workspace

    g = torch.Generator().manual_seed(31 + width + kv_rows_path)
    seq_lens = [MAX_KV, width, 64, 65, width] if width == 1 else [width, 66, MAX_KV, 9, 130]
    q, weights, rows, scales, kv_slots, lens = _batch(seq_lens, width, 4, 32, torch.float32, "q", g)
    rows[: NUM_SLOTS // 3].zero_()
    k = 40
    table, kv_rows = kv_slots, None
    if kv_rows_path:
        table = torch.cat([torch.zeros_like(kv_slots[:1]), kv_slots.flip(0)])
        kv_rows = torch.arange(len(seq_lens), 0, -1, device=DEV)
    hist = topk_workspace(q.shape[0], q.device)
    scores = index_scores_triton(q, weights, rows, scales, table, lens, width, hist=hist, k=k, kv_rows=kv_rows)
    # the same tiles (without a first pass the default tile is 128 keys, whose dot may sum in another order)
    assert torch.equal(scores, index_scores_triton(q, weights, rows, scales, table, lens, width, kv_rows=kv_rows,
                                                   block_n=64))
    first = hist[:, 0, :256].cpu()
    assert first.sum() > 0 and hist[:, 0, 256:].count_nonzero() == 0 and hist[:, 1:].count_nonzero() == 0
    assert torch.equal(first, _first_pass_hist(scores, lens, width, k))
    got = index_topk_triton(scores, lens, table, width, k, hist=hist, kv_rows=kv_rows)
    want = index_topk_triton(scores, lens, table, width, k, kv_rows=kv_rows)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("width", [1, 4])
def test_key_steps_walks_give_the_same_scores_and_first_pass(width):
    """A program walking 1, 2, 3 or 8 key blocks (the last run partial, queries whose causal length ends inside
    one) writes the same scores and the same first-pass histogram; the default picks longer walks only when the
    grid has programs to spare."""
    from specserve.kernels.triton_indexer import key_steps
    from specserve.kernels.triton_topk import topk_workspace

    g = torch.Generator().manual_seed(77 + width)
    seq_lens = [MAX_KV, width, 64, 65, width] if width == 1 else [width, 66, MAX_KV, 9, 130]
    q, weights, rows, scales, kv_slots, lens = _batch(seq_lens, width, 4, 32, torch.float32, "q", g)
    results = []
    for steps in (1, 2, 3, 8):
        hist = topk_workspace(q.shape[0], q.device)
        scores = index_scores_triton(q, weights, rows, scales, kv_slots, lens, width, block_n=16, hist=hist, k=20,
                                     steps=steps)
        results.append((scores, hist))
    _check(results[0][0], reference(q, weights, rows, scales, kv_slots, lens, width), True)
    for scores, hist in results[1:]:
        assert torch.equal(scores, results[0][0]) and torch.equal(hist, results[0][1])
    assert torch.equal(results[0][1][:, 0, :256].cpu(), _first_pass_hist(results[0][0], lens, width, 20))
    assert key_steps(1, 512, 264) == 1  # batch 1 over 32k keys in 64-key blocks: one block a program
    assert key_steps(8, 512, 264) == 2
    assert key_steps(32, 512, 264) == 8


@pytest.mark.gpu
def test_key_steps_walks_equal_on_gpu():
    """On the GPU (where key_steps picks longer walks only for big grids): 1, 4 and 8 key blocks a program write the
    same scores and first-pass histogram, 24 queries of a 4-wide batch over 2048 keys."""
    from specserve.kernels.triton_topk import topk_workspace

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    bs, width, heads, dim, kv = 6, 4, 32, 128, 2048
    rows = torch.randn((bs * kv + 16, dim), device=dev, dtype=torch.bfloat16, generator=g)
    kv_slots = (torch.randperm(bs * kv, device=dev, generator=g) + 16).view(bs, kv)
    lens = torch.tensor([kv, 5, 1000, 1025, 64, 2047], device=dev)
    q = torch.randn((bs * width, heads, dim), device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn((bs * width, heads), device=dev, generator=g)
    results = []
    for steps in (1, 4, 8):
        hist = topk_workspace(bs * width, dev)
        results.append((index_scores_triton(q, w, rows, None, kv_slots, lens, width, hist=hist, k=100, steps=steps),
                        hist))
    for scores, hist in results[1:]:
        assert torch.equal(scores, results[0][0]) and torch.equal(hist, results[0][1])
