"""Per-token x per-channel FP8 GEMM through cuBLAS (torch._scaled_mm with row-wise scales) from a few rows on.

Measured faster than our Triton kernels from verify-sized inputs up (BENCHMARKS.md "FP8": 16 and 4,096 rows on an
H100 and an H200; the GEMV's 16-row tensor-core tile needs a pass over all of K for its per-channel row scales
first; 17..255 rows were not timed), slower than the GEMV at one row. cuBLAS has no 1x128 / 128x128 block-scaled
GEMM in this torch, so block-scaled weights keep the Triton kernels. The activation is quantized by our per-token
quantizer (triton_fp8.quantize_act_tokens_triton: the rule of reference_fp8.quantize_act_tokens, bit for bit), so
both paths multiply the same values; cuBLAS accumulates in float32 (use_fast_accum off). Capturable: no host sync,
shapes only.
"""

from __future__ import annotations

import torch

MIN_ROWS = 5  # fewer rows: fp8_gemv on CUDA cores (triton_fp8._CUDA_CORE_ROWS; faster than cuBLAS at one row)


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
