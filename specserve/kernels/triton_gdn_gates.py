"""Triton kernels for the gated delta net's elementwise work (references: kernels/reference.py gdn_gating,
gated_rms_norm): each replaces a chain of five to seven small torch kernels per GDN layer (casts, softplus, exp,
sigmoid, products), which at decode batch sizes cost more in launches than in bytes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gating_kernel(a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, n_rows, heads, stride_a, stride_b,
                   ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = (rows < n_rows)[:, None] & (h < heads)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + r64 * stride_a + h[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + h[None, :], mask=mask, other=0.0).to(tl.float32)
    alog = tl.load(alog_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
    x = a + dt[None, :]
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold of 20
    tl.store(g_ptr + r64 * heads + h[None, :], -tl.exp(alog)[None, :] * softplus, mask=mask)
    tl.store(beta_ptr + r64 * heads + h[None, :], 1.0 / (1.0 + tl.exp(-b)), mask=mask)


def gdn_gating_triton(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] with a unit stride along heads (views of the projection output are fine) -> (g, beta) float32."""
    t, heads = a.shape
    assert a.stride(-1) == 1 and b.stride(-1) == 1
    g = torch.empty((t, heads), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if t:
        block_h = triton.next_power_of_2(heads)
        rows = max(1, min(64, 2048 // block_h))
        _gating_kernel[(triton.cdiv(t, rows),)](a, b, a_log, dt_bias, g, beta, t, heads, a.stride(0), b.stride(0),
                                                ROWS=rows, BLOCK_H=block_h, num_warps=4)
    return g, beta


@triton.jit
def _gated_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, n_rows, dim, eps, stride_x, stride_z, stride_o,
                       ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    mask = (rows < n_rows)[:, None] & d_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + d[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / dim  # [ROWS]
    dt = x_ptr.dtype.element_ty
    y = (xf * tl.rsqrt(var + eps)[:, None]).to(dt).to(tl.float32)  # rounded like the reference's rms_norm
    w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    y = (y * w[None, :]).to(dt).to(tl.float32)  # the weight multiply rounded to x's dtype, as torch's
    z = tl.load(z_ptr + r64 * stride_z + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + r64 * stride_o + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [N, D] (unit stride along D; gate may be a strided view) -> [N, D] in x's dtype."""
    n, dim = x.shape
    assert x.stride(-1) == 1 and gate.stride(-1) == 1
    out = torch.empty((n, dim), dtype=x.dtype, device=x.device)
    if n:
        block_d = triton.next_power_of_2(dim)
        rows = max(1, min(64, 4096 // block_d))
        _gated_norm_kernel[(triton.cdiv(n, rows),)](x, gate, w, out, n, dim, eps, x.stride(0), gate.stride(0),
                                                    out.stride(0), ROWS=rows, BLOCK_D=block_d, num_warps=4)
    return out
