"""Linear layers with shard-aware weight loading (fused QKV and gate/up projections).

Tensor-parallel variants (a rank's slice of each weight) are in layers/parallel.py.

On CPU in float32, small row counts run through oneDNN with a prepacked copy of the weight (`PackedWeight`), see
`packed_cpu_linear`; everything else (GPU, other dtypes, training, large row counts) is plain F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import ops
from specserve.layers.quant import Int8Weight, int8_cpu_linear

# Row counts up to this take the prepacked oneDNN path on CPU (scripts/cpu/bench_linear.py, SmolLM2-135M shapes,
# 2 threads, weights streamed from DRAM). MKL's sgemm with 2-6 rows costs 1.5-2.2x its 1-row call, although both
# read the weight once; oneDNN on a prepacked weight costs 1.0-1.3x its own 1-row call, which is itself 0.5-1.0x
# MKL's (gate_up 576->3072: 517 us at 1 row; 930 -> 330 us at 4 rows). It wins or ties up to 64 rows (gate_up
# 1981 -> 1586 us) and loses from ~256 rows (qkv 1024 rows: 6.3 -> 7.1 ms), so prefill keeps F.linear.
PACKED_MAX_ROWS = 64
_ONEDNN = torch.backends.mkldnn.is_available()


class PackedWeight:
    """A oneDNN-prepacked copy of a float32 CPU weight [out, in], built lazily and rebuilt whenever the weight
    changes: weights are loaded by in-place copies after construction, and tests edit them. A change is seen through
    the weight's data_ptr and autograd version counter (bumped by every in-place op on it, though not by writes
    through `.data`).

    Memory: one more copy of the weight (SmolLM2-135M in fp32: ~0.43 GB for the decoder linears, ~0.11 GB for the
    LM head). Modules hold it as a plain attribute, not a buffer, so state_dict and .to() never see it.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None  # (data_ptr, version, shape) of the weight it was packed from
        self.packed: torch.Tensor | None = None  # opaque mkldnn tensor

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, weight.shape)
        if key != self.key:
            self.packed = None  # free the stale copy before packing the new one
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self.key = key
        return self.packed

    def __reduce__(self):
        # deepcopy/pickle of a module: the opaque mkldnn tensor has no storage to copy, so the copy starts empty.
        return PackedWeight, ()


def packed_cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: PackedWeight,
                      max_rows: int | None = PACKED_MAX_ROWS) -> torch.Tensor | None:
    """x @ weight^T + bias through oneDNN on `pack`'s copy of the weight, or None where the caller should use
    F.linear: not float32 CPU, no rows or more than `max_rows` (None: no limit), autograd recording (the op has
    no backward), or a weight made under inference_mode (it has no version counter to key the cache on)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or not _ONEDNN:
        return None
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or (max_rows is not None and rows > max_rows) or weight.is_inference():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, pack.get(weight), bias, "none", [], "")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed = PackedWeight()  # CPU fp32 small-row path only (plain attribute, see PackedWeight)
        self.int8: Int8Weight | None = None  # a drafter's weight-only int8 copy on CPU (layers/quant.py)
        # calls of at most this many rows (0: none; at most ops.GEMV_MAX_ROWS) through the one-launch Triton GEMV
        # (--decode-gemv, set by the layer that owns it: models/dense.py PreNormDecoderLayer.set_decode_gemv)
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
