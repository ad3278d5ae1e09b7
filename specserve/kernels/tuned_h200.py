"""The kernels' per-shape tuned launch tables, in one place.

Every table here was tuned on an NVIDIA H200 (132 SMs) with triton 3.6, and applies on every CUDA device: the
launch configurations are functions of the shapes alone, so a CUDA graph captured anywhere launches the same
kernels. On another card they are correct but may not be the fastest; re-tune with the script named at each table
and paste what it prints here. Constants that are not tuning (tile sizes a kernel's correctness dictates, buffer and
counter sizes) stay in their kernel's file.

Tables:
  * GEMV_TUNED, GEMV_TUNED_ROWS: kernels/triton_gemv.py's launches at one row and, row-unrolled, at 2..8 rows.
  * SMS: the SM count triton_gemv's heuristic launches aim their program counts at.
  * GEMV_PDL_MAX_BYTES, GEMV_PDL_SHAPES: which GEMVs launch with programmatic dependent launch.
  * FASTER, FASTER_ROWS, FASTER_PREP, FASTER_NORM_PREP: where `--decode-gemv auto` takes the fused GEMVs
    (kernels/gemv_policy.py).
  * MOE_TILES, MOE_FP8_TILES: the grouped-GEMM tiles by rows per block of kernels/triton_moe.py (bf16)
    and kernels/triton_moe_fp8.py (FP8, untuned).
  * ROUTER: kernels/triton_router.py's launch shape rules.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------------------------
# kernels/triton_gemv.py
# ---------------------------------------------------------------------------------------------------------------

# Launch configurations of the GEMV at one row (M = 1), keyed by the weight's (rows, K) (rows: 2I for silu_mul's
# gate_up weight). Re-tune: `python3 scripts/gpu/bench_gemv.py --sweep --shapes llama-3.1-8b smollm2-135m
# qwen3-30b-a3b`, which prints this dict. LATE_RSTD=1 is added by hand (the sweep does not try it): SmolLM2's norm
# GEMVs (K = 576) measured faster with the RMSNorm statistics summed in the K loop; the larger K of Llama-3.1-8B,
# Qwen3-8B and Qwen3-30B-A3B measured slower with it. Shapes not listed take triton_gemv's heuristic.
GEMV_TUNED: dict[tuple[int, int], dict[str, int]] = {
    (6144, 4096): dict(BLOCK_N=16, BLOCK_K=1024, num_warps=4, num_stages=2),
    (4096, 4096): dict(BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=3),
    (28672, 4096): dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4),
    (4096, 14336): dict(BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=3),
    (960, 576): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, LATE_RSTD=1),
    (576, 576): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=2, num_stages=3),
    (3072, 576): dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=1, LATE_RSTD=1),
    (576, 1536): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=8, num_stages=1),
    (5120, 2048): dict(BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=2),
    (2048, 4096): dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, num_stages=4),
}

# Launch configurations of the row-unrolled GEMV for 2..triton_gemv.ROWS_GEMV_MAX rows, keyed by the weight's
# (rows, K). Re-tune: `python3 scripts/gpu/bench_gemv.py --rows 2 3 4 5 --sweep --shapes smollm2-135m llama-3.1-8b`,
# which prints this dict and FASTER_ROWS. Only SmolLM2's shapes are listed: on Llama-3.1-8B's the row-unrolled GEMV
# lost to cuBLAS at every row count, so those shapes keep the skinny GEMM at more than one row.
GEMV_TUNED_ROWS: dict[tuple[int, int], dict[str, int]] = {
    (960, 576): dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=1),
    (576, 576): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
    (3072, 576): dict(BLOCK_N=4, BLOCK_K=128, num_warps=4, num_stages=4),
    (576, 1536): dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=1),
}

# The SM count the GEMV's heuristic launches (shapes not in the tables) aim at: several programs on every SM of the
# tuning card. A constant, not the device's count, so the launch depends on shapes alone.
SMS = 132

# Weights up to which a GEMV is latency-bound enough for programmatic dependent launch to pay, and the larger weight
# shapes (rows, K) measured faster with it in the decode step: Llama-3.1-8B's (and Qwen3-8B's) o projection. A
# larger byte bound would also take Qwen3-30B-A3B's qkv and o, and Llama-3.1-8B's qkv, whose decode steps it
# slowed. Re-tune: the decode step side by side with and without (`scripts/gpu/profile_decode.py`, or
# `specserve bench-phases`), on copies of the tree that change these two.
GEMV_PDL_MAX_BYTES = 8 << 20
GEMV_PDL_SHAPES: frozenset[tuple[int, int]] = frozenset([(4096, 4096)])

# ---------------------------------------------------------------------------------------------------------------
# kernels/gemv_policy.py (`--decode-gemv auto`)
# ---------------------------------------------------------------------------------------------------------------

# Weight shapes (rows, K) on which the fused GEMVs (with GEMV_TUNED's launches) measured faster than cuBLAS plus the
# separate norm / SiLU-and-mul launches. Re-tune: `python3 scripts/gpu/bench_gemv.py --sweep`, which prints this
# set. Qwen3-8B's MLP and Qwen3-30B-A3B's attention take the heuristic launches (not swept) and still measured
# faster in the decode step; the routers are the norm-fused router GEMVs at one token.
FASTER: frozenset[tuple[int, int]] = frozenset([
    (576, 576), (576, 1536), (960, 576), (3072, 576),  # SmolLM2-135M
    (4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096),  # Llama-3.1-8B
    (4096, 12288), (24576, 4096),  # Qwen3-8B's MLP (its attention's shapes are Llama-3.1-8B's)
    (5120, 2048), (2048, 4096),  # Qwen3-30B-A3B attention
    (128, 2048), (513, 2048),  # routers with the norm inside: Qwen3-30B-A3B, Qwen3-Next (+ shared gate) at 1 token
])

# Weight shape -> the most rows (2..triton_gemv.ROWS_GEMV_MAX) up to which the row-unrolled GEMV (GEMV_TUNED_ROWS)
# beat the unfused path at every row count measured; shapes not listed fuse at one row only. Re-tune with
# GEMV_TUNED_ROWS's command, which prints it.
FASTER_ROWS: dict[tuple[int, int], int] = {
    (576, 576): 5, (576, 1536): 5, (960, 576): 3, (3072, 576): 2,  # SmolLM2-135M: o, down, qkv, gate_up
}

# q|k|v weight shapes whose fused GEMV measured faster with the attention's q/k prep (rotary + the K/V store) in
# its epilogue (triton_gemv.norm_gemv_rope_store) than with the separate prep launch. Re-tune: the decode step at
# batch 1 side by side with and without (`specserve bench-phases`, decode), on copies that change this set.
FASTER_PREP: frozenset[tuple[int, int]] = frozenset([(960, 576), (6144, 4096)])  # SmolLM2-135M, Llama-3.1-8B

# The same for layers with per-head q/k norms (Qwen3), whose epilogue also norms each head: a different cost,
# measured apart. None is faster: Qwen3-30B-A3B's qkv ran its decode step slower with it, Qwen3-8B's tied.
FASTER_NORM_PREP: frozenset[tuple[int, int]] = frozenset()

# ---------------------------------------------------------------------------------------------------------------
# kernels/triton_moe.py
# ---------------------------------------------------------------------------------------------------------------

# Rows per block (at most, in order) -> the (gate/up, down) GEMMs' tiles, warps and stages; blocks of more rows
# take the last entry. Up to 64 rows the GEMMs stream weights and the tiles tried measured within a few percent of
# each other; at 128 rows (prefill) wide tiles with 8 warps were the fastest tried. Re-tune: `python3
# scripts/gpu/bench_moe.py --sweep --tokens 1 8 64 512`.
MOE_TILES: dict[int, tuple[dict[str, int], dict[str, int]]] = {
    16: (dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
         dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)),
    64: (dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
         dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)),
    128: (dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
          dict(BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)),
}

# The FP8 (W8A8, block-scaled) path's tiles, as MOE_TILES: rows per block (at most, in order) -> (gate/up, down).
# UNTUNED: chosen on paper for sm_90 (pipeline stages within the shared memory, 16-byte loads), not yet timed.
# BLOCK_K is a multiple of the weights' scale block width bk (a K step is BLOCK_K / bk scale groups, each its own
# e4m3 dot; entries are for bk = 128 and are raised to bk where it is wider); the gate/up BLOCK_N is a multiple of bk
# too (its epilogue quantizes whole groups of the act; entries are raised to bk). e4m3 tiles of BLOCK_K = 128 are
# 128 bytes a row: 16-byte loads. Shared memory: Triton's pipeliner keeps num_stages - 1 K steps in flight, each
# gate/up BLOCK_M x BLOCK_K + 2 x BLOCK_K x BLOCK_N bytes (x, gate and up tiles), down BLOCK_M x BLOCK_K + BLOCK_K x
# BLOCK_N; Triton's sm_90 compile of Qwen3-30B-A3B's shapes (read from the compiled metadata, not run) gives 16 rows:
# gate/up 103 KB, down 60 KB; 64 rows: 121 KB, 97 KB (the H100 allows 227 KB a program; both pipelined with
# cp.async, e4m3 mma.sync at 16 rows, wgmma at 64). Sweep: `python3 scripts/gpu/bench_moe.py --fp8 --sweep --tokens
# 1 8 64 512` times each GEMM's configs at each T and prints the fastest pair as an entry of this table, keyed by the
# T's rows per block (Qwen3-30B-A3B's 128 experts, top 8: 16 rows at T 1 (the direct path), 8 and 64; 64 at T 512);
# where T 1 and T 8/64 disagree on the 16 entry, the decode sizes matter most. Per-channel FP8 experts (no scale
# groups) take the same entries as they are (triton_moe_fp8.fp8_channel_configs): its K step is a plain e4m3 dot,
# and the down GEMM also quantizes its act tile each step (BLOCK_M x BLOCK_K values, cheap beside the weight
# tile's load).
MOE_FP8_TILES: dict[int, tuple[dict[str, int], dict[str, int]]] = {
    16: (dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
         dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4)),
    64: (dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
         dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)),
    128: (dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
          dict(BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3)),
}

# ---------------------------------------------------------------------------------------------------------------
# kernels/triton_router.py
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterTuning:
    """The router kernel's launch shape rules (triton_router.router_config), tuned at hidden size 2048 and 1 to 16
    tokens: many small programs win. Re-tune: `python3 scripts/gpu/bench_router.py --sweep`."""

    few_tokens: int = 2  # up to this many tokens, the expert columns are spread over more programs
    row_programs_few: int = 512  # weight rows a program: the largest power of two <= columns / this (at least 1)
    row_programs: int = 256  # ... above few_tokens
    one_token_up_to: int = 4  # up to this many tokens, one token a program
    one_token_experts_over: int = 256  # and at more (padded) experts than this: a token's top-k is costly
    token_block: int = 4  # otherwise tokens a program


ROUTER = RouterTuning()
