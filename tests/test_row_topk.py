"""The two-stage top-k (kernels/ops.py topk_two_stage) that row_topk takes on CUDA for long rows: torch.topk's
values and indices exactly when a row's values are distinct; with exact ties the same values, indices that point
at them, no index twice and none into the padding."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.ops import row_topk, topk_two_stage


@pytest.mark.parametrize("rows, vocab, k, chunk", [(1, 4096, 32, 256), (3, 5000, 32, 512), (5, 1000, 7, 64),
                                                     (2, 49152, 32, 1024), (4, 300, 16, 256)])
def test_distinct_values_match_torch_topk(rows, vocab, k, chunk):
    g = torch.Generator().manual_seed(rows * vocab + k)
    x = torch.randperm(rows * vocab, generator=g).view(rows, vocab).float() / 7.0  # distinct values
    vals, idx = topk_two_stage(x, k, chunk)
    ref_vals, ref_idx = x.topk(k, dim=-1)
    assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx)


@pytest.mark.parametrize("vocab, chunk", [(4096, 256), (1000, 64)])
def test_ties_give_the_same_values_at_real_indices(vocab, chunk):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 6, (4, vocab), generator=g).float()  # exact ties everywhere, also across chunks
    x[1, -3:] = 9.0  # the largest values in the last, padded chunk
    vals, idx = topk_two_stage(x, 32, chunk)
    assert torch.equal(vals, x.topk(32, dim=-1).values)
    assert int(idx.max()) < vocab and torch.equal(x.gather(1, idx), vals)
    assert all(len(set(row)) == 32 for row in idx.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_row_topk_on_cuda_matches_torch_topk_under_a_graph():
    """On CUDA the draft's candidates (SmolLM2's 49152 and Qwen's 151936 vocabularies) go in two stages, also
    inside a captured graph; the result is torch.topk's."""
    for vocab in (49152, 151936):
        x = torch.randperm(2 * vocab, device="cuda").view(2, vocab).float()
        ref_vals, ref_idx = x.topk(32, dim=-1)
        g = torch.cuda.CUDAGraph()
        row_topk(x, 32)  # warm-up outside the capture
        with torch.cuda.graph(g):
            vals, idx = row_topk(x, 32)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(vals, ref_vals) and torch.equal(idx, ref_idx), vocab
