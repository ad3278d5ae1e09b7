"""The FP8 KV cache inside Triton kernels (reference: kernels/reference_kv_fp8.py): the store rule, one float32
scale per (token slot, KV head) row of head_dim values, and the reader's dequantization.

Store, per row in float32: s = max(amax, 1e-10) / FMAX (FMAX 448 for e4m3fn, 57344 for e5m2), stored =
clamp(row / s, -FMAX, FMAX) rounded to nearest even in the cache's 8-bit float. A row split over several register
tiles (the prep kernels hold a head as its rotation halves) takes the max of the tiles' amaxes (`tile_amax`).
Read: row = stored * s, in float32, then rounded to the query's dtype for the dot.

Whether a cache is FP8 is a compile-time fact of its pointer's element type (`k_cache_ptr.dtype.element_ty.is_fp8()`
in the kernels), so the kernels of a bfloat16 / float32 cache compile exactly as before. RNE (set with F32_DOT, i.e.
for CPU tensors under Triton's interpreter) rounds explicitly: the interpreter's float32 -> float8 cast truncates and
may drop a binade, and its float32 -> bfloat16 cast truncates (kernels/triton_fp8_tiles.py); values that are exactly
representable cast and load exactly (checked for every finite code of both formats). On the GPU the hardware casts
round to nearest even.
"""

import triton
import triton.language as tl

from specserve.kernels.triton_fp8_tiles import round_to

MIN_AMAX = tl.constexpr(1e-10)
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: y + M - M rounds |y| < 2^22 to an integer, ties to even


@triton.jit
def _fmax(dt: tl.constexpr):
    """The largest finite value of the 8-bit float dt (float8e5: 57344, float8e4nv: 448)."""
    if dt == tl.float8e5:
        r = 57344.0
    else:
        r = 448.0
    return r


@triton.jit
def _round_fp8(v, dt: tl.constexpr):
    """float32 v (|v| <= dt's max) -> the nearest value of dt (ties to even) as float32: v rounded at its ulp
    2^(exponent - mantissa bits), below the smallest normal exponent at the subnormal ulp. The ulp is a power of
    two, so v / ulp and r * ulp are exact."""
    if dt == tl.float8e5:
        exp = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -14) - 2
    else:
        exp = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
    ulp = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    return ((v / ulp + _ROUND_MAGIC) - _ROUND_MAGIC) * ulp


@triton.jit
def tile_amax(x):
    """x [R, C] float32 -> [R] max |x| of each row (padding columns must be 0)."""
    return tl.max(tl.abs(x), axis=1)


@triton.jit
def fp8_scale(amax, dt: tl.constexpr):
    """[R] row amax -> [R] float32 scales for the 8-bit float dt. IEEE division (div_rn), as torch's."""
    return tl.math.div_rn(tl.maximum(amax, MIN_AMAX), _fmax(dt))


@triton.jit
def fp8_quantize(x, s, dt: tl.constexpr, RNE: tl.constexpr):
    """x [R, C] float32, s [R] scales -> [R, C] in dt: clamp(x / s) rounded to nearest even."""
    fmax = _fmax(dt)
    y = tl.clamp(tl.math.div_rn(x, s[:, None]), -fmax, fmax)
    if RNE:
        y = _round_fp8(y, dt)
    return y.to(dt)


@triton.jit
def store_rows_fp8(ptrs, x, mask, scale_ptrs, row_ok, RNE: tl.constexpr):
    """Quantize the rows of x [R, C] (float32, whole rows in one tile; masked-out columns 0) and store them at ptrs
    [R, C] (an fp8 cache) where mask, their scales at scale_ptrs [R] where row_ok."""
    s = fp8_scale(tile_amax(tl.where(mask, x, 0.0)), ptrs.dtype.element_ty)
    tl.store(ptrs, fp8_quantize(x, s, ptrs.dtype.element_ty, RNE), mask=mask)
    tl.store(scale_ptrs, s, mask=row_ok)


@triton.jit
def dequantize(x, s, dt: tl.constexpr, RNE: tl.constexpr):
    """x [R, C] loaded from an fp8 cache, s [R] its scales -> x * s rounded to dt (the query's dtype)."""
    return round_to(x.to(tl.float32) * s[:, None], dt, RNE).to(dt)
