"""The FP8 (W8A8) fused MoE, block-scaled and per-channel: the Triton kernel (kernels/triton_moe.py with scales)
against its torch reference (kernels/reference_moe_fp8.py) on the same FP8 inputs, at one token (the direct path),
3 and 20 tokens, blocks 16x16 and 32x32, x float32 and bfloat16; the activation quantization against the reference's
rule bit for bit: x's up-front quantizer (triton_fp8.quantize_act_groups_triton), the epilogue's tile quantizer
(triton_fp8_tiles.quantize_groups) and the act the gate/up GEMM hands the down GEMM; the FP8 tile rule; the
reference against the unquantized MoE on the original float weights; unused experts never read; bad shapes
rejected. Per-channel weights (block None: a scale per weight row, per-token activations): the kernel against the
reference at 1..40 tokens, top 2..8, an always-chosen extra expert (a fused shared expert's form), and the act its
gate/up GEMM hands the down GEMM against the reference's. On CPU the kernels run under Triton's interpreter (tiny
shapes: it is slow)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specserve.kernels import ops  # noqa: E402
from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels.reference import silu_and_mul  # noqa: E402
from specserve.kernels.reference_moe_fp8 import (  # noqa: E402
    _dequantize_groups,
    _quantize_groups,
    dequantize_blocks,
    dequantize_experts,
    fused_moe_fp8_ref,
    quantize_blocks,
    quantize_channels,
)
from specserve.kernels.triton_fp8 import quantize_act_groups_triton  # noqa: E402
from specserve.kernels.triton_fp8_tiles import quantize_groups  # noqa: E402
from specserve.kernels.triton_moe import fused_moe  # noqa: E402
from specserve.kernels.triton_moe_blocks import DIRECT_BLOCK_M, moe_block_m, route  # noqa: E402
from specserve.kernels.triton_moe_fp8 import fp8_act, fp8_channel_act, fp8_channel_configs, fp8_configs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RNE = DEV.type == "cpu"  # the kernels' explicit rounding (triton_fp8_tiles.py) runs where the interpreter does
HIDDEN, INTER = 64, 32


def _moe(e: int, h: int, i: int, block: tuple[int, int] | None, g: torch.Generator):
    """-> ((w13, s13, w2, s2) FP8 weights and block scales (block None: per-channel scales [E, 2I], [E, H]),
    (w13, w2) the float32 weights they quantize)."""
    w13f = torch.randn((e, 2 * i, h), generator=g) / h ** 0.5  # [E, 2I, H]
    w2f = torch.randn((e, h, i), generator=g) / i ** 0.5  # [E, H, I]
    quantize = quantize_channels if block is None else lambda w: quantize_blocks(w, block)
    (w13, s13), (w2, s2) = quantize(w13f), quantize(w2f)
    return tuple(t.to(DEV) for t in (w13, s13, w2, s2)), (w13f.to(DEV), w2f.to(DEV))


def _routing(t: int, e: int, k: int, g: torch.Generator):
    """k distinct experts per token, as a top-k router picks -> (topk_weights [t, k] float32, topk_ids [t, k])."""
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return (torch.rand((t, k), generator=g) + 0.1).to(DEV), ids.to(DEV)


def _assert_kernel_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel's roundings are the reference's (x's dtype at the same points, e4m3 by the same rule), so under
    the interpreter they differ only where float32 sums run in another order: per K step (the kernel scales each
    step's e4m3 product) against whole dequantized rows (the reference). Measured there: float32 within 5e-7 of the
    output's largest value, bfloat16 bit for bit; bounds: float32 1e-5 of that scale, bfloat16 one bf16 ulp (2^-8)
    of it (a float32 difference can tip a rounding). On the GPU (not measured here) silu's exp and division are
    approximate, and an intermediate tipped by an ulp can tip its e4m3 rounding (1/16 of that value): the bf16
    suite's GPU bound, 2e-2 of the scale."""
    scale = want.float().abs().max().item()
    if DEV.type == "cuda":
        atol = 2e-2 * scale
    else:
        atol = (1e-5 if got.dtype == torch.float32 else 2 ** -8) * scale
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(16, 16), (32, 32)])
@pytest.mark.parametrize("t,e,k", [(1, 8, 3), (3, 4, 2), (20, 6, 3)])
def test_fp8_kernel_matches_reference(dtype, block, t, e, k):
    g = torch.Generator().manual_seed(t * 7 + e + block[0])
    (w13, s13, w2, s2), _ = _moe(e, HIDDEN, INTER, block, g)
    base = (torch.randn((t, HIDDEN + 5), generator=g) * 2).to(dtype).to(DEV)
    x = base[:, 2:2 + HIDDEN]  # [T, H] row-strided view, as a slice of a fused buffer
    wts, ids = _routing(t, e, k, g)
    got = fused_moe(x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=block)
    assert got.shape == (t, HIDDEN) and got.dtype == dtype
    want = fused_moe_fp8_ref(x, w13, s13, w2, s2, block, wts, ids)
    _assert_kernel_matches(got, want)
    assert torch.equal(fused_moe(x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=block), got)
    if t <= 3:  # the direct path (default at one token) and the aligned one: the same result bit for bit
        other = fused_moe(x, w13, w2, wts, ids, direct=t != 1, w13_scale=s13, w2_scale=s2, block=block)
        assert torch.equal(other, got)


