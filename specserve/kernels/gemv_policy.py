"""Where the fused decode GEMVs (kernels/triton_gemv.py) are used under `--decode-gemv auto`: the weight shapes
(rows, K) for which they were measured faster than today's path (cuBLAS plus the separate norm / SiLU-mul / split-K
reduce launches) on the H200 (`python3 scripts/gpu/bench_gemv.py`, BENCHMARKS.md). A layer fuses when all its
projections' shapes are listed. Empty until measured: `auto` then keeps cuBLAS everywhere; `--decode-gemv triton`
fuses every dense layer's decode rows regardless (to measure them)."""

from __future__ import annotations

FASTER: frozenset[tuple[int, int]] = frozenset()


def prefer_fused(shapes: list[tuple[int, int]]) -> bool:
    """Whether every weight shape [rows, K] given is one the fused kernels beat."""
    return bool(shapes) and all(s in FASTER for s in shapes)
