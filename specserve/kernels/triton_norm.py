"""Triton RMSNorm and fused residual-add + RMSNorm (references: kernels/reference.py rms_norm, add_rms_norm).

Memory bound: one pass over each row (x, and the residual when fused), statistics in float32, several rows per
program when rows are short (per-head q/k norms have rows of head_dim elements). Rounding follows the reference:
the sum x + residual is rounded to its dtype before the statistics, and the normalised row is rounded to x's dtype
before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import one_wave_pdl, pdl_enter, pdl_kwargs

_TARGET_ELEMS = 4096  # elements per program: rows are packed until a program holds about this many


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n_rows, hidden, eps,
                     stride_x, stride_r, stride_o, stride_s, heads, stride_xh,
                     ROWS: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     W_OFFSET: tl.constexpr, GDC: tl.constexpr):
    """x rows: row r at (r // heads) * stride_x + (r % heads) * stride_xh (heads 1: plain rows), so per-head
    norms read q / k straight from a split of the fused projection. GDC: launched with PDL (kernels/launch.py
    one_wave_pdl): the norm weight (never written by another kernel) is read before the grid-dependency wait."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_ok = cols < hidden
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + W_OFFSET
    pdl_enter(GDC)
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)  # row * stride can pass 2^31 for large batches
    x_off = (rows64 // heads) * stride_x + (rows64 % heads) * stride_xh  # [ROWS]
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        s = (xf + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded like torch's x + residual
        tl.store(sum_ptr + rows64[:, None] * stride_s + cols[None, :], s, mask=mask)
        xf = s.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / hidden  # [ROWS]
    y = xf * tl.rsqrt(var + eps)[:, None]
    if W_OFFSET == 0.0:  # zero-centred weights (W_OFFSET 1) keep the normed row in float32, as the reference
        if HAS_RESIDUAL:
            y = y.to(sum_ptr.dtype.element_ty).to(tl.float32)
        else:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], (y * w[None, :]).to(out_ptr.dtype.element_ty),
             mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> a 2-D [rows, H] view (or copy) with a unit stride along H."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2: torch.Tensor, r2: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor, s: torch.Tensor | None,
            eps: float, weight_offset: float = 0.0) -> None:
    """x2: [rows, H], or [T, heads, H] with a unit stride along H (read in place, rows t * heads + h)."""
    heads, stride_xh = (x2.shape[1], x2.stride(1)) if x2.dim() == 3 else (1, 0)
    n_rows, hidden = x2.numel() // x2.shape[-1], x2.shape[-1]
    if n_rows == 0:
        return
    block_h = triton.next_power_of_2(hidden)
    rows = max(1, min(64, _TARGET_ELEMS // block_h))
    num_warps = 4 if block_h * rows <= 4096 else (8 if block_h <= 8192 else 16)
    grid = (triton.cdiv(n_rows, rows),)
    gdc = one_wave_pdl(x2.device, grid[0])
    _rms_norm_kernel[grid](
        x2, r2 if r2 is not None else x2, w, out, s if s is not None else out, n_rows, hidden, eps,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, out.stride(0), s.stride(0) if s is not None else 0,
        heads, stride_xh,
        ROWS=rows, BLOCK_H=block_h, HAS_RESIDUAL=r2 is not None, W_OFFSET=float(weight_offset), GDC=gdc,
        num_warps=num_warps, **pdl_kwargs(gdc),
    )


def _out_rows(out: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    assert out.dtype == dtype and out.is_contiguous() and out.numel() == shape.numel()
    return out.view(shape)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             weight_offset: float = 0.0) -> torch.Tensor:
    """x [..., H], w [H] -> [..., H] in the dtype of x * w (written into `out` when given); weight_offset 1.0 for
    zero-centred weights, (1 + w), the row in x's dtype."""
    # per-head rows of a strided [T, heads, H] view are read in place; anything else as 2-D rows
    x2 = x if x.dim() == 3 and x.stride(-1) == 1 else _as_rows(x)
    dtype = x.dtype if weight_offset else torch.promote_types(x.dtype, w.dtype)
    o = _out_rows(out, torch.Size((x2.numel() // x.shape[-1], x.shape[-1])), dtype, x.device)  # [rows, H]
    _launch(x2, None, w.contiguous(), o, None, eps, weight_offset)
    return o.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                 weight_offset: float = 0.0):
    """(rms_norm(x + residual), x + residual), one pass over x and residual."""
    x2, r2 = _as_rows(x), _as_rows(residual)
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = _out_rows(residual_out, x2.shape, s_dtype, x.device)  # [rows, H] the new residual
    dtype = s_dtype if weight_offset else torch.promote_types(s_dtype, w.dtype)
    o = _out_rows(out, x2.shape, dtype, x.device)  # [rows, H]
    _launch(x2, r2, w.contiguous(), o, s, eps, weight_offset)
    return o.view(x.shape), s.view(x.shape)
