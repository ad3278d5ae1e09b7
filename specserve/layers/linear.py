"""Linear layers with shard-aware weight loading (fused QKV and gate/up projections).

Tensor-parallel variants (a rank's slice of each weight) are in layers/parallel.py.

On CPU in float32, small row counts run through oneDNN with a prepacked copy of the weight, and a drafter's layers
through its weight-only int8 copy (layers/cpu_linear.py); everything else (GPU, other dtypes, training, large row
counts) is plain F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import ops
from specserve.layers.cpu_linear import Int8Weight, PackedWeight, int8_cpu_linear, packed_cpu_linear


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed = PackedWeight()  # CPU fp32 small-row path only (plain attribute, see PackedWeight)
        self.int8: Int8Weight | None = None  # a drafter's weight-only int8 copy on CPU (set by layers/quant.py)
        # calls of at most this many rows (0: none; at most ops.GEMV_MAX_ROWS) through the one-launch Triton GEMV
        # (--decode-gemv, set by the layer that owns it: models/decoder_layer.py PreNormDecoderLayer.set_decode_gemv)
        self.decode_gemv = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.decode_gemv:
            return ops.gemv(x, self.weight, self.bias)
        y = int8_cpu_linear(x, self.weight, self.bias, self.int8)
        if y is None:
            y = packed_cpu_linear(x, self.weight, self.bias, self.packed)
        return F.linear(x, self.weight, self.bias) if y is None else y


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


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one) of the same shape, casting dtype and moving
    device as needed; a clear error naming `what` otherwise."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
    with torch.no_grad():
        target.copy_(tensor)
