"""Torch references of the FP8 (W8A8, e4m3) linear layer: activation and weight quantisers and the linear itself.
Plain torch ops, so they run on CPU and GPU; every kernel of kernels/triton_fp8.py is tested against them.

The quantisation rule, shared bit for bit by these references and every kernel (so that a decode step's GEMV and a
prefill's two-step GEMM see the same quantised activations): a group g of values, in float32,

    amax = max(|x_g|);  s = max(amax, 1e-10) / 448;  q = e4m3(clamp(x_g / s, -448, 448))

with the cast to e4m3 rounding to nearest even (torch's and the GPU's conversion; 448 is e4m3's largest finite
value, so the group's largest magnitude maps onto it and nothing saturates). `x_g / s` is the correctly rounded
float32 quotient (torch's `/`; the kernels use div_rn, not the GPU's faster approximate division, which could flip a
rounding near a midpoint). The group is 1 x bk values of a row for block-scaled weights (DeepSeek-V3 / GLM / Qwen FP8
checkpoints: a scale per bn x bk weight block), the whole row for per-channel weights (a scale per output row).

Output: float32 sums of (xq * sx) * (wq * sw) over K, + bias in float32, cast to x's dtype.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_AMAX = 1e-10  # a group of zeros gets a tiny scale, never a division by zero
BLOCK_SIZES = (16, 32, 64, 128)  # weight block sides the kernels support
_ROWS_PER_CHUNK = 1024  # weight rows quantised at a time: a float32 copy of 1024 x K, not of the whole weight


def _quantize_groups(xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xf [..., G, g] float32 -> (e4m3 [..., G, g], float32 scales [..., G]): the rule over the last dim."""
    amax = xf.abs().amax(dim=-1).clamp_min(MIN_AMAX)  # [..., G]
    # divided by a tensor, not a Python number: on CUDA torch turns a division by a scalar into a product with
    # its rounded reciprocal, one ulp off the kernels' correctly rounded quotient (and torch's on a CPU)
    s = amax / amax.new_tensor(FP8_MAX)  # [..., G]
    return (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def check_block(block: tuple[int, int] | None) -> None:
    """ValueError unless block is None (per-channel) or (bn, bk) with both sides in BLOCK_SIZES."""
    if block is None:
        return
    if len(block) != 2 or any(b not in BLOCK_SIZES for b in block):
        raise ValueError(f"fp8 weight block {tuple(block)}: each side must be one of {BLOCK_SIZES} (or None for "
                         "per-channel scales)")


def quantize_act_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, sx [M, ceil(K / group)] float32): one scale per token per `group` columns
    (the activations of block-scaled weights, group = bk, so each weight block meets one activation scale). A last
    partial group is padded with zeros, which change no amax."""
    m, k = x.shape
    groups = -(-k // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k))  # [M, G * group]
    q, s = _quantize_groups(xf.view(m, groups, group))
    return q.view(m, groups * group)[:, :k], s


def quantize_act_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, sx [M] float32): one scale per token (the activations of per-channel
    weights: the product's scale is then sx[m] * sw[n], applied once to the float32 sum)."""
    q, s = _quantize_groups(x.float())
    return q, s


def check_scales(x_shape: tuple[int, ...], wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
                 bias: torch.Tensor | None = None) -> None:
    """ValueError with what was expected unless wq [N, K] e4m3, sw (block: [ceil(N/bn), ceil(K/bk)], channel: [N])
    float32 and bias [N] (if any) fit x [..., K]."""
    check_block(block)
    if wq.dtype != FP8 or wq.dim() != 2:
        raise ValueError(f"fp8 weight: expected a 2-d float8_e4m3fn [N, K], got {wq.dtype} {tuple(wq.shape)}")
    n, k = wq.shape
    if x_shape[-1] != k:
        raise ValueError(f"fp8 linear: x has {x_shape[-1]} columns, the weight [N, K] = {tuple(wq.shape)}")
    want = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    if tuple(sw.shape) != want or sw.dtype != torch.float32:
        kind = "per-channel" if block is None else f"block {tuple(block)}"
        raise ValueError(f"fp8 weight scale: expected float32 {want} for weight {tuple(wq.shape)} ({kind}), got "
                         f"{sw.dtype} {tuple(sw.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"fp8 linear: bias of shape {tuple(bias.shape)}, expected ({n},)")


def dequantize_weight(wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """wq [N, K] e4m3, sw ([N] or [ceil(N/bn), ceil(K/bk)]) -> [N, K] float32: each value times its scale."""
    n, k = wq.shape
    if block is None:
        return wq.float() * sw[:, None]
    bn, bk = block
    return wq.float() * sw.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def fp8_linear_ref(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = dequant(quantize(x [..., K])) @ dequant(wq [N, K], sw)^T (+ bias), in float32, cast to x's
    dtype. block (bn, bk): block-scaled weights, x quantised per token per bk columns; None: per-channel weights
    (sw [N]), x quantised per token."""
    check_scales(tuple(x.shape), wq, sw, block, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)  # [M, K]
    if block is None:
        xq, sx = quantize_act_tokens(x2)
        xd = xq.float() * sx[:, None]
    else:
        xq, sx = quantize_act_groups(x2, block[1])
        xd = xq.float() * sx.repeat_interleave(block[1], 1)[:, :k]
    y = xd @ dequantize_weight(wq, sw, block).t()  # [M, N] float32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, wq.shape[0])


def quantize_weight_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype, any device) -> (wq [N, K] e4m3, sw [N] float32): the rule per output row, for
    online ("ptpc") quantisation of a bf16 checkpoint at load. Done _ROWS_PER_CHUNK rows at a time, so that a large
    weight (28672 x 4096) never needs a float32 copy of itself."""
    n, k = w.shape
    wq = torch.empty((n, k), dtype=FP8, device=w.device)
    sw = torch.empty(n, dtype=torch.float32, device=w.device)
    for r in range(0, n, _ROWS_PER_CHUNK):
        wq[r:r + _ROWS_PER_CHUNK], sw[r:r + _ROWS_PER_CHUNK] = _quantize_groups(w[r:r + _ROWS_PER_CHUNK].float())
    return wq, sw


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (wq [N, K] e4m3, sw [ceil(N/bn), ceil(K/bk)] float32): the rule per bn x bk block (the layout of
    DeepSeek-V3 style FP8 checkpoints; partial edge blocks padded with zeros). A chunk of whole block rows at a
    time, as quantize_weight_channels."""
    check_block(block)
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    wq = torch.empty((n, k), dtype=FP8, device=w.device)
    sw = torch.empty((gn, gk), dtype=torch.float32, device=w.device)
    step = max(1, _ROWS_PER_CHUNK // bn)  # block rows per chunk
    for g in range(0, gn, step):
        rows = w[g * bn:(g + step) * bn].float()  # [r, K]
        r, blocks = rows.shape[0], min(step, gn - g)
        padded = torch.nn.functional.pad(rows, (0, gk * bk - k, 0, blocks * bn - r))  # [blocks * bn, gk * bk]
        tiles = padded.view(blocks, bn, gk, bk).permute(0, 2, 1, 3).reshape(blocks, gk, bn * bk)
        q, s = _quantize_groups(tiles)  # [blocks, gk, bn * bk], [blocks, gk]
        q = q.view(blocks, gk, bn, bk).permute(0, 2, 1, 3).reshape(blocks * bn, gk * bk)
        wq[g * bn:g * bn + r] = q[:r, :k]
        sw[g:g + blocks] = s
    return wq, sw
