"""Triton context-lookup kernel against speculative/ngram.py: identical drafts to choose_drafts(ngram_continuation(...))
on random histories over a tiny vocabulary (matches everywhere), widths within and beyond one block, `last` at the
start, middle and end of the row, -1 padding past `last`, patterns holding -1, rows with a trigram, with only a
bigram and with nothing, and confidences at and around the head's. On CPU it runs under Triton's interpreter
(conftest.py), like the other Triton tests."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from specserve.kernels.triton_ngram import lookup_drafts_triton  # noqa: E402
from specserve.speculative.ngram import choose_drafts, ngram_continuation  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check(hist, last, p2, p1, p0, head, conf, confidence) -> torch.Tensor:
    """Kernel == reference on these CPU inputs; returns the reference continuation [B]."""
    cont = ngram_continuation(hist, last, p2, p1, p0)
    want = choose_drafts(head, conf, cont, confidence)
    got = lookup_drafts_triton(*(t.to(DEV) for t in (hist, last, p2, p1, p0, head, conf)), confidence)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), (got, want, cont, last)
    return cont


def _kinds(hist, last, p2, p1, p0) -> list[str]:
    """Per row: 'tri' when the pattern's trigram occurs (continuation committed), else 'big' or 'none'."""
    out = []
    for b in range(hist.shape[0]):
        h, n = hist[b].tolist(), int(last[b])
        pats = [[int(p2[b]), int(p1[b]), int(p0[b])], [int(p1[b]), int(p0[b])]]
        hit = [min(p) >= 0 and any(h[j:j + len(p)] == p for j in range(n - len(p) + 1)) for p in pats]
        out.append("tri" if hit[0] else "big" if hit[1] else "none")
    return out


def _pick_last(rng: random.Random, width: int) -> int:
    """The last committed index: the first tokens, a short context (where a trigram is often missing but a bigram
    is not), or anywhere up to the end of the row."""
    r = rng.random()
    if r < 0.2:
        return rng.choice([-1, 0, 1, 2, 3])
    if r < 0.45:
        return rng.randrange(4, 40)
    return rng.choice([rng.randrange(width), width - 2, width - 1])


