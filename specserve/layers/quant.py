"""Weight-only int8 for a drafter on CPU (`--speculative-draft-model-quantization int8`).

A CPU decode step streams every weight from DRAM, so a draft forward costs its weight bytes; a per-row int8 copy
(layers/cpu_linear.py Int8Weight) stores a quarter of float32's. Only draft tokens change, and only a little:
verification keeps the output exactly the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.layers.cpu_linear import Int8Weight
from specserve.layers.embedding import LMHead
from specserve.layers.linear import Linear


def quantize_weights_int8(model: nn.Module) -> int:
    """Give every linear layer and LM head of `model` (its own modules: not the target's embedding or head that a
    draft shares) a weight-only int8 copy, used on CPU. Returns how many layers now have one."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear | LMHead):
            module.int8 = Int8Weight()
            count += 1
    return count


def quantize_draft(draft: nn.Module, quantization: str | None, device: torch.device) -> None:
    """Apply --speculative-draft-model-quantization to a loaded draft ("int8": CPU only; None/"none": nothing)."""
    if quantization != "int8":
        return
    if device.type != "cpu":
        raise ValueError("--speculative-draft-model-quantization int8 is implemented for CPU serving only")
    quantize_weights_int8(draft)