def test_fp8_kernel_ragged_blocks():
    """Dims that are not whole blocks: H 80 with bk 32 (a last activation group and weight block 16 wide), H rows of
    w2 over bn 32 (a last block of 16 rows), a down tile narrower than the weight blocks (BLOCK_N 16 < bn 32), and
    K steps of two groups whose second runs past H (it must add nothing), on both paths."""
    g = torch.Generator().manual_seed(5)
    h, i, block = 80, 32, (32, 32)
    (w13, s13, w2, s2), _ = _moe(5, h, i, block, g)
    x = torch.randn((3, h), generator=g).to(torch.bfloat16).to(DEV)
    wts, ids = _routing(3, 5, 2, g)
    want = fused_moe_fp8_ref(x, w13, s13, w2, s2, block, wts, ids)
    gate_up = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    down = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
    for tiles in (None, (gate_up, down)):
        for direct in (False, True):
            got = fused_moe(x, w13, w2, wts, ids, direct=direct, tiles=tiles, w13_scale=s13, w2_scale=s2,
                            block=block)
            _assert_kernel_matches(got, want)


def test_fp8_tiles_rule():
    """The FP8 tiles: BLOCK_K a multiple of bk, the gate/up BLOCK_N too (its epilogue quantizes whole groups).
    Table tiles are raised to it; explicit ones that break it are refused, not changed."""
    for bk in (16, 32, 128):
        for block_m in (16, 64, 128):
            gate_up, down = fp8_configs(block_m, bk, 768, 2048, None)
            assert gate_up["BLOCK_N"] % bk == 0 and gate_up["BLOCK_K"] % bk == 0 and down["BLOCK_K"] % bk == 0
    cfg = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="multiples of the weight block's width 32"):
        fp8_configs(16, 32, 768, 2048, (cfg, cfg))  # gate/up BLOCK_N 16 < bk 32
    with pytest.raises(ValueError, match="multiples of the weight block's width 32"):
        fp8_configs(16, 32, 768, 2048, (dict(cfg, BLOCK_N=32), dict(cfg, BLOCK_K=48)))


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, GROUPS: tl.constexpr, G: tl.constexpr, RNE: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, GROUPS * G)
    q, s = quantize_groups(tl.load(x_ptr + r * GROUPS * G + c).to(tl.float32)[None, :], GROUPS, G, RNE)
    tl.store(q_ptr + r * GROUPS * G + c[None, :], q)  # [1, GROUPS * G] e4m3
    tl.store(s_ptr + r * GROUPS + tl.arange(0, GROUPS)[None, :], s)


def _wide_values(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """[rows, cols] float32 of widely spread magnitudes (subnormal e4m3 values, ties), row 0 all zero, -0.0 and
    amax 448 (scale 1: the ties kept as they are) in row 1."""
    x = torch.randn((rows, cols), generator=g) * torch.exp(torch.randn((rows, cols), generator=g) * 3)
    x[0] = 0.0
    x[1, :5] = torch.tensor([448.0, 1.5 * 2 ** -9, 2 ** -10, 15.5, -0.0])
    return x


def _assert_same_quantization(q: torch.Tensor, s: torch.Tensor, want_q: torch.Tensor, want_s: torch.Tensor):
    """Bit for bit: the e4m3 bytes (so -0 against +0 counts) and the float32 scales."""
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), want_s.view(torch.int32))


