"""Bounded memory for eager prefill attention: a request piece's work goes in blocks (of queries, or of heads) that
each materialise at most a fixed number of values. Rows and heads are independent, so the result does not depend
on the blocking."""

from __future__ import annotations

# The most attention (or index) scores, heads x queries x keys, one eager prefill call materialises: a request
# piece's queries go in blocks under it, so a long prompt's chunk over a long prefix stays bounded in memory
# (8192 queries over 32k keys at 64 heads would be 17 G scores).
MAX_SCORES = 1 << 28


def query_blocks(queries: int, per_query: int, max_scores: int) -> list[tuple[int, int]]:
    """[(start, end)) blocks of `queries` rows with at most max_scores // per_query rows each (at least one)."""
    step = max(1, max_scores // max(per_query, 1))
    return [(a, min(queries, a + step)) for a in range(0, queries, step)]
