"""Torch reference of the FP8 (W8A8) fused MoE, and the checks of its arguments' shapes.

Two weight layouts, as FP8 checkpoints store them, stacked per expert like the bf16 MoE's (w13 [E, 2I, H]: gate
rows, then up rows; w2 [E, H, I]), float8_e4m3fn with float32 scales, the real weight being wq * scale:
  * block-scaled, block = (bn, bk) (DeepSeek-V3, GLM-5, Qwen3 FP8): one scale per bn x bk block, s13
    [E, ceil(2I/bn), ceil(H/bk)], s2 [E, ceil(H/bn), ceil(I/bk)]; I % bn == 0, so no block mixes gate and up rows.
    Activations quantized per row and group of bk columns: x per (token, group of H), the act per ((token, k)
    pair, group of I).
  * per-channel, block None (llm-compressor's compressed-tensors FP8 "dynamic": one scale per output row, or one
    per tensor broadcast to its rows): s13 [E, 2I], s2 [E, H]. Activations quantized per row: x per token, the act
    per pair (the same rule with one group as wide as the row).
"""

from __future__ import annotations

import torch

from specserve.kernels.reference import silu_and_mul

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
MIN_AMAX = 1e-10  # an all-zero group still gets a finite, nonzero scale


def _quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (q [..., n] float8_e4m3fn, scales [..., ceil(n / group)] float32), per group of `group`
    columns (the last one may be shorter): amax = max |x_g|, s = max(amax, 1e-10) / 448, q = clamp(x_g / s, -448,
    448) rounded to e4m3 (nearest even), all in float32. x_g ~= q * s. The rule the Triton kernel applies: to x
    by the dense FP8 linear's quantizer (kernels/triton_fp8.py), to the act in its gate/up GEMM's epilogue
    (kernels/triton_fp8_tiles.py quantize_groups)."""
    n = x.shape[-1]
    groups = -(-n // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - n))  # zero columns change no amax
    xg = xf.unflatten(-1, (groups, group))  # [..., G, group]
    amax = xg.abs().amax(-1).clamp_min(MIN_AMAX)  # [..., G]
    s = amax / amax.new_tensor(FP8_MAX)  # [..., G] (a tensor divisor: reference_fp8._quantize_groups says why)
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2)[..., :n], s


def _dequantize_groups(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """(q [..., n], s [..., G]) -> q * s over each group, float32 [..., n]."""
    return q.float() * s.repeat_interleave(group, -1)[..., :q.shape[-1]]


def dequantize_blocks(wq: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """wq [..., N, K] FP8, s [..., ceil(N/bn), ceil(K/bk)] -> float32 [..., N, K]: each value times its block's
    scale."""
    bn, bk = block
    n, k = wq.shape[-2:]
    return wq.float() * s.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]


def dequantize_experts(wq: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """Either layout's stacked weights -> float32 [..., N, K]: block scales (dequantize_blocks) or, block None, one
    scale per row (s [..., N])."""
    if block is None:
        return wq.float() * s[..., None]
    return dequantize_blocks(wq, s, block)


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (wq [..., N, K] float8_e4m3fn, s [..., N] float32): one scale per row, amax / 448, as
    llm-compressor's channel strategy (tests and benchmarks make per-channel FP8 experts with it)."""
    amax = w.float().abs().amax(-1).clamp_min(MIN_AMAX)  # [..., N]
    s = amax / amax.new_tensor(FP8_MAX)  # a tensor divisor, as _quantize_groups
    return (w.float() / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (wq [..., N, K] float8_e4m3fn, s [..., ceil(N/bn), ceil(K/bk)] float32): one scale per
    bn x bk block, amax / 448 as checkpoints are quantized (tests and benchmarks make FP8 weights with it)."""
    bn, bk = block
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = wf.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(MIN_AMAX)  # [..., nb, kb]
    s = amax / amax.new_tensor(FP8_MAX)  # a tensor divisor, as _quantize_groups
    q = (blocks / s[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-4, -3).flatten(-2)[..., :n, :k], s


def check_fp8_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  block) -> tuple[int, int] | None:
    """Raises ValueError unless the FP8 MoE's arguments fit together (shapes only: no host sync); -> (bn, bk), or
    None for per-channel scales (block None)."""
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"FP8 fused MoE: block must be None (per-channel) or two positive ints (bn, bk), got "
                         f"{block!r}")
    if w13.dim() != 3 or w2.dim() != 3 or x.dim() != 2:
        raise ValueError(f"FP8 fused MoE: x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got x "
                         f"{tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    e, h, i = w2.shape
    if w13.shape != (e, 2 * i, h) or x.shape[1] != h:
        raise ValueError(f"FP8 fused MoE: w13 {tuple(w13.shape)} and x {tuple(x.shape)} do not match w2 "
                         f"{tuple(w2.shape)} (expected w13 {(e, 2 * i, h)}, x [T, {h}])")
    if w13.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"FP8 fused MoE: w13 and w2 must be float8_e4m3fn, got {w13.dtype} and {w2.dtype}")
    if block is None:
        want13, want2, what = (e, 2 * i), (e, h), "per-channel scales"
    else:
        bn, bk = block
        if i % bn:
            raise ValueError(f"FP8 fused MoE: the intermediate size {i} must be a multiple of the weight block's "
                             f"rows {bn} (a block must not mix gate and up rows)")
        want13, want2, what = (e, -(-2 * i // bn), -(-h // bk)), (e, -(-h // bn), -(-i // bk)), f"block {block}"
    for name, s, want in (("w13_scale", s13, want13), ("w2_scale", s2, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"FP8 fused MoE: {name} must be float32 {want} for {what}, got {s.dtype} "
                             f"{tuple(s.shape)}")
    return None if block is None else (bn, bk)


def fused_moe_fp8_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                      block: tuple[int, int] | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                      ) -> torch.Tensor:
    """reference.fused_moe with FP8 weights and activations: x [T, H] (float32 or bfloat16); w13, s13, w2, s2 as
    above; block (bn, bk), or None for per-channel scales; topk_weights [T, K] float32; topk_ids [T, K] int64 ->
    [T, H] in x's dtype.

    Per expert (a host loop over the chosen ones): x quantized per (token, bk columns; per-channel: per token),
    dequantized in float32 and multiplied by the dequantized w13 in float32; gate and up rounded to x's dtype,
    silu rounded, the product rounded (silu_and_mul on x's dtype, as the bf16 reference); that act quantized per
    (pair, bk columns of I; per-channel: per pair), dequantized, times the dequantized w2, rounded to x's dtype.
    The pairs' outputs are summed in float32 in k order (the kernels' order), weighted, then cast."""
    check_fp8_moe(x, w13, s13, w2, s2, block)
    t, k = topk_ids.shape
    h, i = x.shape[1], w2.shape[2]
    # activation groups: bk columns, or a whole row (per token / per pair) for per-channel weights
    x_group, act_group = (h, i) if block is None else (block[1], block[1])
    flat = topk_ids.reshape(-1)  # [T*K]
    xd = _dequantize_groups(*_quantize_groups(x, x_group), x_group)  # [T, H] float32, what the kernel's dots see
    y = torch.zeros((t * k, h), dtype=torch.float32, device=x.device)  # [T*K, H] each pair's expert output
    for e in flat.unique().tolist():  # reference only: reads the chosen experts, host loop
        sel = (flat == e).nonzero().squeeze(1)  # [n] (token, k) pairs routed to e
        gu = (xd[sel // k] @ dequantize_experts(w13[e], s13[e], block).T).to(x.dtype)  # [n, 2I]
        act = silu_and_mul(gu)  # [n, I] in x's dtype
        ad = _dequantize_groups(*_quantize_groups(act, act_group), act_group)  # [n, I] float32
        y[sel] = (ad @ dequantize_experts(w2[e], s2[e], block).T).to(x.dtype).float()
    y = y.view(t, k, h)
    wts = topk_weights.float()
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    for kk in range(k):  # k order, as the kernels sum
        out += wts[:, kk, None] * y[:, kk]
    return out.to(x.dtype)
