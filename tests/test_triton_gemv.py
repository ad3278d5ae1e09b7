"""The decode GEMV kernels (kernels/triton_gemv.py) against F.linear and the torch references of the ops they fuse
(reference.rms_norm / add_rms_norm, silu_and_mul): M 1..4 rows, K and N not multiples of the tiles, small explicit
configurations so several programs and K steps run, with and without residual and bias, weight offsets 0 and 1,
with and without the SiLU-and-mul epilogue.

float32 on random inputs: close (only the order of accumulation differs). bfloat16 (and float16) on exact-friendly
inputs (tests/exact_inputs.py): every product and partial sum is exact in float32, so any order of accumulation gives
the reference's float32 sums, and the outputs must be EQUAL; every rounding in between is then the same rounding of
the same float32 value. For the norm most rows are built so that var + eps is a power of 4 (`exact_norm_rows`): the
rsqrt is an exact power of 2 for any rsqrt implementation, so the normed activation matches the reference's bit for
bit. There h * rstd needs no rounding, so other rows (`ieee_rstd_rows`, rstd no power of 2 but the same float32 in
torch and the interpreter) check the rounding of the normed row before the weight multiply. Alternatives that round
differently (h unrounded, the normed row or its product with the weight unrounded, gate / up unrounded) give other
outputs on these inputs, and the checks reject them. On a GPU (where the kernel's rsqrt and division are
approximate, so the normed outputs are compared within an ulp or two) also the real Llama-8B and SmolLM2 shapes
against the unfused path, captured in a CUDA graph and replayed with new inputs. On CPU under Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest.py does the same)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from exact_inputs import (  # noqa: E402  (tests/exact_inputs.py)
    exact_norm_inputs,
    four_squares,
    ieee_rstd_rows,
    linear_exact,
    multiples,
)

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels import triton_gemv  # noqa: E402
from specserve.kernels.triton_gemv import gemv, gemv_config, norm_gemv  # noqa: E402
from specserve.kernels.tuned_h200 import GEMV_TUNED, GEMV_TUNED_ROWS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CFG = dict(BLOCK_N=8, BLOCK_K=32, num_warps=4, num_stages=2, LATE_RSTD=0)  # several programs and K steps; the
# exact-rounding norm (LATE_RSTD off: these tests check the unfused ops' rounding)
# On a GPU the kernel's float32 division (the mean) and tl.rsqrt are approximate (an ulp or so), so even on the
# exact rows its rstd can differ from torch's, and a normed value by one ulp; the interpreter's are IEEE, as
# torch's CPU ones. Likewise exp (the SiLU) differs by float32 ulps between implementations: a bfloat16 rounding
# of silu(g) could land an ulp apart, on CPU it does not on these inputs (checked).
NORM_TOL = dict(atol=0, rtol=0) if DEV.type == "cpu" else dict(atol=2 ** -5, rtol=2 ** -6)
SILU_TOL = dict(atol=0, rtol=0) if DEV.type == "cpu" else dict(atol=0, rtol=2 ** -7)


def exact_gemv_inputs(m: int, n: int, k: int, dtype, g, bias: bool):
    """x multiples of 1/16 in [-2, 2], w of 1/8 in [-1/2, 1/2], bias of 1/8 in [-2, 2]."""
    x = multiples((m, k), -2, 2, 1 / 16, g).to(dtype)
    w = multiples((n, k), -0.5, 0.5, 1 / 8, g).to(dtype)
    b = multiples((n,), -2, 2, 1 / 8, g).to(dtype) if bias else None
    return x, w, b


def to_dev(*ts):
    return [t.to(DEV) if t is not None else None for t in ts]


# ---------------------------------------------------------------------------------------------------------- gemv

@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_float32_close_to_linear(m, bias):
    g = torch.Generator().manual_seed(m * 10 + bias)
    x, w = torch.randn(m, 100, generator=g), torch.randn(37, 100, generator=g) / 10
    b = torch.randn(37, generator=g) if bias else None
    got = gemv(*to_dev(x, w, b), config=CFG)
    assert got.shape == (m, 37) and got.dtype == F32
    torch.testing.assert_close(got.cpu(), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m,bias", [(1, False), (1, True), (2, True), (4, False)])
def test_gemv_exact_inputs_equal_linear(m, bias, dtype):
    g = torch.Generator().manual_seed(m * 10 + bias + (dtype == F16) * 100)
    x, w, b = exact_gemv_inputs(m, 45, 200, dtype, g, bias)
    want = linear_exact(x, w, b)
    f32 = F.linear(x.float(), w.float(), None if b is None else b.float())
    if dtype == BF16:  # (float16's 11 bits hold most of these sums)
        assert (f32 != want.float()).float().mean() > 0.5  # most outputs are rounded: the rounding is checked
    got = gemv(*to_dev(x, w, b), config=CFG)
    assert got.dtype == dtype and torch.equal(got.cpu(), want)


def test_gemv_rounds_to_nearest_even():
    """Sums exactly halfway between two bfloat16 values: to the even one, as F.linear (truncation, the
    interpreter's own float32 -> bfloat16 conversion, gives the one nearer zero: 1 + 2^-7 for 1 + 3 2^-8)."""
    x = torch.zeros(2, 40)
    x[:, 0], x[:, 1] = 1.0, 2.0 ** -8
    w = torch.zeros(6, 40)
    w[:, 0] = torch.tensor([1.0, 1.0, 1.5, 0.5, -1.0, -1.0])
    w[:, 1] = torch.tensor([1.0, 3.0, 1.0, -1.0, -1.0, -3.0])  # 1 + 2^-8: a tie, 1 + 3 2^-8: a tie up, ...
    x, w = x.to(BF16), w.to(BF16)
    want = linear_exact(x, w)
    got = gemv(*to_dev(x, w), config=CFG)
    assert torch.equal(got.cpu(), want)
    assert want[0, 1].item() == 1 + 2 ** -6 and want[0, 0].item() == 1.0 and want[0, 5].item() == -1 - 2 ** -6


@pytest.mark.parametrize("cfg", [dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3),  # one program, one step
                                 dict(BLOCK_N=2, BLOCK_K=16, num_warps=1, num_stages=1),
                                 dict(BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=4),
                                 None])  # gemv_config's
