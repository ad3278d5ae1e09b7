"""Where the fused decode GEMVs (kernels/triton_gemv.py) are used under `--decode-gemv auto`: the weight shapes
(rows, K) for which they were measured faster than the unfused path (cuBLAS plus the separate norm / SiLU-mul /
split-K reduce launches). The shape sets (FASTER, FASTER_ROWS, FASTER_PREP, FASTER_NORM_PREP) are tuned tables and
live in kernels/tuned_h200.py, with how to re-tune them. A layer fuses when all its projections' shapes are listed;
shapes not listed (not yet swept) keep cuBLAS under `auto`; `--decode-gemv triton` fuses every dense layer's decode
rows regardless (to measure them). At more than one row (verify's N + 1 at batch 1) `auto` fuses a norm +
projection, and an output projection, only up to the rows where its shapes were measured faster too (FASTER_ROWS).
The q/k prep rides in the qkv GEMV's epilogue under `auto` only on FASTER_PREP's shapes (FASTER_NORM_PREP's for
layers with per-head q/k norms)."""

from __future__ import annotations

from specserve.kernels.tuned_h200 import FASTER, FASTER_NORM_PREP, FASTER_PREP, FASTER_ROWS

__all__ = ["FASTER", "FASTER_NORM_PREP", "FASTER_PREP", "FASTER_ROWS", "fused_rows", "prefer_fused"]


def prefer_fused(shapes: list[tuple[int, int]], measured: frozenset[tuple[int, int]] = FASTER) -> bool:
    """Whether every weight shape [rows, K] given is one the fused kernels beat (measured: FASTER, or FASTER_PREP /
    FASTER_NORM_PREP for the q/k prep in the qkv GEMV)."""
    return bool(shapes) and all(s in measured for s in shapes)


def fused_rows(shapes: list[tuple[int, int]]) -> int:
    """The most rows a layer whose fused projections have these weight shapes runs fused under `auto`: 0 unless
    every shape is in FASTER, else the least FASTER_ROWS over them (1 for a shape measured at one row only)."""
    if not prefer_fused(shapes):
        return 0
    return min(FASTER_ROWS.get(s, 1) for s in shapes)