@pytest.mark.parametrize("seed", range(6))
def test_lookup_drafts_matches_reference_random(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    kinds, conts = [], []
    for case in range(12):
        vocab = rng.choice([5, 6, 8])
        bs = rng.randint(1, 17)
        width = rng.choice([4, 50, 1023, 1025, 2100, 3001])
        hist = torch.randint(0, vocab, (bs, width), generator=g)
        last = torch.tensor([_pick_last(rng, width) for _ in range(bs)]).clamp(max=width - 1)
        for b in range(bs):
            if rng.random() < 0.5:
                hist[b, int(last[b]) + 1:] = -1  # the engine's history is -1 past the committed tokens
        # patterns: often the row's own tail (a trigram exists), else random tokens, sometimes -1 (short context)
        pats = []
        for b in range(bs):
            n = int(last[b])
            tail = [int(hist[b, i]) if i >= 0 else -1 for i in (n - 2, n - 1, n)]
            pat = tail if rng.random() < 0.4 else [rng.randrange(vocab) for _ in range(3)]
            r = rng.random()
            if r < 0.15:
                pat[0 if r < 0.1 else rng.choice([1, 2])] = -1  # p2 = -1 leaves the bigram; p1/p0 = -1: no match
            pats.append(pat)
        p2, p1, p0 = (torch.tensor(c, dtype=torch.int64) for c in zip(*pats))
        head = torch.randint(100, 110, (bs,), generator=g)
        confidence = rng.choice([0.0, 0.3, 0.5, 0.7, 1.0])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        conf = torch.tensor([rng.choice([0.0, 1.0, confidence, rng.random()]) for _ in range(bs)], dtype=dtype)
        conts += _check(hist, last, p2, p1, p0, head, conf, confidence).tolist()
        kinds += _kinds(hist, last, p2, p1, p0)
        if case == 0:  # a strided view of a wider table (the row stride is not the width)
            wide = torch.cat([hist, torch.randint(0, vocab, (bs, 7), generator=g)], dim=1)
            _check(wide[:, :width], last, p2, p1, p0, head, conf, confidence)
    assert {"tri", "big", "none"} <= set(kinds), kinds  # every path of the search is exercised
    assert sum(c >= 0 for c in conts) > len(conts) // 4


def test_lookup_drafts_handmade_cases():
    blk = 1024
    width = 2 * blk + 37
    hist = torch.zeros(11, width, dtype=torch.int64)
    rows = []  # (last, (p2, p1, p0), expected continuation)
    # 0: newest occurrence wins; a trigram beats a newer bigram (the example of test_ngram.py)
    hist[0, :12] = torch.tensor([7, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 0])
    rows.append((11, (7, 1, 2), 3))
    # 1: trigram deep in the first block, bigrams in every newer block: the scan must not stop at a bigram
    hist[1, 5:9] = torch.tensor([7, 1, 2, 3])
    for j in (blk + 3, 2 * blk + 5):
        hist[1, j:j + 3] = torch.tensor([1, 2, 4])
    rows.append((width - 1, (7, 1, 2), 3))
    # 2: only a bigram, in the first block, continuation at the block edge
    hist[2, blk - 2:blk + 1] = torch.tensor([1, 2, 6])
    rows.append((width - 1, (9, 1, 2), 6))
    # 3: a trigram straddling the boundary of the last two blocks (scanned from the end of the row)
    s = (width - 1) - 1 - blk - 1
    hist[3, s:s + 4] = torch.tensor([7, 1, 2, 5])
    rows.append((width - 1, (7, 1, 2), 5))
    # 4: the continuation would be just past `last`: no match; the older bigram still counts
    hist[4, 3:6] = torch.tensor([1, 2, 8])
    hist[4, 20:23] = torch.tensor([7, 1, 2])
    rows.append((22, (7, 1, 2), 8))
    # 5: p2 = -1 (two committed tokens): bigram only, at index 0 with last = 2
    hist[5, :3] = torch.tensor([1, 2, 6])
    rows.append((2, (-1, 1, 2), 6))
    # 6: last = 1: nothing can be continued
    hist[6, :2] = torch.tensor([1, 2])
    rows.append((1, (1, 1, 2), -1))
    # 7: last = 0 and p1 = -1: no match, no read past the row
    rows.append((0, (-1, -1, 0), -1))
    # 8: patterns made of -1 never match the -1 padding past last
    hist[8, 10:] = -1
    rows.append((9, (-1, -1, -1), -1))
    # 9: no trigram, bigrams in two blocks: the newer one wins although the scan goes on for a trigram
    hist[9, 10:13] = torch.tensor([1, 2, 4])
    hist[9, blk + 10:blk + 13] = torch.tensor([1, 2, 5])
    rows.append((width - 1, (7, 1, 2), 5))
    # 10: `last` past the row (never in the engine): read as the row's end, as the reference does
    hist[10, width - 4:] = torch.tensor([7, 1, 2, 3])
    rows.append((width + 100, (7, 1, 2), 3))
    last = torch.tensor([r[0] for r in rows])
    p2, p1, p0 = (torch.tensor(c) for c in zip(*(r[1] for r in rows)))
    head = torch.full((len(rows),), 42)
    conf = torch.full((len(rows),), 0.25)
    assert ngram_continuation(hist, last, p2, p1, p0).tolist() == [r[2] for r in rows]
    for confidence in (0.0, 0.25, 0.2500001, 1.0):  # equal to the head's confidence: the head's token
        _check(hist, last, p2, p1, p0, head, conf, confidence)
    # torch compares in head_conf's dtype: bfloat16(0.7) < 0.7 is False there
    _check(hist, last, p2, p1, p0, head, torch.full((len(rows),), 0.7, dtype=torch.bfloat16), 0.7)
    _check(hist, last, p2, p1, p0, head, torch.full((len(rows),), 0.7), 0.7)
    empty = torch.zeros(0, dtype=torch.int64)
    assert lookup_drafts_triton(torch.zeros(0, 8, dtype=torch.int64, device=DEV), *(empty.to(DEV),) * 5,
                                torch.zeros(0, device=DEV), 0.5).shape == (0,)