def test_gemv_tiles(cfg):
    g = torch.Generator().manual_seed(5)
    x, w, b = exact_gemv_inputs(3, 33, 72, BF16, g, True)
    assert torch.equal(gemv(*to_dev(x, w, b), config=cfg).cpu(), linear_exact(x, w, b))


def test_gemv_strided_rows_and_no_rows():
    """x a column slice of a wider buffer (a row stride > K) is read in place; M = 0 gives an empty result."""
    g = torch.Generator().manual_seed(6)
    x, w, _ = exact_gemv_inputs(2, 21, 100, BF16, g, False)
    wide = torch.zeros(2, 130, dtype=BF16)
    wide[:, 10:110] = x
    assert torch.equal(gemv(*to_dev(wide[:, 10:110], w), config=CFG).cpu(), linear_exact(x, w))
    assert gemv(*to_dev(x[:0], w)).shape == (0, 21)


# -------------------------------------------------------------------------------------------------- norm_gemv

def norm_reference(x, residual, nw, eps, offset, w, bias, silu_mul):
    """The unfused ops on CPU: (y, h) = (F.linear(rms_norm(h), w, bias) [then silu_and_mul], h = x + residual)."""
    x, residual, nw, w, bias = [t.cpu() if t is not None else None for t in (x, residual, nw, w, bias)]
    if residual is None:
        a, h = ref.rms_norm(x, nw, eps, offset), x
    else:
        a, h = ref.add_rms_norm(x, residual, nw, eps, offset)
    y = linear_exact(a, w, bias) if x.dtype != F32 else F.linear(a, w, bias)
    return (ref.silu_and_mul(y) if silu_mul else y), h


