"""Activations."""

from __future__ import annotations

import torch

from specserve.kernels import ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] (gate | up) -> silu(gate) * up [T, I]."""
    return ops.silu_and_mul(x)
