"""The sort-free sampling kernels (kernels/triton_sample.py) against the torch reference (layers/sampler.py): the
same filtered distribution (kept set exactly, values to float rounding) and the same sampled token for rows mixing
greedy, temperature only, top-k, top-p, min-p and their combinations; logits rounded to bfloat16 (exact ties at the
top-k / top-p boundary, kept together by both), -inf logits (a whole chunk of them), a vocabulary that is not a
multiple of the chunk, and several chunks and blocks per row. On CPU under Triton's interpreter; on a GPU also at
the production chunk sizes and captured in a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

from specserve.kernels.triton_sample import probs_triton, sample_triton  # noqa: E402
from specserve.layers.sampler import SamplingBatch, probs_reference, sample_from_probs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = dict(chunk=256, block=64)  # several chunks and blocks per row under the interpreter

# (greedy, temperature, top_k, top_p, min_p); top_k None = off
ROWS = [
    (True, 0.0, None, 1.0, 0.0),
    (False, 1.0, None, 1.0, 0.0),
    (False, 0.7, None, 1.0, 0.0),
    (False, 1.0, 1, 1.0, 0.0),
    (False, 0.8, 20, 1.0, 0.0),
    (False, 1.3, 200, 1.0, 0.0),
    (False, 0.7, None, 0.95, 0.0),
    (False, 1.0, None, 0.5, 0.0),
    (False, 2.0, None, 0.01, 0.0),
    (False, 1.0, None, 1.0, 0.05),
    (False, 0.9, 50, 0.9, 0.02),
    (True, 0.0, 5, 0.5, 0.1),
]


def _batch(rows, vocab: int, seed: int) -> SamplingBatch:
    g = [r[0] for r in rows]
    return SamplingBatch(
        temperature=torch.tensor([0.0 if gr else r[1] for gr, r in zip(g, rows)], dtype=torch.float32, device=DEV),
        top_p=torch.tensor([r[3] for r in rows], dtype=torch.float32, device=DEV),
        top_k=torch.tensor([vocab if r[2] is None else r[2] for r in rows], dtype=torch.int64, device=DEV),
        min_p=torch.tensor([r[4] for r in rows], dtype=torch.float32, device=DEV),
        seeds=torch.arange(seed, seed + len(rows), dtype=torch.int64, device=DEV) * 7919,
        greedy=torch.tensor(g, dtype=torch.bool, device=DEV),
        all_greedy=False, need_filter=True)


def _logits(rows: int, vocab: int, seed: int, bf16: bool, neg_inf: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, vocab), generator=gen) * 3.0
    if bf16:
        x = x.to(torch.bfloat16).float()  # exact ties
    if neg_inf:
        x[:, 256:512] = float("-inf")  # a whole chunk (SMALL) of masked tokens
        x[1, ::3] = float("-inf")
    return x.to(DEV)


def _args(sb: SamplingBatch):
    return sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy


@pytest.mark.parametrize("bf16,neg_inf,vocab", [(False, False, 700), (True, False, 1000), (True, True, 777)])
def test_probs_match_reference(bf16, neg_inf, vocab):
    x = _logits(len(ROWS), vocab, vocab, bf16, neg_inf)
    sb = _batch(ROWS, vocab, 3)
    want = probs_reference(x, sb)
    got = probs_triton(x, *_args(sb), need_filter=True, **SMALL)
    assert torch.equal(got > 0, want > 0), [(i, int((got[i] > 0).sum()), int((want[i] > 0).sum()))
                                            for i in range(len(ROWS)) if not torch.equal(got[i] > 0, want[i] > 0)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    kept = (want > 0).sum(dim=1).tolist()
    assert kept[0] == 1 and kept[3] == 1 and kept[-1] == 1  # greedy and top-k 1 rows
    assert 1 < kept[6] < vocab and kept[4] >= 20  # the filters do select (>= 20: ties at the boundary kept)


def test_probs_unfiltered_match_reference():
    x = _logits(len(ROWS), 700, 5, False, True)
    sb = _batch(ROWS, 700, 3)
    sb.need_filter = False
    torch.testing.assert_close(probs_triton(x, *_args(sb), need_filter=False, **SMALL), probs_reference(x, sb),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("need_filter", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_sample_matches_reference(need_filter, bf16):
    vocab = 900
    rows = ROWS * 2
    x = _logits(len(rows), vocab, 11 + bf16, bf16, True)
    sb = _batch(rows, vocab, 17)
    sb.need_filter = need_filter
    positions = torch.arange(len(rows), dtype=torch.int64, device=DEV) + 40
    want = sample_from_probs(probs_reference(x, sb), sb.seeds, positions)
    got = sample_triton(x, *_args(sb), sb.seeds, positions, need_filter, **SMALL)
    assert got.tolist() == want.tolist()
    assert got[0] == x[0].argmax() and got[3] == (x[3].argmax() if need_filter else got[3])


def test_sample_draws_across_the_kept_set():
    """Many positions of one top-p row: every draw is in the kept set, and the draws cover more than the argmax."""
    vocab, n = 600, 48
    x = _logits(1, vocab, 2, False, False).expand(n, vocab).contiguous()
    sb = _batch([(False, 1.0, None, 0.9, 0.0)] * n, vocab, 0)
    sb.seeds = torch.full((n,), 5, dtype=torch.int64, device=DEV)
    positions = torch.arange(n, dtype=torch.int64, device=DEV)
    got = sample_triton(x, *_args(sb), sb.seeds, positions, True, **SMALL)
    kept = probs_reference(x[:1], _batch([(False, 1.0, None, 0.9, 0.0)], vocab, 0))[0] > 0
    assert bool(kept[got].all())
    assert len(set(got.tolist())) > 10
    want = sample_from_probs(probs_reference(x, sb), sb.seeds, positions)
    assert got.tolist() == want.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture and production sizes need a GPU")
def test_sample_production_sizes_and_graph():
    vocab = 151936
    rows = ROWS * 3
    sb = _batch(rows, vocab, 1)
    positions = torch.arange(len(rows), dtype=torch.int64, device=DEV)
    x = torch.randn((len(rows), vocab), device=DEV).to(torch.bfloat16).float() * 4
    want_p = probs_reference(x, sb)
    torch.testing.assert_close(probs_triton(x, *_args(sb), True), want_p, atol=1e-6, rtol=1e-5)
    static = x.clone()
    out = sample_triton(static, *_args(sb), sb.seeds, positions, True)  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sample_triton(static, *_args(sb), sb.seeds, positions, True)
    for i in range(3):
        static.copy_(torch.randn_like(x).to(torch.bfloat16).float() * (2 + i))
        graph.replay()
        want = sample_from_probs(probs_reference(static, sb), sb.seeds, positions)
        assert (out == want).float().mean() >= 0.97  # near-ties of the race may round either way on a GPU


def test_startup_check_accepts_the_kernels_and_rejects_wrong_ones(caplog):
    """layers/sampler.py check_sampling_kernels: the model runner's check before first use passes for these kernels
    and turns sampling over to the reference (with an error in the log) for kernels that disagree or fail."""
    import types

    from specserve.kernels import triton_sample
    from specserve.layers import sampler

    assert sampler.check_sampling_kernels(DEV, triton_sample)  # on CPU under the interpreter

    def off_by_one(*a, **kw):
        return triton_sample.sample_triton(*a, **kw) + 1

    def broken(*a, **kw):
        raise RuntimeError("does not compile")

    for wrong in (types.SimpleNamespace(probs_triton=triton_sample.probs_triton, sample_triton=off_by_one),
                  types.SimpleNamespace(probs_triton=broken, sample_triton=triton_sample.sample_triton)):
        with caplog.at_level("ERROR"):
            assert not sampler.check_sampling_kernels(DEV, wrong)
        assert "sampling with torch" in caplog.text
    sampler._KERNELS_OK.clear()


def test_chunk_shrinks_until_the_grid_fills_the_device():
    """kernels/triton_sample.py pick_chunk: few rows get short programs (each pass is latency-bound by one
    program's walk over its chunk), many rows the longest; and every chunk size gives the reference's
    distribution and tokens (the default under the interpreter: the largest)."""
    from specserve.kernels.triton_sample import CHUNKS, pick_chunk

    assert pick_chunk(1, 49152, 264) == 1024
    assert pick_chunk(1, 151936, 264) == 1024
    assert pick_chunk(5, 151936, 264) == 2048  # 5 x 75 chunks
    assert pick_chunk(40, 49152, 264) == 4096  # 40 x 12
    assert pick_chunk(320, 128256, 264) == 4096
    assert pick_chunk(3, 1000, 1) == 4096
    rows = [(False, 0.8, 5, 1.0, 0.0), (False, 1.0, None, 0.9, 0.0), (True, 1.0, None, 1.0, 0.0)]
    vocab = 5000  # two chunks of 4096, five of 1024
    sb = _batch(rows, vocab, seed=5)
    x = _logits(len(rows), vocab, seed=6, bf16=True, neg_inf=False).to(DEV)
    want = probs_reference(x, sb)
    pos = torch.arange(len(rows), dtype=torch.int64, device=DEV) + 7
    want_t = sample_from_probs(want, sb.seeds, pos)
    for chunk in (None, *CHUNKS[1:]):
        got = probs_triton(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, True, chunk=chunk)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        tokens = sample_triton(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, sb.seeds, pos, True,
                               chunk=chunk)
        assert torch.equal(tokens, want_t)