def check_norm(got, want, silu_mul: bool, exact: bool = True) -> None:
    """h (the new residual) must equal the reference's; y too for exact inputs on CPU (on a GPU within NORM_TOL;
    float32 SiLU outputs within an ulp: exp differs between implementations and nothing rounds it away)."""
    (y, h), (want_y, want_h) = got, want
    assert h.dtype == want_h.dtype and torch.equal(h.cpu(), want_h), "h is not x + residual rounded once"
    assert y.shape == want_y.shape and y.dtype == want_y.dtype
    if not exact:
        tol = dict(atol=1e-5, rtol=1e-5)
    elif DEV.type != "cpu":
        tol = NORM_TOL
    else:
        tol = dict(atol=0, rtol=2.5e-7) if silu_mul and y.dtype == F32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(y.cpu(), want_y, **tol)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_gemv_float32_close_to_reference(residual, offset, silu_mul):
    g = torch.Generator().manual_seed(residual * 4 + int(offset) * 2 + silu_mul)
    for m, bias in ((1, False), (4, True)):
        x, r = torch.randn(m, 100, generator=g), torch.randn(m, 100, generator=g) if residual else None
        nw = torch.randn(100, generator=g) * (0.1 if offset else 1.0)
        w, b = torch.randn(42, 100, generator=g) / 10, torch.randn(42, generator=g) if bias else None
        got = norm_gemv(*to_dev(x, r, nw), 1e-6, offset, *to_dev(w, b), silu_mul=silu_mul, config=CFG)
        check_norm(got, norm_reference(x, r, nw, 1e-6, offset, w, b, silu_mul), silu_mul, exact=False)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("m,k,eps,bias", [(1, 100, 0.0, False), (3, 144, 2.0 ** -10, True)])
def test_norm_gemv_exact_inputs_equal_reference(m, k, eps, bias, dtype, residual, offset, silu_mul):
    g = torch.Generator().manual_seed(m * 1000 + residual * 4 + int(offset) * 2 + silu_mul + (dtype == F32) * 8)
    x, r, nw, w, b = exact_norm_inputs(m, k, 42, dtype, eps, offset, residual, bias, g)
    xd, rd, nwd = to_dev(x, r, nw)
    got = norm_gemv(xd, rd, nwd, eps, offset, *to_dev(w, b), silu_mul=silu_mul, config=CFG)
    check_norm(got, norm_reference(x, r, nw, eps, offset, w, b, silu_mul), silu_mul)
    if r is None:
        assert got[1] is xd  # no residual: h is x itself, nothing written


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_gemv_rounds_the_normed_row(offset, silu_mul):
    """Rows whose rstd is no power of 2 (ieee_rstd_rows; on CPU the kernel's rstd is torch's there): h * rstd
    needs rounding, and with offset 0 the normed row is rounded before the weight multiply as well as after (one
    rounding, as offset 1 does, gives other outputs on these inputs)."""
    g = torch.Generator().manual_seed(12 + int(offset) * 2 + silu_mul)
    eps = 1e-6
    x, r, nw, w, b = exact_norm_inputs(3, 100, 42, BF16, eps, offset, True, True, g, h=ieee_rstd_rows(3, 100, eps, g))
    got = norm_gemv(*to_dev(x, r, nw), eps, offset, *to_dev(w, b), silu_mul=silu_mul, config=CFG)
    want = norm_reference(x, r, nw, eps, offset, w, b, silu_mul)
    check_norm(got, want, silu_mul)
    if not offset and not silu_mul:
        hf = (x + r).float()
        once = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * nw.float()).to(BF16)
        assert not torch.equal(linear_exact(once, w, b), want[0])


@pytest.mark.parametrize("cfg", [dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3),  # one program, one step
                                 dict(BLOCK_N=2, BLOCK_K=16, num_warps=1, num_stages=1),
                                 None])
def test_norm_gemv_tiles(cfg):
    g = torch.Generator().manual_seed(8)
    x, r, nw, w, b = exact_norm_inputs(4, 80, 30, BF16, 2.0 ** -10, 0.0, True, True, g)
    for silu_mul in (False, True):
        got = norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, 0.0, *to_dev(w, b), silu_mul=silu_mul, config=cfg)
        check_norm(got, norm_reference(x, r, nw, 2.0 ** -10, 0.0, w, b, silu_mul), silu_mul)