def test_tile_quantization_is_the_reference_rule():
    """quantize_groups (the gate/up GEMM's epilogue quantizes its act tile with it) gives _quantize_groups' scales
    and e4m3 values bit for bit, one group a row and four: float32 and bfloat16 input."""
    g = torch.Generator().manual_seed(0)
    rows, group = 64, 32
    for groups in (1, 4):
        x = _wide_values(rows, groups * group, g)
        for xin in (x, x.to(torch.bfloat16)):
            xin = xin.to(DEV)
            q = torch.empty((rows, groups * group), dtype=torch.float8_e4m3fn, device=DEV)
            s = torch.empty((rows, groups), device=DEV)
            _quantize_kernel[(rows,)](xin, q, s, GROUPS=groups, G=group, RNE=RNE)
            _assert_same_quantization(q, s, *_quantize_groups(xin, group))


@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upfront_quantizer_is_the_moe_rule(dtype, group):
    """x's quantizer (the dense FP8 linear's, one launch before the gate/up GEMM) equals the MoE reference's
    _quantize_groups bit for bit: a row-strided x whose width is no multiple of the group (a short last group)."""
    g = torch.Generator().manual_seed(group)
    base = _wide_values(12, 3 * group + 24, g).to(dtype).to(DEV)
    x = base[:, 3:3 + 2 * group + 8]  # [12, 2 group + 8]
    _assert_same_quantization(*quantize_act_groups_triton(x, group), *_quantize_groups(x, group))


def _reference_act(x, w13, s13, block, ids):
    """The reference's quantized act per pair: (q [T*K, I] e4m3, s [T*K, ceil(I/bk)]), as fused_moe_fp8_ref makes
    it."""
    bk = block[1]
    flat = ids.reshape(-1)  # [T*K]
    xd = _dequantize_groups(*_quantize_groups(x, bk), bk)  # [T, H]
    tok = torch.arange(flat.numel(), device=DEV) // ids.shape[1]
    acts = torch.stack([silu_and_mul((xd[t] @ dequantize_blocks(w13[e], s13[e], block).T).to(x.dtype))
                        for t, e in zip(tok.tolist(), flat.tolist())])  # [T*K, I] in x's dtype
    return _quantize_groups(acts, bk)


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("block", [(16, 16), (32, 32)])
def test_epilogue_act_is_the_reference_act(block, direct):
    """The act the gate/up GEMM quantizes in its epilogue (aq, sa: what the down GEMM reads) against the reference's
    quantized act, bfloat16 x: bit for bit (the roundings are the reference's; under the interpreter the float32
    sums of x's dtype come out the same, as the final output's test measures). Through fp8_act, the internal
    helper fused_moe calls; a gate/up BLOCK_N of two groups, so a tile quantizes several."""
    g = torch.Generator().manual_seed(block[0] + direct)
    e, t, k = 6, 1 if direct else 5, 3
    (w13, s13, w2, s2), _ = _moe(e, HIDDEN, INTER, block, g)
    x = (torch.randn((t, HIDDEN), generator=g) * 2).to(torch.bfloat16).to(DEV)
    _, ids = _routing(t, e, k, g)
    block_m = DIRECT_BLOCK_M if direct else 16
    pairs = (*route(ids, e, direct, block_m), block_m, k, direct)
    cfg = dict(BLOCK_N=2 * block[1], BLOCK_K=block[1], num_warps=4, num_stages=2)
    aq, sa = fp8_act(x, w13, s13, *block, pairs, cfg)
    _assert_same_quantization(aq, sa, *_reference_act(x, w13, s13, block, ids))


def test_fp8_reference_vs_unquantized():
    """The FP8 MoE against the float32 one on the original weights (before quantization), Gaussian x and weights:
    four e4m3 roundings (x, w13, the act, w2; 3 mantissa bits, up to 1/16 relative each) compound to a relative
    error, by norm, of 0.058-0.062 on average and at most 0.076 over 40 seeds x {float32, bfloat16 x} x blocks
    {16, 32} at these shapes (T 20, E 8, top 3). Bound 0.10; the bound fails for a scale off by a block (a wrong
    scale index costs far more) or a dropped scale factor."""
    for seed, (dtype, block) in enumerate([(torch.float32, (16, 16)), (torch.bfloat16, (32, 32))]):
        g = torch.Generator().manual_seed(100 + seed)
        (w13, s13, w2, s2), (w13f, w2f) = _moe(8, HIDDEN, INTER, block, g)
        x = torch.randn((20, HIDDEN), generator=g).to(DEV)
        wts, ids = _routing(20, 8, 3, g)
        got = fused_moe_fp8_ref(x.to(dtype), w13, s13, w2, s2, block, wts, ids).float()
        want = ref.fused_moe(x, w13f, w2f, wts, ids)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.10, f"{dtype} {block}: relative error {err:.3f}"


