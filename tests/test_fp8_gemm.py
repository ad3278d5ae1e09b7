"""FP8 (W8A8 e4m3) linear layers: the quantisation rule of kernels/reference_fp8.py, and the Triton kernels of
kernels/triton_fp8.py against it on the same quantised inputs (quantisers bit for bit; products up to float32
summation order). Shapes cover M in {1, 3, 16, 17, 64} (the GEMV's CUDA-core and tensor-core tiles, the GEMM), N and
K not multiples of the weight block (nor of the GEMV's tiles: its split-K launches at small shapes too), blocks
(16, 16), (32, 32), (128, 128) and per-channel scales, bias or none, x in float32 and bfloat16. On CPU the kernels
run under Triton's interpreter (conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from specserve.kernels import ops  # noqa: E402
from specserve.kernels import reference_fp8 as rf  # noqa: E402
from specserve.kernels import triton_fp8 as tf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = rf.FP8
BLOCKS = [(16, 16), (32, 32), (128, 128), None]
SHAPES = {(16, 16): (80, 96), (32, 32): (80, 96), (128, 128): (160, 288), None: (80, 96)}  # (N, K): partial blocks
# Same quantised inputs on both sides, float32 sums: the interpreter's (F32_DOT) differ only in summation order,
# relative to the sum of magnitudes well under 1e-5. On sm_90 an fp8 MMA sums each K step of up to 128 products in
# the tensor core's narrower accumulator before the float32 add (triton_fp8's module doc): about 2^-13 of the
# step's magnitudes, bounded here by 5e-4.
SUM_TOL = 1e-5 if DEV.type == "cpu" else 5e-4
BF16_ULP = 2.0 ** -8  # one bfloat16 ulp, relative (at worst: at the bottom of a binade)
E4M3_REL = 2.0 ** -4  # e4m3's rounding error, relative, for normal values (3 mantissa bits: half an ulp)
E4M3_SUBNORMAL_STEP = 2.0 ** -9  # e4m3's smallest subnormal: the absolute step below 2^-6


def _weights(n: int, k: int, block, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(DEV)
    return rf.quantize_weight_channels(w) if block is None else rf.quantize_weight_blocks(w, block)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(DEV, dtype)


def _dequant_x(xq: torch.Tensor, sx: torch.Tensor, block) -> torch.Tensor:
    """xq [M, K] with sx ([M] or [M, G]) -> [M, K] float32."""
    if block is None:
        return xq.float() * sx[:, None]
    return xq.float() * sx.repeat_interleave(block[1], 1)[:, :xq.shape[1]]


def _check_product(got: torch.Tensor, xd: torch.Tensor, wd: torch.Tensor, bias: torch.Tensor | None) -> None:
    """got [M, N] (float32 or bf16) against xd @ wd^T + bias in float64: within SUM_TOL of the sum of magnitudes,
    plus one output ulp for a 16-bit output."""
    want = xd.double() @ wd.double().t()
    mag = xd.double().abs() @ wd.double().abs().t()
    if bias is not None:
        want = want + bias.double()
        mag = mag + bias.double().abs()
    tol = SUM_TOL * mag + (BF16_ULP * want.abs() if got.dtype == torch.bfloat16 else 0.0) + 1e-30
    err = (got.double() - want).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item():.3g}, worst ratio {(err / tol).max().item():.3g}"


# (a) the rule ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", [16, 128, None])
def test_reference_quantisation_round_trips_within_e4m3_error(group):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 300, generator=g) * torch.exp(torch.randn(9, 300, generator=g) * 2)  # wide magnitudes
    x[2, :40] = 0.0  # a zero group: a tiny scale, zeros out
    xq, sx = rf.quantize_act_tokens(x) if group is None else rf.quantize_act_groups(x, group)
    xd = _dequant_x(xq, sx, None if group is None else (group, group))
    s_each = sx[:, None].expand_as(x) if group is None else sx.repeat_interleave(group, 1)[:, :300]
    # normal values: half an ulp of 3 mantissa bits; below 2^-6 (in units of s) subnormals: half of 2^-9 s
    assert bool(((xd - x).abs() <= E4M3_REL * x.abs() + E4M3_SUBNORMAL_STEP / 2 * s_each + 1e-30).all())
    # the scale is the group's amax / 448, so each group's largest magnitude maps exactly onto 448
    amax = x.abs().amax(1) if group is None else torch.nn.functional.pad(x, (0, -300 % group)).abs().view(
        9, -1, group).amax(2)
    assert torch.equal(sx, amax.clamp_min(rf.MIN_AMAX) / 448.0)
    assert float(xq.float().abs().max()) == 448.0
    assert not bool(xq.float()[2, :16].any())


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, EXACT_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tf._to_e4m3(tl.load(x_ptr + i, mask=i < n, other=0.0), EXACT_FIRST), mask=i < n)


def test_kernel_cast_to_e4m3_equals_torch_bit_for_bit():
    """The kernels' float32 -> e4m3 rounding against torch's on Gaussian and wide-range values, every e4m3 value,
    every midpoint between neighbours (ties to even) and the float32 values either side of it, and -0."""
    g = torch.Generator().manual_seed(4)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[torch.isfinite(grid)].unique()  # [-448, 448]
    mid = (grid[1:] + grid[:-1]) / 2
    wide = torch.randn(20000, generator=g) * torch.exp(torch.randn(20000, generator=g) * 4)
    x = torch.cat([torch.randn(20000, generator=g) * 100, wide, grid, mid, torch.nextafter(mid, grid[1:]),
                   torch.nextafter(mid, grid[:-1]), torch.tensor([-0.0])]).clamp(-448, 448).to(DEV)
    y = torch.empty(x.numel(), dtype=FP8, device=DEV)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), EXACT_FIRST=not x.is_cuda, BLOCK=1024)
    want = x.to(FP8)
    bad = (y.view(torch.uint8) != want.view(torch.uint8)).nonzero()[:5, 0]
    assert bad.numel() == 0, f"{x[bad].tolist()} -> {y[bad].float().tolist()}, torch {want[bad].float().tolist()}"


# (b) every launcher against the reference on the same quantised inputs ---------------------------------------------

@pytest.mark.parametrize("group", [16, 32, 128, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantisers_equal_the_reference_bit_for_bit(group, dtype):
    x = _x(17, 300, dtype)
    x[3, 5:70] = 0.0
    if group is None:
        got, want = tf.quantize_act_tokens_triton(x), rf.quantize_act_tokens(x)
    else:
        got, want = tf.quantize_act_groups_triton(x, group), rf.quantize_act_groups(x, group)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, True), (torch.bfloat16, False)])
def test_fp8_gemm_equals_the_reference_on_the_same_quantised_inputs(block, m, dtype, with_bias):
    n, k = SHAPES[block]
    wq, sw = _weights(n, k, block)
    x = _x(m, k, dtype)
    bias = torch.randn(n).to(DEV, dtype) if with_bias else None
    xq, sx = rf.quantize_act_tokens(x) if block is None else rf.quantize_act_groups(x, block[1])
    y = tf.fp8_gemm(xq, sx, wq, sw, block, bias, dtype)
    assert y.shape == (m, n) and y.dtype == dtype
    _check_product(y, _dequant_x(xq, sx, block), rf.dequantize_weight(wq, sw, block), bias)


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("dtype,with_bias", [(torch.bfloat16, True), (torch.float32, False)])
def test_fp8_linear_equals_the_reference(block, m, dtype, with_bias):
    """The front door (fp8_gemv up to 16 rows, quantise + fp8_gemm above) against fp8_linear_ref: the kernels
    quantise x bit for bit as the reference does, so both products are over the same values."""
    n, k = SHAPES[block]
    wq, sw = _weights(n, k, block)
    x = _x(m, k, dtype)
    bias = torch.randn(n).to(DEV, dtype) if with_bias else None
    y = tf.fp8_linear(x, wq, sw, block, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    xq, sx = rf.quantize_act_tokens(x) if block is None else rf.quantize_act_groups(x, block[1])
    _check_product(y, _dequant_x(xq, sx, block), rf.dequantize_weight(wq, sw, block), bias)
    if dtype == torch.float32:  # and the reference itself is the same product
        _check_product(rf.fp8_linear_ref(x, wq, sw, block, bias), _dequant_x(xq, sx, block),
                       rf.dequantize_weight(wq, sw, block), bias)


def test_fp8_linear_keeps_leading_dims_and_dispatches_through_ops():
    wq, sw = _weights(80, 96, (32, 32))
    x = _x(6, 96, torch.bfloat16).view(2, 3, 96)
    y = tf.fp8_linear(x, wq, sw, (32, 32))
    assert y.shape == (2, 3, 80) and y.dtype == torch.bfloat16
    want = rf.fp8_linear_ref(x, wq, sw, (32, 32))
    assert want.shape == (2, 3, 80)
    assert bool(((y.float() - want.float()).abs() <= 2 * BF16_ULP * want.float().abs() + 1e-4).all())
    assert torch.equal(ops.fp8_linear(x, wq, sw, (32, 32)), y if DEV.type == "cuda" else want)


# (c) against the unquantised product -------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(32, 32), (128, 128), None])
def test_fp8_linear_is_close_to_the_float32_product(block):
    """Gaussian x and w: each e4m3 value is off by up to 2^-4 relative (uniformly within its ulp), so each product
    by about 3-4% RMS and, the errors being independent, the relative Frobenius error of y is the same: measured
    0.036-0.037 (64 x 512 x 256, blocks 32 and 128 and per-channel). Bound 0.05; anything structurally wrong (a
    scale off, a block misread) is far above it."""
    wf = torch.randn(96, 512, generator=torch.Generator().manual_seed(5)).to(DEV)
    wq, sw = rf.quantize_weight_channels(wf) if block is None else rf.quantize_weight_blocks(wf, block)
    for m in (3, 20):
        x = _x(m, 512, torch.float32)
        y = tf.fp8_linear(x, wq, sw, block)
        y0 = x @ wf.t()
        assert float((y - y0).norm() / y0.norm()) < 0.05


# (d) the GEMV is the two-step path ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 5, 16])
def test_fp8_gemv_equals_quantise_then_fp8_gemm(block, m):
    n, k = SHAPES[block]
    wq, sw = _weights(n, k, block)
    x = _x(m, k, torch.float32)
    bias = torch.randn(n).to(DEV)
    y = tf.fp8_gemv(x, wq, sw, block, bias)
    xq, sx = tf.quantize_act_tokens_triton(x) if block is None else tf.quantize_act_groups_triton(x, block[1])
    y2 = tf.fp8_gemm(xq, sx, wq, sw, block, bias, torch.float32)
    mag = _dequant_x(xq, sx, block).abs() @ rf.dequantize_weight(wq, sw, block).abs().t() + bias.abs()
    assert bool(((y - y2).abs() <= 2 * SUM_TOL * mag).all())


# The split-K GEMV's launches at small shapes: several scale groups a K step (BLOCK_K a multiple of bk), K not a
# multiple of BLOCK_K, N not a multiple of BLOCK_N, several K splits (the last arriving program sums the partials).
# block: (N, K, GemvConfig(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages))
GEMV_CASES = {(16, 16): (40, 200, tf.GemvConfig(16, 64, 2, 4, 2)),
              (32, 32): (72, 352, tf.GemvConfig(32, 128, 2, 4, 2)),
              (128, 128): (144, 1100, tf.GemvConfig(32, 256, 3, 4, 2)),
              None: (72, 600, tf.GemvConfig(16, 256, 3, 4, 2))}


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_split_k_gemv_equals_the_reference_and_is_deterministic(block, m):
    """Split K (2 or 3 programs a column tile, the last one's range partial), 2..4 scale groups a step, bias, and
    x in bfloat16 at 3 rows: the product of the reference's quantised values within SUM_TOL; a second launch is bit
    for bit the first (the partials summed in split order, not by float atomics)."""
    n, k, cfg = GEMV_CASES[block]
    k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k  # fp8_gemv_with's K a program
    assert triton.cdiv(k, k_split) == cfg.split_k > 1 and k % cfg.block_k and n % cfg.block_n
    wq, sw = _weights(n, k, block)
    dtype = torch.bfloat16 if m == 3 else torch.float32
    x = _x(m, k, dtype)
    bias = torch.randn(n).to(DEV, dtype)
    y = tf.fp8_gemv_with(x, wq, sw, block, bias, cfg)
    assert y.shape == (m, n) and y.dtype == dtype
    xq, sx = rf.quantize_act_tokens(x) if block is None else rf.quantize_act_groups(x, block[1])
    _check_product(y, _dequant_x(xq, sx, block), rf.dequantize_weight(wq, sw, block), bias)
    assert torch.equal(tf.fp8_gemv_with(x, wq, sw, block, bias, cfg), y)


@pytest.mark.parametrize("block", [(128, 128), None])
def test_gemv_config_splits_k_to_fill_the_device(block):
    """On 132 SMs (an H100): N = 4096 splits K so that the grid has about 4 programs a SM; gate_up's 28672 rows
    fill it without (block scales at one row: split in two all the same); 512 weight bytes a row a step (256 for
    block scales at one row); 16-row tensor-core tiles from 5 rows; splits never empty."""
    for m in (1, 4, 16):
        for n, k in ((4096, 4096), (4096, 14336), (28672, 4096), (2048, 4096)):
            cfg = tf.gemv_config(m, n, k, block, 132)
            tiles = triton.cdiv(n, cfg.block_n)
            step = 256 if block is not None and m == 1 else 512
            assert cfg.block_k == step and cfg.block_n >= 16 and 1 <= cfg.split_k <= triton.cdiv(k, cfg.block_k)
            assert tiles * cfg.split_k >= 4 * 132 or cfg.split_k in (16, triton.cdiv(k, cfg.block_k))
            assert (cfg.split_k == 1) == (tiles >= 4 * 132 and (block is None or m > 1))
    assert tf.gemv_config(1, 4096, 4096, block, 132).split_k > 1
    assert tf.gemv_config(1, 80, 96, (32, 32), 1).block_k == 96  # K shorter than a step: whole groups only


# (e) weight quantisers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(16, 16), (64, 32), (128, 128), None])
def test_weight_quantisers_are_within_e4m3_error(block):
    n, k = 200, 176  # not multiples of 64 or 128, nor of 32 for N
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(6)) * 0.02).to(DEV, torch.bfloat16)
    wq, sw = rf.quantize_weight_channels(w) if block is None else rf.quantize_weight_blocks(w, block)
    assert wq.dtype == FP8 and wq.shape == (n, k)
    assert sw.shape == ((n,) if block is None else (-(-n // block[0]), -(-k // block[1])))
    wd = rf.dequantize_weight(wq, sw, block)
    s_each = rf.dequantize_weight(torch.ones(n, k, device=DEV).to(FP8), sw, block)  # each value's scale
    wf = w.float()
    assert bool(((wd - wf).abs() <= E4M3_REL * wf.abs() + E4M3_SUBNORMAL_STEP / 2 * s_each).all())
    if block is not None:  # a block's largest magnitude maps onto 448: the scale of the last (partial) block
        bn, bk = block
        last = wf[(sw.shape[0] - 1) * bn:, (sw.shape[1] - 1) * bk:]
        amax = last.abs().max()
        assert torch.equal(sw[-1, -1], amax / amax.new_tensor(448.0))  # float32 division (a tensor divisor: IEEE)


def test_weight_block_quantiser_chunks_give_the_blockwise_result():
    """More rows than one chunk (rf._ROWS_PER_CHUNK), the last chunk partial: each block of the second chunk and of
    the partial block row equals the rule applied to that block alone."""
    n, k, (bn, bk) = rf._ROWS_PER_CHUNK + 40, 48, (16, 32)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7)).to(DEV)
    wq, sw = rf.quantize_weight_blocks(w, (bn, bk))
    for gi in (0, rf._ROWS_PER_CHUNK // bn, n // bn):
        for gj in (0, 1):
            tile = w[gi * bn:(gi + 1) * bn, gj * bk:(gj + 1) * bk]
            q, s = rf.quantize_act_tokens(tile.reshape(1, -1))
            assert float(sw[gi, gj]) == float(s[0])
            assert torch.equal(wq[gi * bn:(gi + 1) * bn, gj * bk:(gj + 1) * bk].reshape(1, -1).view(torch.uint8),
                               q.view(torch.uint8))
    wq_c, sw_c = rf.quantize_weight_channels(w)
    q, s = rf.quantize_act_tokens(w)
    assert torch.equal(wq_c.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sw_c, s)


# (f) errors --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [rf.fp8_linear_ref, tf.fp8_linear, ops.fp8_linear])
def test_bad_block_and_scale_shapes_raise(fn):
    wq, sw = _weights(80, 96, (32, 32))
    x = _x(2, 96, torch.float32)
    with pytest.raises(ValueError, match=r"block \(24, 32\).*one of \(16, 32, 64, 128\)"):
        fn(x, wq, torch.ones(4, 3, device=DEV), (24, 32))
    with pytest.raises(ValueError, match=r"expected float32 \(3, 3\).*got torch.float32 \(3, 2\)"):
        fn(x, wq, sw[:, :2], (32, 32))
    with pytest.raises(ValueError, match=r"expected float32 \(80,\).*per-channel"):
        fn(x, wq, sw, None)
    with pytest.raises(ValueError, match="x has 64 columns"):
        fn(_x(2, 64, torch.float32), wq, sw, (32, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fn(x, wq.float(), sw, (32, 32))


def test_kernel_launchers_check_their_arguments():
    wq, sw = _weights(80, 96, (32, 32))
    x = _x(17, 96, torch.float32)
    xq, sx = rf.quantize_act_groups(x, 32)
    with pytest.raises(ValueError, match=r"sx \(17, 3\)"):
        tf.fp8_gemm(xq, sx[:, :2], wq, sw, (32, 32), None, torch.float32)
    with pytest.raises(ValueError, match="at most 16 rows"):
        tf.fp8_gemv(x, wq, sw, (32, 32))
    with pytest.raises(ValueError, match="one of"):
        tf.quantize_act_groups_triton(x, 48)


# on a GPU: capturable -----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("m", [1, 8, 40])
def test_fp8_linear_replays_in_a_cuda_graph(block, m):
    """No host sync and launch shapes from shapes only: captured once, replayed over new x, as eager calls give."""
    n, k = SHAPES[block]
    wq, sw = _weights(n, k, block)
    x = _x(m, k, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        tf.fp8_linear(x, wq, sw, block)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tf.fp8_linear(x, wq, sw, block)
    for seed in (2, 3):
        x.copy_(_x(m, k, torch.bfloat16, seed=seed))
        graph.replay()
        assert torch.equal(y, tf.fp8_linear(x, wq, sw, block))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_split_k_gemv_replays_in_a_cuda_graph(block, m):
    """The split-K GEMV at Llama-3.1-8B's o projection (4096 x 4096: split on an H100): captured once, replayed over
    new x, bit for bit what eager calls give (arrival counters back at 0 after every launch)."""
    n, k = 4096, 4096
    wq, sw = _weights(n, k, block)
    assert tf.gemv_config(m, n, k, block, torch.cuda.get_device_properties(0).multi_processor_count).split_k > 1
    x = _x(m, k, torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tf.fp8_gemv(x, wq, sw, block)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = tf.fp8_gemv(x, wq, sw, block)
    for seed in (2, 3):
        x.copy_(_x(m, k, torch.bfloat16, seed=seed))
        graph.replay()
        assert torch.equal(y, tf.fp8_gemv(x, wq, sw, block))
        xq, sx = rf.quantize_act_tokens(x) if block is None else rf.quantize_act_groups(x, block[1])
        _check_product(y, _dequant_x(xq, sx, block), rf.dequantize_weight(wq, sw, block), None)


def test_cublas_takes_the_rows_the_gemv_would_put_on_tensor_cores():
    """Per-channel rows go to cuBLAS exactly where fp8_gemv would leave its CUDA-core path (H200: the GEMV's 16-row
    tile was 2-3x slower than cuBLAS at 16 rows; at one row the GEMV was faster)."""
    from specserve.kernels import cublas_fp8

    first_cublas_row = cublas_fp8.MIN_ROWS
    assert first_cublas_row == tf._cuda_core_rows(None) + 1


@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 16, 300])
def test_rows_per_channel_take_cublas_and_equal_the_reference(m):
    """Per-channel bf16 inputs of at least cublas_fp8.MIN_ROWS rows without a bias go to cuBLAS's row-wise FP8 GEMM
    (verify rows and prefill): the same quantised x (our per-token quantiser) and the same product within the fp8
    GEMM's bound; replayed in a CUDA graph as eager calls give. With a bias (or fewer rows) the Triton kernels keep
    them."""
    from specserve.kernels import cublas_fp8

    n, k = 256, 512
    wq, sw = _weights(n, k, None)
    x = _x(m, k, torch.bfloat16)
    bias = torch.randn(n).to(DEV, torch.bfloat16)
    assert cublas_fp8.fits(x, wq, None, None)
    assert not cublas_fp8.fits(x[:cublas_fp8.MIN_ROWS - 1], wq, None, None) and not cublas_fp8.fits(x, wq, None, bias)
    y = ops.fp8_linear(x, wq, sw, None)
    xq, sx = rf.quantize_act_tokens(x)
    _check_product(y, _dequant_x(xq, sx, None), rf.dequantize_weight(wq, sw, None), None)
    assert torch.equal(y, cublas_fp8.fp8_linear_rowwise(*tf.quantize_act_tokens_triton(x), wq, sw))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tf.fp8_linear(x, wq, sw, None)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = tf.fp8_linear(x, wq, sw, None)
    x.copy_(_x(m, k, torch.bfloat16, seed=5))
    graph.replay()
    assert torch.equal(yg, tf.fp8_linear(x, wq, sw, None))