def residual_rounding_inputs(g: torch.Generator):
    """bfloat16 rows (x, residual, norm_w, w) whose statistics see the rounding of x + residual: h [2, 64] has 15
    entries +-4 (x = h, residual = +-7 2^-9 of h's sign: x + residual rounds back to h, unrounded it adds 0.7% to
    their squares) holding 15/16 of the row's mean square, exactly 4 (rsqrt exact); the other entries are small
    multiples of 1/8 (residual a multiple of 1/8, x = h - residual), so with unrounded statistics their normed
    values, h * rstd, move by about 0.3%: more than half an ulp for most."""
    k, big = 64, 15
    rows = []
    for _ in range(2):
        while True:
            n = torch.randint(-3, 4, (k - big,), generator=g)  # units of 1/8
            rest = 64 * 16 - int((n[4:] ** 2).sum())
            if rest >= 0:
                break
        n[:4] = torch.tensor(four_squares(rest)) * (torch.randint(0, 2, (4,), generator=g) * 2 - 1)
        big_n = 32 * (torch.randint(0, 2, (big,), generator=g) * 2 - 1)  # +-4
        rows.append(torch.cat((big_n, n))[torch.randperm(k, generator=g)].float() / 8)
    h = torch.stack(rows)  # [2, 64]
    assert torch.equal(h.pow(2).mean(-1), torch.tensor([4.0, 4.0]))
    is_big = h.abs() == 4
    r = torch.where(is_big, h.sign() * 7 * 2.0 ** -9, multiples(h.shape, -1, 1, 1 / 8, g))
    x = torch.where(is_big, h, h - r)
    x, r = x.to(BF16), r.to(BF16)
    assert torch.equal(x + r, h.to(BF16)) and not torch.equal(x.float() + r.float(), h)
    nw = multiples((k,), 0.5, 1.99, 1 / 128, g).to(BF16)
    w = multiples((40, k), -0.5, 0.5, 1 / 8, g).to(BF16)
    return x, r, nw, w


def test_norm_gemv_checks_reject_other_roundings():
    """The checks fail when they should: h = x (no residual added), and the outputs of other rounding orders,
    which differ from the reference's on these inputs: statistics of the unrounded h (float32 x + residual), the
    normed row's product with the norm weight unrounded (a float32 activation), gate and up unrounded before the
    SiLU-and-mul. (Rounding the normed row before the weight multiply is exact on exact-friendly rows: h * rstd is
    a short bfloat16 value; that rounding is only covered by the float32 and GPU tolerance tests.)"""
    g = torch.Generator().manual_seed(9)
    x, r, nw, w = residual_rounding_inputs(g)
    want = norm_reference(x, r, nw, 0.0, 0.0, w, None, False)
    got = norm_gemv(*to_dev(x, r, nw), 0.0, 0.0, *to_dev(w), config=CFG)
    check_norm(got, want, False)
    with pytest.raises(AssertionError, match="x \\+ residual"):
        check_norm((got[0], x.to(DEV)), want, False)

    def rejected(y_alt):  # a y the check must reject (exact on CPU; on a GPU it only differs from the reference)
        assert not torch.equal(y_alt, want[0])
        if DEV.type == "cpu":
            with pytest.raises(AssertionError):
                check_norm((y_alt, got[1]), want, False)

    hf = x.float() + r.float()  # h unrounded
    rejected(linear_exact(ref.rms_norm(hf, nw.float(), 0.0).to(BF16), w))
    hf = (x + r).float()
    a = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True))).to(BF16).float() * nw.float()  # product unrounded
    rejected(F.linear(a, w.float()).to(BF16))

    want_silu = norm_reference(x, r, nw, 0.0, 0.0, w, None, True)
    got_silu = norm_gemv(*to_dev(x, r, nw), 0.0, 0.0, *to_dev(w), silu_mul=True, config=CFG)
    check_norm(got_silu, want_silu, True)
    gu = F.linear(ref.rms_norm(x + r, nw, 0.0).float(), w.float())  # [M, 2I] float32 sums, unrounded
    unrounded = (F.silu(gu[:, :20]) * gu[:, 20:]).to(BF16)
    assert not torch.equal(unrounded, want_silu[0])
    if DEV.type == "cpu":
        with pytest.raises(AssertionError):
            check_norm((unrounded, got_silu[1]), want_silu, True)


def test_silu_and_mul_reference_rounding():
    """What the kernel's epilogue computes is what reference.silu_and_mul does to a bfloat16 tensor in torch:
    round(round(g / (1 + exp(-g))) * u) from the rounded gate and up, for every finite bfloat16 gate value."""
    g = torch.Generator().manual_seed(10)
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(BF16)
    gate = gate[torch.isfinite(gate)]
    up = gate[torch.randperm(len(gate), generator=g)]
    gf = gate.float()
    model = ((gf / (1 + torch.exp(-gf))).to(BF16).float() * up.float()).to(BF16)
    want = ref.silu_and_mul(torch.cat((gate[:, None], up[:, None]), 1))[:, 0]
    assert torch.equal(model.isnan(), want.isnan())
    assert torch.equal(model[~want.isnan()], want[~want.isnan()])