@pytest.mark.parametrize("block", [(16, 16), None])
def test_unused_expert_never_read(block):
    """Experts no token chose hold NaN weights (e4m3fn's 0x7F) and NaN scales: the output is that of clean ones,
    bit for bit, on both paths and in the reference, block-scaled and per-channel. (Triton's interpreter loads 0x7F
    as 480, not NaN: the NaN scales catch a read there.)"""
    g = torch.Generator().manual_seed(9)
    (w13, s13, w2, s2), _ = _moe(8, HIDDEN, INTER, block, g)
    for t in (1, 3):
        x = torch.randn((t, HIDDEN), generator=g).to(torch.bfloat16).to(DEV)
        wts, ids = _routing(t, 4, 2, g)  # experts 4..7 unused
        ids[0, 0] = 6  # and one in the middle used
        clean = fused_moe(x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=block)
        unused = torch.ones(8, dtype=torch.bool, device=DEV)
        unused[ids.reshape(-1)] = False
        assert unused.sum() >= 3
        poisoned = [w.clone() for w in (w13, s13, w2, s2)]
        for w in poisoned:
            if w.dtype == torch.float8_e4m3fn:
                w.view(torch.uint8)[unused] = 0x7F
            else:
                w[unused] = float("nan")
        assert torch.isnan(poisoned[0][unused].float()).all()
        p13, ps13, p2, ps2 = poisoned
        for direct in (False, True):
            got = fused_moe(x, p13, p2, wts, ids, direct=direct, w13_scale=ps13, w2_scale=ps2, block=block)
            assert torch.equal(got, clean)
        assert torch.equal(fused_moe_fp8_ref(x, p13, ps13, p2, ps2, block, wts, ids),
                           fused_moe_fp8_ref(x, w13, s13, w2, s2, block, wts, ids))


@pytest.mark.parametrize("block", [(32, 32), None])
def test_ops_dispatch(block):
    """ops.fused_moe with scales (block or per-channel): the FP8 reference on CPU, the kernel on CUDA."""
    g = torch.Generator().manual_seed(3)
    (w13, s13, w2, s2), _ = _moe(4, HIDDEN, INTER, block, g)
    x = torch.randn((3, HIDDEN), generator=g).to(torch.bfloat16).to(DEV)
    wts, ids = _routing(3, 4, 2, g)
    got = ops.fused_moe(x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=block)
    want = fused_moe_fp8_ref(x, w13, s13, w2, s2, block, wts, ids)
    if DEV.type == "cpu":
        assert torch.equal(got, want)
    else:
        _assert_kernel_matches(got, want)


def test_bad_shapes_rejected():
    g = torch.Generator().manual_seed(1)
    (w13, s13, w2, s2), _ = _moe(4, HIDDEN, INTER, (16, 16), g)
    x = torch.randn((2, HIDDEN), generator=g).to(DEV)
    wts, ids = _routing(2, 4, 2, g)
    fns = (lambda *a, **kw: fused_moe(x, *a[:2], wts, ids, w13_scale=a[2], w2_scale=a[3], **kw),
           lambda *a, **kw: ops.fused_moe(x, *a[:2], wts, ids, w13_scale=a[2], w2_scale=a[3], **kw),
           lambda *a, **kw: fused_moe_fp8_ref(x, a[0], a[2], a[1], a[3], kw["block"], wts, ids))
    for fn in fns:
        # I = 32 is no multiple of bn = 64 (the scales shaped as that block would need: 1 row block of gate+up)
        with pytest.raises(ValueError, match="multiple of the weight block's rows"):
            fn(w13, w2, s13[:, :1, :4], s2[:, :1, :2], block=(64, 16))
        with pytest.raises(ValueError, match=r"w13_scale must be float32 \(4, 4, 4\)"):
            fn(w13, w2, s13[:, :, :3], s2, block=(16, 16))
        with pytest.raises(ValueError, match=r"w2_scale must be float32 \(4, 4, 2\)"):
            fn(w13, w2, s13, s2.transpose(1, 2), block=(16, 16))
        with pytest.raises(ValueError, match="block must be None .per-channel. or two positive ints"):
            fn(w13, w2, s13, s2, block=(16, 0))
        with pytest.raises(ValueError, match=r"w13_scale must be float32 \(4, 64\) for per-channel scales"):
            fn(w13, w2, s13, s2, block=None)  # block scales where per-channel ones are expected
        with pytest.raises(ValueError, match=r"w2_scale must be float32 \(4, 64\) for per-channel scales"):
            fn(w13, w2, torch.ones(4, 64), s2, block=None)
        with pytest.raises(ValueError, match="must be float8_e4m3fn"):
            fn(w13.float(), w2, s13, s2, block=(16, 16))
    with pytest.raises(ValueError, match="power of two"):  # the kernel's K step is one block: a power of two
        (w13b, s13b), (w2b, s2b) = quantize_blocks(w13.float(), (16, 24)), quantize_blocks(w2.float(), (16, 24))
        fused_moe(x, w13b, w2b, wts, ids, w13_scale=s13b, w2_scale=s2b, block=(16, 24))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(128, 128), None])
