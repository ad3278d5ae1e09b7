"""Where the fused decode GEMVs (kernels/triton_gemv.py) are used under `--decode-gemv auto`: the weight shapes
(rows, K) for which they were measured faster than today's path (cuBLAS plus the separate norm / SiLU-mul / split-K
reduce launches) on the H200 (`python3 scripts/gpu/bench_gemv.py`, BENCHMARKS.md). A layer fuses when all its
projections' shapes are listed. Shapes not listed (not yet swept) keep cuBLAS under `auto`; `--decode-gemv triton`
fuses every dense layer's decode rows regardless (to measure them). At more than one row (verify's N + 1 at batch 1)
`auto` fuses a norm + projection, and an output projection, only up to the rows where its shapes were measured
faster too (FASTER_ROWS: the row-unrolled GEMV of triton_gemv._TUNED_ROWS against cuBLAS, `bench_gemv.py --rows 5
--sweep`)."""

from __future__ import annotations

FASTER: frozenset[tuple[int, int]] = frozenset([
    (576, 576), (576, 1536), (960, 576), (3072, 576),  # SmolLM2-135M
    (4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096),  # Llama-3.1-8B
    (4096, 12288), (24576, 4096),  # Qwen3-8B's MLP (its attention's shapes are Llama-3.1-8B's; BENCHMARKS §34.3)
    (5120, 2048), (2048, 4096),  # Qwen3-30B-A3B attention (swept in BENCHMARKS §19)
    (128, 2048), (513, 2048),  # routers with the norm inside: Qwen3-30B-A3B, Qwen3-Next (+ shared gate) at 1 token
])


# weight shape -> the most rows (2..triton_gemv.ROWS_GEMV_MAX) up to which the fused kernel beat the unfused path at
# every row count measured; shapes not listed fuse at one row only
# (H200, `bench_gemv.py --rows 5 --sweep`, BENCHMARKS.md §21; Llama-3.1-8B's shapes lost at every M: absent)
FASTER_ROWS: dict[tuple[int, int], int] = {
    (576, 576): 5, (576, 1536): 5, (960, 576): 3, (3072, 576): 2,  # SmolLM2-135M: o, down, qkv, gate_up
}


# q|k|v weight shapes (rows, K) whose fused GEMV was measured faster with the attention's q/k prep (rotary + the K/V
# store) in its epilogue (triton_gemv.norm_gemv_rope_store) than with the separate prep launch; 'triton' takes it
# on every layer that can (models/dense.py DenseAttention.prep_fusable), 'auto' only on these (H200, bench-phases
# decode at batch 1 side by side, BENCHMARKS §34.1).
FASTER_PREP: frozenset[tuple[int, int]] = frozenset([(960, 576), (6144, 4096)])  # SmolLM2-135M, Llama-3.1-8B

# The same for layers with per-head q/k norms (Qwen3), whose epilogue has the last program of each head norm and
# rotate it (triton_gemv_rope._norm_rope_head): a different cost, measured apart. None is faster: Qwen3-30B-A3B's qkv
# (5120, 2048) ran its decode step ~0.1 ms slower with it, Qwen3-8B's (6144, 4096) tied (BENCHMARKS §34.2).
FASTER_NORM_PREP: frozenset[tuple[int, int]] = frozenset()


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