def test_silu_epilogue_over_many_gate_values():
    """The kernel's SiLU-and-mul on 512 gate values spread over about [-14, 14]: random bfloat16 rows x [4, 128]
    normed and scaled by 8. Their RMSNorm is not exact-friendly, so the reference starts from the kernel's own
    activation, read back through identity weight rows (the sum over a one-hot row is exact): gate rows the
    identity, up rows a permutation of it, so gate = a and up = a permuted, each exact; only the epilogue is
    compared."""
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(4, 128, generator=g) * 24 - 12).to(BF16)
    eye = torch.eye(128)
    w = torch.cat((eye, eye[torch.randperm(128, generator=g)])).to(BF16)  # [2I, K]: gate rows, then up rows
    nw = torch.full((128,), 8.0, dtype=BF16)
    cfg = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    xd, nwd, wd = to_dev(x, nw, w)
    a, _ = norm_gemv(xd, None, nwd, 1e-6, 0.0, wd[:128], config=cfg)  # [4, 128]: the normed activation itself
    torch.testing.assert_close(a.cpu(), ref.rms_norm(x, nw, 1e-6), atol=0, rtol=2 ** -7)  # (rstd: not exact)
    assert a.abs().max() > 10
    got, _ = norm_gemv(xd, None, nwd, 1e-6, 0.0, wd, silu_mul=True, config=cfg)
    torch.testing.assert_close(got.cpu(), ref.silu_and_mul(linear_exact(a.cpu(), w)), **SILU_TOL)


# --------------------------------------------------------------------------------------------------- the API

def test_bad_inputs_raise():
    x, w = torch.zeros(2, 64, device=DEV), torch.zeros(8, 64, device=DEV)
    with pytest.raises(ValueError, match="decode rows"):  # more rows than a tile
        gemv(torch.zeros(17, 64, device=DEV), w)
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x, w.to(BF16))
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x, torch.zeros(8, 32, device=DEV))
    with pytest.raises(ValueError, match="row-major"):
        gemv(x, torch.zeros(64, 8, device=DEV).T)
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, torch.zeros(7, device=DEV))
    with pytest.raises(ValueError, match="gate and up"):
        norm_gemv(x, None, torch.ones(64, device=DEV), 1e-6, 0.0, w[:7], silu_mul=True)
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(x, x[:1], torch.ones(64, device=DEV), 1e-6, 0.0, w)
    with pytest.raises(ValueError, match="norm weight"):
        norm_gemv(x, None, torch.ones(32, device=DEV), 1e-6, 0.0, w)


def test_gemv_config_defaults_and_tuned_table():
    for n, k, silu in [(6144, 4096, False), (28672, 4096, True), (4096, 14336, False), (960, 576, False),
                       (3072, 576, True), (37, 100, False)]:
        cfg = gemv_config(1, n, k, BF16, silu)
        assert set(cfg) - {"LATE_RSTD"} == {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
        assert all(v > 0 and v & (v - 1) == 0 for v in (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]))
        assert 2 <= cfg["BLOCK_N"] <= 16 and cfg["BLOCK_K"] <= max(16, triton.next_power_of_2(k))
        if (n, k) in GEMV_TUNED:
            assert cfg == GEMV_TUNED[(n, k)]  # the swept M = 1 config, whatever it holds
            continue
        rows = 2 if silu else 1
        assert rows * cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 64 * 32 * cfg["num_warps"]  # accumulators fit
        for m in (2, 5, 16):  # the skinny GEMM: tl.dot tiles of at least 16, 512 bytes of a weight row a K step
            rc = gemv_config(m, n, k, BF16, silu)
            assert rc["BLOCK_N"] in (16, 32) and rc["BLOCK_K"] == min(256, max(16, triton.next_power_of_2(k)))
    assert triton_gemv._default_config(6144, 4096, BF16, False) == dict(BLOCK_N=8, BLOCK_K=512, num_warps=4,
                                                                          num_stages=3)
    assert triton_gemv._default_config(960, 576, BF16, False)["BLOCK_K"] == 128  # 576 = 4.5 x 128: 512 pads 78%
    assert gemv_config(2, 6144, 4096, BF16)["BLOCK_N"] == 16 and gemv_config(2, 28672 * 2, 4096, BF16, True)[
        "BLOCK_N"] == 32  # 16 output columns a program until 32 still gives two programs per SM


