"""The DSA top-k kernel (kernels/triton_topk.py) against the torch reference (attention/torch_mla_backend.py
topk_slots): the same chosen set for every query, in position order then -1, with counts. Scores drawn from a
small pool (exact ties everywhere, +0.0 and -0.0, huge and tiny values), queries seeing fewer keys than k (take
all), more (select), padded requests (seq_lens == width), several chunks per row (small chunk and block sizes);
scores past each query's causal length are NaN, so reading one would show. On a GPU, also captured in a CUDA graph
and replayed with new scores and lengths, and at the production sizes (chunk 2048, 32k keys, k 2048). On CPU the
kernels run under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.attention.torch_mla_backend import topk_slots  # noqa: E402
from specserve.kernels.triton_topk import index_topk_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POOL = [0.0, -0.0, 1.5, -2.0, 3e38, -3e38, 1e-40, 7.0, 0.25]


def _batch(seq_lens: list[int], width: int, max_kv: int, g: torch.Generator, spread: bool = False):
    bs = len(seq_lens)
    if spread:
        scores = torch.randn((bs, width, max_kv), generator=g)
    else:
        pool = torch.tensor(POOL)
        scores = pool[torch.randint(0, len(pool), (bs, width, max_kv), generator=g)]
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    q_len = lens[:, None] - width + torch.arange(width)[None, :] + 1  # [bs, w]
    valid = torch.arange(max_kv)[None, None, :] < q_len[:, :, None]
    scores = scores.masked_fill(~valid, float("nan"))  # never read
    kv_slots = torch.stack([torch.randperm(10 * max_kv, generator=g)[:max_kv] + 1 for _ in range(bs)])
    return scores, valid, kv_slots, lens


def _check(scores, valid, kv_slots, lens, width, k, **kw):
    ref = topk_slots(scores.nan_to_num(0.0), valid, kv_slots, k)  # reference ignores hidden keys by `valid`
    got, counts = index_topk_triton(scores.to(DEV), lens.to(DEV), kv_slots.to(DEV), width, k, **kw)
    got, counts = got.cpu(), counts.cpu()
    assert torch.equal(counts, ref.counts), (counts, ref.counts)
    for r in range(got.shape[0]):
        slot_pos = {s: p for p, s in enumerate(kv_slots[r // width].tolist())}
        n = int(counts[r])
        want = sorted(ref.slots[r, :n].tolist(), key=lambda s: slot_pos[s])
        assert got[r, :n].tolist() == want, r  # the same set, in position order
        assert (got[r, n:] == -1).all(), r


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("k", [5, 40, 200])
@pytest.mark.parametrize("local", [True, False])
def test_topk_matches_reference_with_ties(width, k, local):
    """local: the last histogram pass keeps per-chunk counts (decode sizes' default); False: the count kernel."""
    g = torch.Generator().manual_seed(width * 100 + k)
    seq_lens = [300, width, 37, 129 + width, 64] if width == 1 else [width, 300, 90, 150]
    scores, valid, kv_slots, lens = _batch(seq_lens, width, 300, g)
    _check(scores, valid, kv_slots, lens, width, k, chunk=64, block=32, local=local)


def test_topk_spread_scores_default_chunk():
    """Distinct scores (no ties), one chunk per row at the default sizes; k above max_kv (K = max_kv)."""
    g = torch.Generator().manual_seed(3)
    scores, valid, kv_slots, lens = _batch([700, 2, 450], 2, 700, g, spread=True)
    _check(scores, valid, kv_slots, lens, 2, 100)
    _check(scores, valid, kv_slots, lens, 2, 1000)


def test_chunk_shrinks_until_the_grid_fills_the_device():
    """kernels/triton_topk.py pick_chunk: one query over 32k keys gets 256-key programs (the launches are latency),
    a batch whose grid fills the device keeps 2048; each chunk size gives the reference's choice."""
    from specserve.kernels.triton_topk import CHUNKS, pick_chunk

    assert pick_chunk(1, 32768, 264) == 256
    assert pick_chunk(8, 32768, 264) == 512  # 8 x 64 chunks
    assert pick_chunk(32, 32768, 264) == 2048
    assert pick_chunk(2048, 4096, 264) == 2048  # a prefill's token rows
    g = torch.Generator().manual_seed(5)
    scores, valid, kv_slots, lens = _batch([600, 1, 333], 1, 600, g)
    for chunk in CHUNKS[2:]:
        _check(scores, valid, kv_slots, lens, 1, 100, chunk=chunk)


@pytest.mark.parametrize("local", [True, False])
def test_all_ties_take_the_earliest(local):
    """Every score equal: the first k positions of each query."""
    g = torch.Generator().manual_seed(4)
    scores, valid, kv_slots, lens = _batch([200, 150], 1, 200, g)
    scores = torch.where(valid, 1.0, float("nan"))
    got, counts = index_topk_triton(scores.to(DEV), lens.to(DEV), kv_slots.to(DEV), 1, 30, chunk=64, block=16,
                                    local=local)
    assert got.cpu()[:, :30].tolist() == kv_slots[:, :30].tolist() and counts.tolist() == [30, 30]


@pytest.mark.gpu
def test_topk_production_sizes_and_graph_replay():
    g = torch.Generator().manual_seed(5)
    scores, valid, kv_slots, lens = _batch([32768, 1000, 20000, 4], 4, 32768, g, spread=True)
    _check(scores, valid, kv_slots, lens, 4, 2048)
    s, sl, ks = scores.cuda(), lens.cuda(), kv_slots.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        index_topk_triton(s, sl, ks, 4, 2048)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, counts = index_topk_triton(s, sl, ks, 4, 2048)
    for seed in range(3):
        g.manual_seed(50 + seed)
        new_lens = [int(x) for x in torch.randint(4, 32769, (4,), generator=g)]
        scores2, valid2, _, lens2 = _batch(new_lens, 4, 32768, g, spread=seed != 1)
        s.copy_(scores2)
        sl.copy_(lens2)
        graph.replay()
        ref = topk_slots(scores2.nan_to_num(0.0), valid2, kv_slots, 2048)
        assert torch.equal(counts.cpu(), ref.counts)
        for r in range(16):
            n = int(ref.counts[r])
            assert sorted(out[r, :n].cpu().tolist()) == sorted(ref.slots[r, :n].tolist())


def test_token_rows_read_the_table_through_kv_rows():
    """kv_rows (a prefill's token rows): request b's slots come from row kv_rows[b] of a wider table; the same
    result as passing the gathered rows as kv_slots, and as the reference."""
    g = torch.Generator().manual_seed(11)
    seq_lens = [300, 1, 37, 130, 64]
    scores, valid, kv_slots, lens = _batch(seq_lens, 1, 300, g)
    table = torch.cat([kv_slots.flip(0), kv_slots[:1] * 0]).to(DEV)  # request b's slots at row bs - 1 - b
    kv_rows = torch.arange(len(seq_lens) - 1, -1, -1, device=DEV)
    got = index_topk_triton(scores.to(DEV), lens.to(DEV), table, 1, 40, chunk=64, block=32, kv_rows=kv_rows)
    want = index_topk_triton(scores.to(DEV), lens.to(DEV), kv_slots.to(DEV), 1, 40, chunk=64, block=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    _check(scores, valid, kv_slots, lens, 1, 40, chunk=64, block=32)
