"""Inputs on which kernels' float32 sums and RMSNorm statistics are exact, so a kernel must equal its torch reference
bit for bit in any order of accumulation (tests/test_triton_gemv.py, tests/test_triton_router.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BF16, F16 = torch.bfloat16, torch.float16
TINY = {BF16: 2.0 ** -12, F16: 2.0 ** -14}  # under half an ulp of any |h| >= 1/4: x + TINY rounds back to x


def multiples(shape, lo: float, hi: float, step: float, g: torch.Generator) -> torch.Tensor:
    """float32 random multiples of `step` in [lo, hi]."""
    return torch.randint(round(lo / step), round(hi / step) + 1, shape, generator=g).float() * step


def assert_exact_sums(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Every product a[m, k] * w[n, k] (and the bias) is a multiple of q = 2^-16 and the sum of their magnitudes
    stays under 2^24 q: every partial sum, in any order, is exact in float32."""
    q = 2.0 ** -16
    p = a.double().cpu()[:, None, :] * w.double().cpu()[None]  # [M, N, K]
    mags = p.abs().sum(-1)
    if bias is not None:
        p = torch.cat((p, bias.double().cpu().expand(p.shape[:2])[..., None]), -1)
        mags = mags + bias.double().cpu().abs()
    assert torch.all(torch.frac(p / q) == 0) and mags.max() < 2 ** 24 * q, "inputs are not exact-friendly"


def linear_exact(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's result, its exact float32 sums rounded once to a's dtype (on CPU)."""
    assert_exact_sums(a, w, bias)
    out = F.linear(a.cpu().float(), w.cpu().float(), None if bias is None else bias.cpu().float()).to(a.dtype)
    assert torch.equal(out, F.linear(a.cpu(), w.cpu(), None if bias is None else bias.cpu()))  # as torch rounds
    return out


def four_squares(r: int) -> tuple[int, int, int, int]:
    """a, b, c, d >= 0 with a^2 + b^2 + c^2 + d^2 = r (Lagrange: there always are)."""
    for a in range(math.isqrt(r), -1, -1):
        for b in range(math.isqrt(r - a * a), -1, -1):
            for c in range(math.isqrt(r - a * a - b * b), -1, -1):
                d2 = r - a * a - b * b - c * c
                if math.isqrt(d2) ** 2 == d2:
                    return a, b, c, math.isqrt(d2)
    raise AssertionError(r)


def exact_norm_rows(m: int, k: int, eps: float, g: torch.Generator) -> tuple[torch.Tensor, list[float]]:
    """h [m, K] float32 multiples of 1/8 whose row r has mean square exactly 4^-(r % 2) - eps, so var + eps is a
    power of 4: the sum of squares is exact in float32, var too, and rsqrt(var + eps) an exact power of 2. Random
    entries, then four (placed at random) that bring the sum of squares to its target. Returns (h, the 4^j)."""
    rows, powers = [], []
    for r in range(m):
        power = 4.0 ** -(r % 2)
        units = 64 * k * (power - eps)  # the target sum of n^2, h = n / 8
        assert units == int(units), "K * eps * 64 must be an integer"
        bound = int(math.sqrt(1.8 * 64 * power))  # mean n^2 about 0.6 of the target's
        while True:
            n = torch.randint(-bound, bound + 1, (k,), generator=g)
            rest = int(units) - int((n[4:] ** 2).sum())
            if rest >= 0:
                break
        signs = torch.randint(0, 2, (4,), generator=g) * 2 - 1
        n[:4] = torch.tensor(four_squares(rest)) * signs
        rows.append(n[torch.randperm(k, generator=g)].float() / 8)
        powers.append(power)
    return torch.stack(rows), powers


def ieee_rstd_rows(m: int, k: int, eps: float, g: torch.Generator) -> torch.Tensor:
    """h [m, K] random multiples of 1/8 in [-3/2, 3/2] (their sums of squares are exact, and torch's mean is the
    sum / K the kernel computes), redrawn until torch's rsqrt(var + eps) equals 1 / sqrt(var + eps), as the
    interpreter computes it: rstd is the same float32 in both, but no power of 2, so h * rstd needs rounding."""
    while True:
        h = multiples((m, k), -1.5, 1.5, 1 / 8, g)
        v = h.pow(2).mean(-1) + eps
        if torch.equal(v - eps, h.pow(2).sum(-1) / k) and torch.equal(torch.rsqrt(v), 1 / torch.sqrt(v)):
            return h


def exact_norm_inputs(m: int, k: int, n: int, dtype, eps: float, offset: float, residual: bool, bias: bool,
                      g: torch.Generator, h: torch.Tensor | None = None):
    """(x, residual or None, norm_w, w, bias) in dtype with h = x + residual (rounded to dtype) = exact_norm_rows
    (or the rows h given).
    With a residual in bfloat16 / float16, about half the entries of |h| >= 1/4 come as x = h, residual = +-TINY:
    x + residual is rounded back to h (unrounded, the statistics and the normed row would differ); the rest as
    residual a multiple of 1/8 in [-1, 1], x = h - residual (exact). norm_w has 8-bit mantissas (multiples of 1/128
    in [1/2, 2), or in [-1/2, 1/2] for offset 1): its products with the normed row need rounding in bfloat16."""
    powers = None
    if h is None:
        h, powers = exact_norm_rows(m, k, eps, g)
    x, r = h, None
    if residual:
        r = multiples((m, k), -1, 1, 1 / 8, g)
        x = h - r
        if dtype in TINY:
            sel = (h.abs() >= 0.25) & (torch.rand(h.shape, generator=g) < 0.5)
            tiny = TINY[dtype] * (torch.randint(0, 2, h.shape, generator=g) * 2 - 1)
            x, r = torch.where(sel, h, x), torch.where(sel, tiny, r)
            assert not torch.equal(x + r, h)  # the rounding of x + residual matters
        x, r = x.to(dtype), r.to(dtype)
        assert torch.equal(x + r, h.to(dtype))
    else:
        x = x.to(dtype)
    nw = (multiples((k,), -0.5, 0.5, 1 / 128, g) if offset else multiples((k,), 0.5, 1.99, 1 / 128, g)).to(dtype)
    w = multiples((n, k), -0.5, 0.5, 1 / 8, g).to(dtype)
    b = multiples((n,), -2, 2, 1 / 8, g).to(dtype) if bias else None
    if powers is not None:
        var = h.to(dtype).float().pow(2).mean(-1)
        assert var.tolist() == [p - eps for p in powers]  # torch's mean is exact on these rows
        assert torch.equal(torch.rsqrt(var + eps), torch.tensor(powers).rsqrt())
    return x, r, nw, w, b
