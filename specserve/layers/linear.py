"""Linear layers with shard-aware weight loading (fused QKV and gate/up projections).

Only tensor-parallel size 1 is implemented; the shard bookkeeping is where TP would split the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q|k|v, gate|up).

    `shard_sizes` names each part's output rows so the loader can copy checkpoint tensors into their slice.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (off, size)
            off += size

    def load_shard(self, shard: str, tensor: torch.Tensor, is_bias: bool = False) -> None:
        off, size = self.shard_offsets[shard]
        target = self.bias if is_bias else self.weight
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard!r}: expected {size} rows, checkpoint has {tuple(tensor.shape)}")
        with torch.no_grad():
            target[off:off + size].copy_(tensor)
