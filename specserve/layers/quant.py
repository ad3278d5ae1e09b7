"""Weight-only int8 for a drafter on CPU (`--speculative-draft-model-quantization int8`).

A CPU decode step streams every weight from DRAM, so a draft forward costs its weight bytes: for the SmolLM2 head
(16384-token vocabulary, aux layers) about 60 MB in float32, two forwards per step at N = 2. Per output row,
symmetric int8 (scale = max |w| / 127) stores a quarter of that; torch's CPU kernel for it
(`aten._weight_int8pack_mm`, bfloat16 activations) took the 16384 x 576 draft lm-head from 3.2 ms (F.linear) to
0.7 ms at one row. Only draft tokens change, and only a little: verification keeps the output exactly the target's.
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Weight:
    """A per-row int8 copy of a float32 CPU weight [out, in] and its bfloat16 scales [out], built lazily and rebuilt
    whenever the weight changes (keyed as linear.PackedWeight: data_ptr, version counter, shape)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.qweight: torch.Tensor | None = None  # [out, in] int8
        self.scales: torch.Tensor | None = None  # [out] bfloat16

    def get(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (weight.data_ptr(), weight._version, weight.shape)
        if key != self.key:
            with torch.no_grad():
                w = weight.detach().float()
                scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
                self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
                self.scales = scale.to(torch.bfloat16)
            self.key = key
        return self.qweight, self.scales

    def __reduce__(self):  # deepcopy/pickle of a module: the copy rebuilds its own
        return Int8Weight, ()


def int8_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    q: Int8Weight | None) -> torch.Tensor | None:
    """x [..., in] @ dequant(weight)^T (+ bias) in x's dtype, or None where the caller should use its float path: no
    int8 copy enabled, not a float32 CPU input, autograd recording, or a weight made under inference_mode (no
    version counter to key the copy on)."""
    if q is None or x.device.type != "cpu" or x.dtype != torch.float32 or weight.is_inference():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    qweight, scales = q.get(weight)
    rows = x.reshape(-1, x.shape[-1])  # [T, in]
    y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), qweight, scales).to(x.dtype)  # [T, out]
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def quantize_weights_int8(model: nn.Module) -> int:
    """Give every linear layer and LM head of `model` (its own modules: not the target's embedding or head that a
    draft shares) a weight-only int8 copy, used on CPU. Returns how many layers now have one."""
    from specserve.layers.embedding import LMHead
    from specserve.layers.linear import Linear

    n = 0
    for m in model.modules():
        if isinstance(m, Linear | LMHead):
            m.int8 = Int8Weight()
            n += 1
    return n


def quantize_draft(draft: nn.Module, quantization: str | None, device: torch.device) -> None:
    """Apply --speculative-draft-model-quantization to a loaded draft ("int8": CPU only; None/"none": nothing)."""
    if quantization != "int8":
        return
    if device.type != "cpu":
        raise ValueError("--speculative-draft-model-quantization int8 is implemented for CPU serving only")
    quantize_weights_int8(draft)

