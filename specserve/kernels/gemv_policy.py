"""Where the fused decode GEMVs (kernels/triton_gemv.py) are used under `--decode-gemv auto`: the weight shapes
(rows, K) for which they were measured faster than today's path (cuBLAS plus the separate norm / SiLU-mul / split-K
reduce launches) on the H200 (`python3 scripts/gpu/bench_gemv.py`, BENCHMARKS.md). A layer fuses when all its
projections' shapes are listed. Shapes not listed (not yet swept) keep cuBLAS under `auto`; `--decode-gemv triton`
fuses every dense layer's decode rows regardless (to measure them)."""

from __future__ import annotations

FASTER: frozenset[tuple[int, int]] = frozenset([
    (576, 576), (576, 1536), (960, 576), (3072, 576),  # SmolLM2-135M
    (4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096),  # Llama-3.1-8B
    (5120, 2048), (2048, 4096),  # Qwen3-30B-A3B attention (swept in BENCHMARKS §19)
    (128, 2048), (513, 2048),  # routers with the norm inside: Qwen3-30B-A3B, Qwen3-Next (+ shared gate) at 1 token
])


def prefer_fused(shapes: list[tuple[int, int]]) -> bool:
    """Whether every weight shape [rows, K] given is one the fused kernels beat."""
    return bool(shapes) and all(s in FASTER for s in shapes)