@pytest.mark.parametrize("t", [1, 5])
def test_fp8_cuda_graph_replay(t, block):
    """Captured once (one token: the direct path), replayed with new routings and inputs: the reference's result,
    Qwen3-like 128 x 128 blocks and per-channel scales."""
    g = torch.Generator().manual_seed(0)
    e, h, i, k = 16, 256, 128, 4
    (w13, s13, w2, s2), _ = _moe(e, h, i, block, g)
    x = torch.randn((t, h), generator=g).to(torch.bfloat16).to(DEV)
    wts, ids = _routing(t, e, k, g)
    kw = dict(w13_scale=s13, w2_scale=s2, block=block)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles) outside the capture
        fused_moe(x, w13, w2, wts, ids, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, wts, ids, **kw)
    for seed in range(3):
        g.manual_seed(100 + seed)
        new_wts, new_ids = _routing(t, e, k, g)
        wts.copy_(new_wts)
        ids.copy_(new_ids)
        x.copy_(torch.randn((t, h), generator=g).to(torch.bfloat16).to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        _assert_kernel_matches(out, fused_moe_fp8_ref(x, w13, s13, w2, s2, block, wts, ids))


# ---------------------------------------------------------------------------------------------------------------
# Per-channel FP8 (block None)
# ---------------------------------------------------------------------------------------------------------------


def _channel_routing(t: int, e: int, k: int, case: str, g: torch.Generator):
    """Routing of t tokens over e experts, top k: "random" (k distinct of e), "hot" (k distinct of only the first k
    experts: every pair on a few experts, whose runs then span several aligned blocks), "shared" (k - 1 distinct of
    experts 0..e-2, then expert e-1 for every token with weight 1: how SparseMoEBlock runs a fused shared expert)."""
    if case == "hot":
        return _routing(t, k, k, g)
    if case == "shared":
        wts, ids = _routing(t, e - 1, k - 1, g)
        return (torch.cat([wts, torch.ones((t, 1), device=DEV)], 1),
                torch.cat([ids, torch.full((t, 1), e - 1, dtype=ids.dtype, device=DEV)], 1))
    return _routing(t, e, k, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,case", [(1, 8, 8, "random"), (1, 6, 3, "shared"), (3, 6, 4, "random"),
                                        (20, 10, 2, "shared"), (40, 8, 2, "hot")])
def test_fp8_channel_kernel_matches_reference(dtype, t, e, k, case):
    """Per-channel FP8 experts (block None): the kernel against fused_moe_fp8_ref on the same FP8 inputs, within
    _assert_kernel_matches' bounds (float32: 1e-5 of the output's largest value; bfloat16: one bf16 ulp of it; both
    measured under the interpreter at most 5e-7 and 0); a row-strided x; at one token the direct and aligned paths
    bit for bit; at 40 tokens on two experts each expert's run is more than one block of rows."""
    g = torch.Generator().manual_seed(t * 11 + e + k)
    (w13, s13, w2, s2), _ = _moe(e, HIDDEN, INTER, None, g)
    base = (torch.randn((t, HIDDEN + 5), generator=g) * 2).to(dtype).to(DEV)
    x = base[:, 3:3 + HIDDEN]  # [T, H] row-strided view
    wts, ids = _channel_routing(t, e, k, case, g)
    if case == "hot":
        assert t > moe_block_m(t * k, e)  # each of the k experts has t pairs: more than one aligned block
    got = fused_moe(x, w13, w2, wts, ids, w13_scale=s13, w2_scale=s2, block=None)
    assert got.shape == (t, HIDDEN) and got.dtype == dtype
    _assert_kernel_matches(got, fused_moe_fp8_ref(x, w13, s13, w2, s2, None, wts, ids))
    if t == 1:  # the direct path (default at one token) and the aligned one: the same result bit for bit
        assert torch.equal(fused_moe(x, w13, w2, wts, ids, direct=False, w13_scale=s13, w2_scale=s2, block=None),
                           got)