@pytest.mark.parametrize("m", [5, 9, 16])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_rows_beyond_four_equal_the_reference(m, silu_mul):
    """Verify-sized row counts (N + 1 = 5, two requests' 9 rows padded to 16, a full 16-row tile) through the
    skinny GEMM, normed with a residual and plain, exact inputs: equal to the unfused ops."""
    g = torch.Generator().manual_seed(m * 2 + silu_mul)
    x, r, nw, w, b = exact_norm_inputs(m, 80, 30, BF16, 2.0 ** -10, 0.0, True, True, g)
    got = norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, 0.0, *to_dev(w, b), silu_mul=silu_mul)
    check_norm(got, norm_reference(x, r, nw, 2.0 ** -10, 0.0, w, b, silu_mul), silu_mul)
    xg, wg, bg = exact_gemv_inputs(m, 45, 200, BF16, g, True)
    assert torch.equal(gemv(*to_dev(xg, wg, bg)).cpu(), linear_exact(xg, wg, bg))


# ------------------------------------------------------------------------------------------ GPU: real shapes

SHAPES = {"llama-3.1-8b": (4096, 6144, 4096, 14336), "smollm2-135m": (576, 960, 576, 1536)}  # H, qkv N, q, I


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5])  # the GEMV; verify's rows through the skinny GEMM
@pytest.mark.parametrize("model", list(SHAPES))
def test_real_shapes_match_unfused_path_and_replay_in_a_cuda_graph(model, m):
    from specserve.kernels import triton_act, triton_norm

    hidden, qkv, q_width, inter = SHAPES[model]
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(BF16)

    eps = 1e-5
    w_qkv, w_o = randn(qkv, hidden, scale=hidden ** -0.5), randn(hidden, q_width, scale=q_width ** -0.5)
    w_gu, w_down = randn(2 * inter, hidden, scale=hidden ** -0.5), randn(hidden, inter, scale=inter ** -0.5)
    n1, n2 = 1 + randn(hidden, scale=0.1), 1 + randn(hidden, scale=0.1)
    x, res, attn, act = randn(m, hidden), randn(m, hidden, scale=4.0), randn(m, q_width), randn(m, inter)

    def unfused():
        a, h = triton_norm.add_rms_norm(x, res, n1, eps)
        a2, h2 = triton_norm.add_rms_norm(x, h, n2, eps)
        return (F.linear(a, w_qkv), h, F.linear(attn, w_o), triton_act.silu_and_mul(F.linear(a2, w_gu)), h2,
                F.linear(act, w_down))

    def fused():
        y, h = norm_gemv(x, res, n1, eps, 0.0, w_qkv)
        gu, h2 = norm_gemv(x, h, n2, eps, 0.0, w_gu, silu_mul=True)
        return y, h, gemv(attn, w_o), gu, h2, gemv(act, w_down)

    def check(outs):
        for got, want in zip(outs, unfused()):
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)

    check(fused())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fused()
    for _ in range(2):
        for t, scale in ((x, 1.0), (res, 4.0), (attn, 1.0), (act, 1.0)):
            t.copy_(randn(*t.shape, scale=scale))
        graph.replay()
        check(outs)


# ---------------------------------------------------------------------------- the GEMV with its rows unrolled

ROWS_CFG = dict(CFG, GEMV=1)  # a config marked GEMV=1: the row-unrolled GEMV at more than one row


