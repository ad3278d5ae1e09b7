"""Triton SiLU-and-mul (reference: kernels/reference.py silu_and_mul).

x [T, 2I] holds (gate | up); out [T, I] = silu(gate) * up. Memory bound: each program reads one contiguous
BLOCK of gate and of up for one row. Rounding follows torch: silu's result is rounded to the input dtype before
the multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import one_wave_pdl, pdl_enter, pdl_kwargs

_MAX_BLOCK = 2048


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, GDC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pdl_enter(GDC)  # launched with PDL (one_wave_pdl): the next kernel may launch; wait for our inputs
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., 2I] -> [..., I] (written into `out` when given)."""
    inter = x.shape[-1] // 2
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)  # [rows, I]
    else:
        assert out.dtype == x.dtype and out.is_contiguous() and out.numel() == x2.shape[0] * inter
        out = out.view(x2.shape[0], inter)
    if x2.shape[0] > 0 and inter > 0:
        block = min(_MAX_BLOCK, triton.next_power_of_2(inter))
        grid = (x2.shape[0], triton.cdiv(inter, block))
        gdc = one_wave_pdl(x2.device, grid[0] * grid[1])
        _silu_and_mul_kernel[grid](x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, GDC=gdc,
                                   num_warps=4 if block <= 1024 else 8, **pdl_kwargs(gdc))
    return out.view(*x.shape[:-1], inter)