def test_fp8_channel_ragged_tiles():
    """Dims that are no multiple of the tiles: H 80, I 48 (a last K step and a last column tile past the data, a
    down tile narrower than H), explicit tiles, both paths."""
    g = torch.Generator().manual_seed(6)
    h, i = 80, 48
    (w13, s13, w2, s2), _ = _moe(5, h, i, None, g)
    x = torch.randn((3, h), generator=g).to(torch.bfloat16).to(DEV)
    wts, ids = _routing(3, 5, 2, g)
    want = fused_moe_fp8_ref(x, w13, s13, w2, s2, None, wts, ids)
    tiles = (dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2), dict(BLOCK_N=32, BLOCK_K=32, num_warps=4,
                                                                           num_stages=2))
    for direct in (False, True):
        _assert_kernel_matches(fused_moe(x, w13, w2, wts, ids, direct=direct, tiles=tiles, w13_scale=s13,
                                         w2_scale=s2, block=None), want)
    gate_up, down = fp8_channel_configs(16, 768, 2048, None)  # Qwen3-30B-A3B: the table's tiles as they are
    assert gate_up["BLOCK_K"] >= 32 and down["BLOCK_K"] >= 32 and gate_up["BLOCK_N"] >= 16


@pytest.mark.skipif(DEV.type == "cuda", reason="bit for bit under the interpreter only: on the GPU silu's exp and "
                    "division are approximate (the output tests hold the kernel to the reference there)")
@pytest.mark.parametrize("direct", [False, True])
def test_channel_act_is_the_reference_act(direct):
    """What the per-channel gate/up GEMM hands the down GEMM: the act (x's dtype, bfloat16) equal to the
    reference's act bit for bit, and the per-pair scale the down GEMM takes from the partial amaxes (max over a
    row's column tiles, / 448) equal to the reference's per-pair quantization scale bit for bit. A gate/up BLOCK_N
    of 16 over I 32: two partials a row."""
    g = torch.Generator().manual_seed(40 + direct)
    e, t, k = 6, 1 if direct else 5, 3
    (w13, s13, w2, s2), _ = _moe(e, HIDDEN, INTER, None, g)
    x = (torch.randn((t, HIDDEN), generator=g) * 2).to(torch.bfloat16).to(DEV)
    _, ids = _routing(t, e, k, g)
    block_m = DIRECT_BLOCK_M if direct else 16
    pairs = (*route(ids, e, direct, block_m), block_m, k, direct)
    act, amax = fp8_channel_act(x, w13, s13, pairs, dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2))
    assert amax.shape == (t * k, 2)
    xd = _dequantize_groups(*_quantize_groups(x, HIDDEN), HIDDEN)  # [T, H] per token
    flat = ids.reshape(-1)
    want = torch.stack([silu_and_mul((xd[p // k] @ dequantize_experts(w13[ex], s13[ex], None).T).to(x.dtype))
                        for p, ex in enumerate(flat.tolist())])  # [T*K, I]
    assert torch.equal(act, want)
    scale = amax.amax(1).clamp_min(1e-10) / torch.tensor(448.0, device=DEV)
    assert torch.equal(scale.view(torch.int32), _quantize_groups(want, INTER)[1][:, 0].view(torch.int32))


def test_fp8_channel_reference_vs_unquantized():
    """The per-channel FP8 MoE against the float32 one on the original weights: four e4m3 roundings (x per token,
    w13 per row, the act per pair, w2 per row) give a relative error, by norm, of 0.060 on average and at most
    0.069 over 40 seeds x {float32, bfloat16 x} at these shapes (T 20, E 8, top 3). Bound 0.10; a scale applied to
    the wrong rows or dropped fails it."""
    for seed, dtype in enumerate([torch.float32, torch.bfloat16]):
        g = torch.Generator().manual_seed(200 + seed)
        (w13, s13, w2, s2), (w13f, w2f) = _moe(8, HIDDEN, INTER, None, g)
        x = torch.randn((20, HIDDEN), generator=g).to(DEV)
        wts, ids = _routing(20, 8, 3, g)
        got = fused_moe_fp8_ref(x.to(dtype), w13, s13, w2, s2, None, wts, ids).float()
        want = ref.fused_moe(x, w13f, w2f, wts, ids)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.10, f"{dtype}: relative error {err:.3f}"