@pytest.mark.parametrize("m,bias", [(2, True), (5, False)])
def test_row_gemv_exact_inputs_equal_linear(m, bias):
    g = torch.Generator().manual_seed(70 + m)
    x, w, b = exact_gemv_inputs(m, 45, 200, BF16, g, bias)
    got = gemv(*to_dev(x, w, b), config=ROWS_CFG)
    assert torch.equal(got.cpu(), linear_exact(x, w, b))


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("m,residual,offset", [(3, True, 0.0), (5, False, 1.0)])
def test_row_gemv_norm_exact_inputs_equal_reference(m, residual, offset, silu_mul):
    g = torch.Generator().manual_seed(80 + m + silu_mul)
    x, r, nw, w, b = exact_norm_inputs(m, 144, 42, BF16, 2.0 ** -10, offset, residual, True, g)
    got = norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, offset, *to_dev(w, b), silu_mul=silu_mul, config=ROWS_CFG)
    check_norm(got, norm_reference(x, r, nw, 2.0 ** -10, offset, w, b, silu_mul), silu_mul)


def test_row_gemv_configs_and_policy_agree():
    """gemv_config gives the row-unrolled GEMV (GEMV=1) at 2..ROWS_GEMV_MAX rows exactly for the shapes of
    GEMV_TUNED_ROWS, the skinny GEMM otherwise; gemv_policy fuses more than one row only where a row config exists
    and the shape is measured faster at one row too; fused_rows takes the least over a layer's shapes."""
    from specserve.kernels.gemv_policy import FASTER, FASTER_ROWS, fused_rows

    for (n, k) in GEMV_TUNED_ROWS:
        assert all(gemv_config(m, n, k, BF16).get("GEMV") == 1 for m in range(2, triton_gemv.ROWS_GEMV_MAX + 1))
        assert "GEMV" not in gemv_config(triton_gemv.ROWS_GEMV_MAX + 1, n, k, BF16)
        assert "GEMV" not in gemv_config(1, n, k, BF16)  # one row: the GEMV anyway, its own (M = 1) config
    assert "GEMV" not in gemv_config(4, 7, 3, BF16)  # an unmeasured shape: the skinny GEMM
    for shape, most in FASTER_ROWS.items():
        assert shape in GEMV_TUNED_ROWS and shape in FASTER and 2 <= most <= triton_gemv.ROWS_GEMV_MAX
    one_row = next(s for s in sorted(FASTER) if s not in FASTER_ROWS)
    assert fused_rows([]) == 0 and fused_rows([(7, 3)]) == 0 and fused_rows([one_row, (7, 3)]) == 0
    assert fused_rows([one_row]) == 1
    assert fused_rows(sorted(FASTER_ROWS)) == (min(FASTER_ROWS.values()) if FASTER_ROWS else 0)
    if FASTER_ROWS:
        assert fused_rows(sorted(FASTER_ROWS) + [one_row]) == 1


@pytest.mark.parametrize("pdl", [1, 2])
@pytest.mark.parametrize("m,silu_mul", [(1, True), (1, False), (3, True)])
def test_gemv_pdl_order_of_loads_equals_plain(pdl, m, silu_mul):
    """PDL's kernel (the first K step's weights loaded before the grid-dependency wait, the loop from the second
    step) gives the plain kernel's outputs exactly; under the interpreter without the wait instructions, on a GPU
    launched with programmatic dependent launch. K of several steps and one step."""
    g = torch.Generator().manual_seed(90 + pdl + m)
    for k in (144, 16):
        x, r, nw, w, b = exact_norm_inputs(m, k, 42, BF16, 2.0 ** -10, 0.0, True, True, g)
        cfg = dict(ROWS_CFG if m > 1 else CFG, PDL=0)
        want = norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, 0.0, *to_dev(w, b), silu_mul=silu_mul, config=cfg)
        got = norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, 0.0, *to_dev(w, b), silu_mul=silu_mul,
                        config=dict(cfg, PDL=pdl))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        plain = gemv(*to_dev(x, w, b), config=cfg)
        assert torch.equal(gemv(*to_dev(x, w, b), config=dict(cfg, PDL=pdl)), plain)
        check_norm(got, norm_reference(x, r, nw, 2.0 ** -10, 0.0, w, b, silu_mul), silu_mul)


