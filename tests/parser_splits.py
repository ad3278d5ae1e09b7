"""Ways to cut a text into consecutive pieces, for the parsers' every-split invariant (tests/test_*_parsers.py).

A speculative step commits several tokens at once and a token can end anywhere in a marker, so a streamed answer
can arrive cut at any character: every 2-piece and 3-piece cut of a short text, plus random cuts into many pieces
and one character at a time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

EXHAUSTIVE_3_MAX = 120  # texts up to this long get every 3-piece cut (~7,000 of them at 120 chars)


def two_piece(text: str) -> Iterator[list[str]]:
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def three_piece(text: str) -> Iterator[list[str]]:
    for i in range(1, len(text) - 1):
        for j in range(i + 1, len(text)):
            yield [text[:i], text[i:j], text[j:]]


def random_pieces(text: str, rng: random.Random, max_piece: int = 8) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, max_piece)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def all_splits(text: str, seed: int = 0, randoms: int = 40) -> Iterator[list[str]]:
    """Every 2-piece cut; every 3-piece cut when the text is short (else 1,000 random ones); `randoms` random cuts
    into many pieces; one character at a time."""
    rng = random.Random(seed)
    yield from two_piece(text)
    if len(text) <= EXHAUSTIVE_3_MAX:
        yield from three_piece(text)
    else:
        for _ in range(1000):
            i, j = sorted(rng.sample(range(1, len(text)), 2))
            yield [text[:i], text[i:j], text[j:]]
    for _ in range(randoms):
        yield random_pieces(text, rng)
    yield list(text)
