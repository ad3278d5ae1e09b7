"""The split-vocabulary top-1 kernel (kernels/triton_top1.py) against its torch reference: the same argmax (first
index on ties, within and across chunks), the same softmax probability at it, the vocabulary map, rows of -inf
chunks, strided rows, and the caller's output buffer. Outputs are poisoned before each run. On CPU the kernel runs
under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.triton_top1 import row_top1_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab + 5, generator=g)[:, 2:2 + vocab] * 4  # row-strided view
    # coarse values: ties everywhere; plant maxima in the last partial chunk and tied across chunks
    x = x.round()
    x[0, vocab - 1] = 30.0
    if rows > 1 and vocab > 2048:
        x[1, 2100] = x[1, 10] = x[1, 4000 % vocab] = 25.0  # the earliest (chunk 0) must win
    if rows > 2 and vocab > 4096:
        x[2, :2048] = float("-inf")  # a whole chunk of -inf
        x[2, 5] = float("-inf")
    return x.to(DEV)


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 2048), (5, 5000), (4, 16384), (9, 49152)])
@pytest.mark.parametrize("with_prob", [False, True])
@pytest.mark.parametrize("mapped", [False, True])
def test_row_top1_matches_reference(rows, vocab, with_prob, mapped):
    x = _logits(rows, vocab, seed=rows * 100 + vocab)
    vmap = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).to(DEV) * 3 if mapped else None
    want_idx, want_prob = ref.row_top1(x, vmap, with_prob)
    out = torch.full((rows,), -7, dtype=torch.int64, device=DEV)
    idx, prob = row_top1_triton(x, vmap, with_prob, out_idx=out)
    assert idx.data_ptr() == out.data_ptr()
    assert torch.equal(idx, want_idx), (idx, want_idx)
    if with_prob:
        torch.testing.assert_close(prob, want_prob, rtol=1e-5, atol=1e-7)
        assert torch.all((prob > 0) & (prob <= 1))
    else:
        assert prob is None and want_prob is None


def test_row_top1_no_rows():
    idx, prob = row_top1_triton(torch.zeros((0, 100), device=DEV), with_prob=True)
    assert idx.shape == (0,) and prob.shape == (0,)