@pytest.mark.parametrize("m,silu_mul", [(1, True), (1, False), (3, False)])
def test_norm_statistics_step_width_does_not_change_outputs(m, silu_mul):
    """The RMSNorm statistics summed NORM_BLOCK columns a step: one step over all of K (the default), K / BLOCK_K
    steps, or a width that leaves a ragged last step, give the same outputs and the reference's (exact inputs)."""
    g = torch.Generator().manual_seed(131 + m)
    k = 144
    x, r, nw, w, b = exact_norm_inputs(m, k, 42, BF16, 2.0 ** -10, 0.0, True, True, g)
    cfg = dict(ROWS_CFG if m > 1 else CFG, PDL=0)
    assert triton_gemv.norm_block(k, cfg["BLOCK_K"], cfg["num_warps"]) == 256  # all of K in one step
    want = norm_reference(x, r, nw, 2.0 ** -10, 0.0, w, b, silu_mul)
    outs = [norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, 0.0, *to_dev(w, b), silu_mul=silu_mul,
                      config=dict(cfg, NORM_BLOCK=nb)) for nb in (256, 32, 64)]
    outs.append(norm_gemv(*to_dev(x, r, nw), 2.0 ** -10, 0.0, *to_dev(w, b), silu_mul=silu_mul, config=cfg))
    for got in outs:
        check_norm(got, want, silu_mul)
        assert torch.equal(got[0], outs[0][0]) and torch.equal(got[1], outs[0][1])


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("m,silu_mul,offset,residual,bias,pdl", [(1, False, 0.0, True, False, 0),
                                                                 (1, True, 0.0, True, False, 1),
                                                                 (1, False, 1.0, False, True, 2),
                                                                 (3, True, 0.0, True, True, 0),
                                                                 (2, False, 1.0, True, False, 0)])
def test_late_rstd_close_to_reference(m, silu_mul, offset, residual, bias, pdl, dtype):
    """LATE_RSTD (the squares summed in the K loop, 1/rms after it; the activation unrounded) gives the new
    residual exactly and outputs within the output's rounding of the reference (float32: to float32 sums'
    order), unrolled rows and PDL's order of loads included; the exact-rounding path's checks
    (test_norm_gemv_checks_reject_other_roundings) are not its contract."""
    g = torch.Generator().manual_seed(170 + m + 2 * silu_mul + pdl)
    k, n = 144, 40
    x, r = torch.randn(m, k, generator=g).to(dtype), (torch.randn(m, k, generator=g) * 3).to(dtype)
    nw = (offset == 0) + 0.2 * torch.randn(k, generator=g)
    nw = nw.to(dtype)
    w = (torch.randn(2 * n if silu_mul else n, k, generator=g) / 8).to(dtype)
    b = torch.randn(w.shape[0], generator=g).to(dtype) if bias else None
    r = r if residual else None
    cfg = dict(CFG, PDL=pdl, **({"GEMV": 1} if m > 1 else {}))
    exact, h0 = norm_gemv(*to_dev(x, r, nw), 1e-5, offset, *to_dev(w, b), silu_mul=silu_mul, config=cfg)
    late, h1 = norm_gemv(*to_dev(x, r, nw), 1e-5, offset, *to_dev(w, b), silu_mul=silu_mul,
                         config=dict(cfg, LATE_RSTD=1))
    assert torch.equal(h1, h0)
    hf = (x.float() + r.float()) if residual else x.float()
    a = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * (nw.float() + offset)
    want = F.linear(a, w.float(), b.float() if bias else None)  # float32 throughout
    if silu_mul:
        want = ref.silu_and_mul(want.to(dtype).float()) if dtype == F32 else None
    if dtype == F32:
        torch.testing.assert_close(late.cpu(), want, atol=1e-5, rtol=1e-4)
    else:  # within two output roundings of the exact-rounding path (whose activation is rounded twice)
        scale = exact.float().abs().max().item()
        torch.testing.assert_close(late.float(), exact.float(), atol=2 ** -6 * scale, rtol=2 ** -6)
        if not silu_mul:
            torch.testing.assert_close(late.float().cpu(), want, atol=2 ** -7 * scale, rtol=2 ** -7)
    assert not torch.equal(late, exact) or dtype == F32  # bf16: another rounding of the activation shows


def test_norm_block_widths():
    """All of a hidden size's K in one step up to 32 columns a thread, never narrower than the GEMV's K step."""
    assert triton_gemv.norm_block(4096, 256, 4) == 4096
    assert triton_gemv.norm_block(4096, 512, 2) == 2048  # 64 threads x 32
    assert triton_gemv.norm_block(576, 1024, 4) == 1024  # the K step is wider already
    assert triton_gemv.norm_block(7168, 256, 8) == 8192
