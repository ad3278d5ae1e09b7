"""The one matrix-product helper of the Triton kernels (attention, MLA, indexer, fused MoE).

`F32_DOT` computes the product in float32 ("ieee"): set for CPU tensors only, where the Triton interpreter's
16-bit tl.dot is wrong (triton 3.9). On the GPU the operands keep their dtype at `PRECISION` ("ieee" for float32
inputs, "tf32" otherwise, as each caller chooses)."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
