"""The one matrix-product helper of the Triton kernels (attention, MLA, indexer, fused MoE).

`F32_DOT` computes the product in float32 ("ieee"): set for CPU tensors only, where the Triton interpreter's
16-bit tl.dot is wrong (triton 3.9). On the GPU the operands keep their dtype at `PRECISION` ("ieee" for float32
inputs, "tf32" otherwise, as each caller chooses)."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, F32_DOT: tl.constexpr, PRECISION: tl.constexpr):
    # if/else, not an early return: the compiler builds the statements after a constexpr branch's return too, and
    # tl.dot of a float32 a and an e4m3 b (the FP8 MoE's operands under F32_DOT) is not one it accepts
    if F32_DOT:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision=PRECISION)
    return r
