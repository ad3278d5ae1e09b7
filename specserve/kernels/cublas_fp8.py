"""Per-token x per-channel FP8 GEMM through cuBLAS (torch._scaled_mm with row-wise scales) from a few rows on.

On an H100, at Llama-3.1-8B's projections and 4,096 rows, cuBLAS's row-wise FP8 GEMM ran at 1.3-1.6x bf16 where our
Triton FP8 GEMM ran at 0.80-1.06x; on an H200 at 16 rows (verify rows) it took 0.051 / 0.053 ms at gate_up / down
where fp8_gemv's 16-row tensor-core tile took 0.147 / 0.105 (its per-channel row scales need a pass over all of K
first), and 1.4-1.8x bf16 at 4,096 rows (BENCHMARKS.md "FP8"); 17..255 rows were not timed. cuBLAS has no 1x128 /
128x128 block-scaled GEMM in this torch, so block-scaled weights keep the Triton kernels. The activation is
quantized by our per-token quantizer (triton_fp8.quantize_act_tokens_triton: the rule of
reference_fp8.quantize_act_tokens, bit for bit), so both paths multiply the same values; cuBLAS accumulates in
float32 (use_fast_accum off). Capturable: no host sync, shapes only.
"""

from __future__ import annotations

import torch

MIN_ROWS = 5  # fewer rows: fp8_gemv on CUDA cores (triton_fp8._CUDA_CORE_ROWS = 4; at one row 0.043 ms against
# cuBLAS's 0.054 at the 8B's gate_up on an H200)


def fits(x2: torch.Tensor, wq: torch.Tensor, block: tuple[int, int] | None, bias: torch.Tensor | None) -> bool:
    """x2 [M, K] on CUDA in bfloat16 (row-wise _scaled_mm's output dtype), per-channel weights without a bias (a
    bias added after the bf16 product would round twice, where the Triton epilogue adds it in float32; row-wise
    _scaled_mm's own bias support varies by torch version), M >= MIN_ROWS, and K and N multiples of 16 (cuBLASLt's
    FP8 leading dimensions)."""
    n, k = wq.shape
    return (x2.is_cuda and block is None and bias is None and x2.dtype == torch.bfloat16
            and x2.shape[0] >= MIN_ROWS and n % 16 == 0 and k % 16 == 0)


def fp8_linear_rowwise(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """xq [M, K] e4m3 with per-token scales sx [M], wq [N, K] e4m3 with per-row scales sw [N] -> [M, N] bfloat16."""
    return torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=torch.bfloat16)
