"""FP8 (e4m3) helpers inside Triton kernels: the rule of reference_moe_fp8._quantize_groups applied to a register
tile (per row and group of columns: the fused MoE's gate/up GEMM quantizes its output, the down GEMM's input, in its
epilogue; per row with a scale known beforehand: the per-channel down GEMM quantizes its act tiles as it loads
them), the e4m3 cast, rounding to a float dtype, and the e4m3 dot.

RNE (set with F32_DOT, i.e. under Triton's interpreter on CPU tensors) rounds explicitly: the interpreter's
float32 -> float8e4nv cast does not round like torch's `.to(torch.float8_e4m3fn)` (triton 3.9: it truncates, and
some values near a binade's top come out a binade low, e.g. 0.1222 -> 0.0625; 7% of random values differ), and its
float32 -> bfloat16 cast truncates. The explicit rounding was checked equal to torch's casts on 2^18 random values
spanning e4m3's whole range, subnormals and ties included. On the GPU the hardware casts (cvt.rn) round to
nearest even like torch, and e4m3 keeps its own type for the tensor-core dot.
"""

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-10)
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: y + M - M rounds |y| < 2^22 to an integer, ties to even


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) -> the nearest e4m3 value (ties to even) as float32: v rounded at its e4m3 ulp,
    2^(exponent - 3), subnormals (below 2^-6) at 2^-9. The ulp is a power of two, so v / ulp and r * ulp are
    exact."""
    exp = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
    ulp = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    return ((v / ulp + _ROUND_MAGIC) - _ROUND_MAGIC) * ulp


@triton.jit
def round_to(v, dt: tl.constexpr, RNE: tl.constexpr):
    """float32 v rounded to dtype dt, returned as float32. RNE: explicit round to nearest even for bfloat16 (the
    interpreter's cast truncates); float32 and the hardware cast pass through tl's cast."""
    if RNE and dt == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # ties to even on the dropped 16 bits
        r = bits.to(tl.float32, bitcast=True)
    else:
        r = v.to(dt).to(tl.float32)
    return r


@triton.jit
def to_e4m3(v, RNE: tl.constexpr):
    """float32 v (|v| <= 448) -> e4m3, rounded to nearest even. RNE: rounded to e4m3's grid in float32 first (the
    interpreter's cast is only right on values it holds exactly), the sign put back by its bit so -0 stays -0 as
    torch keeps it; on the GPU the hardware cast (cvt.rn) rounds so itself."""
    if RNE:
        r = _round_e4m3(v)
        v = tl.where(v.to(tl.int32, bitcast=True) < 0, -tl.abs(r), r)
    return v.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def scale_of(amax):
    """The rule's scale of values of largest magnitude amax (float32, any shape): max(amax, 1e-10) / 448, an IEEE
    division (div_rn, as torch's; Triton's `/` is approximate on the GPU)."""
    return tl.math.div_rn(tl.maximum(amax, MIN_AMAX), tl.full(amax.shape, FP8_MAX, tl.float32))


@triton.jit
def quantize_rows(a, s, RNE: tl.constexpr):
    """a [M, N] float32, s [M] the rows' scales (scale_of their amax over the whole row) -> e4m3 [M, N]:
    clamp(a / s, -448, 448) rounded to nearest even, the division IEEE."""
    q = tl.math.div_rn(a, tl.broadcast_to(s[:, None], a.shape))
    return to_e4m3(tl.clamp(q, -FP8_MAX, FP8_MAX), RNE)


@triton.jit
def quantize_groups(a, GROUPS: tl.constexpr, GROUP: tl.constexpr, RNE: tl.constexpr):
    """a [M, GROUPS * GROUP] float32 (columns past the data must be 0) -> (q [M, GROUPS * GROUP] e4m3, s [M, GROUPS]
    float32), the rule per row and group of GROUP columns: s = max(amax, 1e-10) / 448, q = clamp(a / s, -448, 448)
    in e4m3, so that a ~= q * s. Divisions are IEEE (div_rn) to match torch's; Triton's `/` is approximate on the
    GPU. A GEMM's epilogue quantizes its output tile with it (whole groups a tile: no cross-program amax)."""
    m: tl.constexpr = a.shape[0]
    a3 = tl.reshape(a, [m, GROUPS, GROUP])  # [M, GROUPS, GROUP]
    s = scale_of(tl.max(tl.abs(a3), axis=2))  # [M, GROUPS]
    q = tl.clamp(tl.math.div_rn(a3, tl.broadcast_to(s[:, :, None], a3.shape)), -FP8_MAX, FP8_MAX)
    return to_e4m3(tl.reshape(q, [m, GROUPS * GROUP]), RNE), s


@triton.jit
def dot_e4m3(q, w, F32_DOT: tl.constexpr):
    """q [M, K] e4m3 (quantize_groups'), w [K, N] e4m3 -> q @ w float32 [M, N]. F32_DOT (CPU tensors): both as float32
    (e4m3 values are exact in float32; the interpreter's narrow dots are wrong); else the e4m3 tensor-core dot,
    accumulating in float32; below K = 32 (the e4m3 dot's least K; test-sized 16-wide blocks) as float16, where
    e4m3 values are exact too. if/else, not an early return: the compiler builds the statements after a constexpr
    branch's return too."""
    if F32_DOT:
        r = tl.dot(q.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    elif q.shape[1] < 32:
        r = tl.dot(q.to(tl.float16), w.to(tl.float16), out_dtype=tl.float32)
    else:
        r = tl.dot(q, w, out_dtype=tl.float32)
    return r
