"""RMSNorm with an optional fused residual add (torch reference; the Triton kernel plugs in through `ops`)."""

from __future__ import annotations

import torch
from torch import nn

from specserve.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        # Qwen3-Next style norms store (weight - 1); the loader keeps the checkpoint's convention.
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(hidden_size) if zero_centered else torch.ones(hidden_size))

    @property
    def weight_offset(self) -> float:
        """What the kernels add to the weight: 1 for zero-centred weights (no per-forward `weight + 1` kernel)."""
        return 1.0 if self.zero_centered else 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H]. Without residual: returns normed x. With residual: returns (normed(x + r), x + r)."""
        offset = self.weight_offset
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, offset)
        return ops.add_rms_norm(x, residual, self.weight, self.eps, offset)


class GatedRMSNorm(nn.Module):
    """The gated delta net's output norm (Qwen3-Next / Qwen3.5): rms_norm(x) * weight * silu(gate), over each
    head's values; a plain (not zero-centred) weight. Rounds like transformers' Qwen3NextRMSNormGated: the normed
    x is scaled by the weight in x's dtype, the gate applied in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate [N, D] -> [N, D] in x's dtype."""
        return ops.gated_rms_norm(x, gate, self.weight, self.eps)
