"""Linear layers with shard-aware weight loading (fused QKV and gate/up projections).

Tensor-parallel variants (a rank's slice of each weight) are in layers/parallel.py.

On CPU in float32, small row counts run through oneDNN with a prepacked copy of the weight, and a drafter's layers
through its weight-only int8 copy (layers/cpu_linear.py); everything else (GPU, other dtypes, training, large row
counts) is plain F.linear.

FP8: a Linear (a tensor-parallel one too: its slice) may hold its weight in float8 e4m3 with float32 scales
(`weight_scale`, a buffer: per 128 x 128 block of an FP8 checkpoint, or per output row from online quantisation);
its forward then quantises the input per token (per group of the block's columns) and multiplies in FP8
(kernels/ops.py fp8_linear: Triton on a GPU, a dequantising reference on a CPU). `keep_fp8` takes a checkpoint's
Fp8Weight (the tensor-parallel layers their slice of it: `fp8_slice`), `quantize_fp8` a loaded weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import ops
from specserve.kernels.reference_fp8 import BLOCK_SIZES as FP8_BLOCK_SIZES
from specserve.layers.cpu_linear import Int8Weight, PackedWeight, int8_cpu_linear, packed_cpu_linear
from specserve.weights.fp8 import Fp8Weight

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


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
        # whether this layer may hold an FP8 weight (False where a kernel reads the weight itself rather than
        # through forward: MLA's absorbed kv_b_proj, routers, the DSA indexer), set by the layer that owns it
        self.fp8_capable = True
        self.loaded_plain = False  # a plain part was loaded (MergedLinear): later FP8 parts come dequantized
        self.fp8_block: tuple[int, int] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype in FP8_DTYPES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return ops.fp8_linear(x, self.weight, self.weight_scale, self.fp8_block, self.bias)
        if x.dim() == 2 and x.shape[0] <= self.decode_gemv:
            return ops.gemv(x, self.weight, self.bias)
        y = int8_cpu_linear(x, self.weight, self.bias, self.int8)
        if y is None:
            y = packed_cpu_linear(x, self.weight, self.bias, self.packed)
        return F.linear(x, self.weight, self.bias) if y is None else y


    def to_fp8(self, block: tuple[int, int] | None) -> None:
        """Replace the weight by an FP8 one of the same shape (zeros) and scales (ones) for `block` (None: one scale
        per output row), on the weight's device; the loader then copies the checkpoint's values in."""
        out, inp = self.weight.shape
        dev = self.weight.device
        self.plain_dtype = self.weight.dtype  # to_plain's
        self.weight = nn.Parameter(torch.zeros((out, inp), dtype=torch.float8_e4m3fn, device=dev),
                                   requires_grad=False)  # [out, in]
        shape = (out,) if block is None else (-(-out // block[0]), -(-inp // block[1]))
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=dev))
        self.fp8_block = block
        self.decode_gemv = 0  # the bf16 GEMV cannot read FP8

    def to_plain(self) -> None:
        """Back from FP8 to the dtype before to_fp8, the values dequantized (a fused projection whose checkpoint
        parts come partly plain: e.g. a hybrid model's gate rows kept in bf16 beside FP8 ones)."""
        from specserve.kernels.reference_fp8 import dequantize_weight

        w = dequantize_weight(self.weight, self.weight_scale, self.fp8_block).to(self.plain_dtype)  # [out, in]
        del self.weight_scale
        self.weight = nn.Parameter(w, requires_grad=False)
        self.fp8_block = None

    def accepts_fp8(self, block: tuple[int, int] | None) -> bool:
        """Whether this layer can hold an FP8 weight with `block` scales (None: per row): read through forward, no
        plain part loaded yet, a block the kernels take that every fused part (and a tensor-parallel layer's
        slice) starts on."""
        if not self.fp8_capable:
            return False
        if self.is_fp8:
            return self.fp8_block == block
        if self.loaded_plain:
            return False
        return self.fp8_blocks_fit(block)

    def fp8_blocks_fit(self, block: tuple[int, int] | None) -> bool:
        """Whether `block` scales fit this layer's weight: a block the kernels take, on which every fused part and
        a tensor-parallel layer's slice of the checkpoint tensor start (their scales then a slice of the
        checkpoint's)."""
        if block is not None and any(b not in FP8_BLOCK_SIZES for b in block):
            return False
        return all(self._block_aligned(block))

    def fp8_ready(self, w: Fp8Weight) -> bool:
        """Whether this layer keeps `w` in FP8 (converting itself on the first one, unless the loader converted it
        before allocating: models/loader.py). A layer that cannot is given the weight dequantized."""
        if self.weight.shape[1] != w.shape[1] or w.q.dtype != torch.float8_e4m3fn or not self.accepts_fp8(w.block):
            return False
        if not self.is_fp8:
            self.to_fp8(w.block)
        return True

    def _block_aligned(self, block: tuple[int, int] | None):
        yield True

    def fp8_slice(self, w: Fp8Weight) -> Fp8Weight:
        """This layer's part of a checkpoint's FP8 weight: all of it on one device (the tensor-parallel layers
        override it with their rank's slice; called only where fp8_blocks_fit)."""
        return w

    def keep_fp8(self, w: Fp8Weight) -> bool:
        """Load a checkpoint's (whole) FP8 weight in FP8, this layer's slice of it; False where it cannot hold it
        (the caller then loads it dequantized)."""
        if not self.accepts_fp8(w.block):
            return False
        part = self.fp8_slice(w)
        if not self.fp8_ready(part):
            return False
        self.load_fp8(part)
        return True

    def load_fp8(self, w: Fp8Weight) -> None:
        """An FP8 weight of this layer's shape (fp8_ready first)."""
        copy_checked(self.weight, w.q, "FP8 weight")
        copy_checked(self.weight_scale, w.scale, "FP8 weight scale")

    def quantize_fp8(self, block: tuple[int, int] | None = None) -> None:
        """Online FP8 (--quantization fp8): this layer's loaded weight -> FP8 with one scale per output row (the
        input is quantised per token at each call); with `block`, one per block as FP8 checkpoints hold them."""
        from specserve.kernels.reference_fp8 import quantize_weight_blocks, quantize_weight_channels

        w = self.weight.detach()
        wq, scale = quantize_weight_channels(w) if block is None else quantize_weight_blocks(w, block)
        self.to_fp8(block)
        with torch.no_grad():
            self.weight.copy_(wq)
            self.weight_scale.copy_(scale)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q|k|v, gate|up).

    `shard_sizes` names each part's output rows so the loader can copy checkpoint tensors into their slice.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        # the checkpoint's names of the parts (last name component), for exclusion globs (layers/quant.py)
        self.part_names: list[str] = [f"{name}_proj" for name in shard_sizes]
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (off, size)
            off += size

    def _block_aligned(self, block: tuple[int, int] | None):
        """Every part starts on a scale block (its scales are then rows of the whole weight's)."""
        for off, _ in self.shard_offsets.values():
            yield block is None or off % block[0] == 0

    def load_shard(self, shard: str, tensor: torch.Tensor | Fp8Weight, is_bias: bool = False) -> None:
        off, size = self.shard_offsets[shard]
        if isinstance(tensor, Fp8Weight):
            if not self.fp8_ready(tensor):
                tensor = tensor.dequantize(self.weight.dtype, self.weight.device)
            else:
                if tensor.shape[0] != size:
                    raise ValueError(f"shard {shard!r}: expected {size} rows, checkpoint has {tuple(tensor.shape)}")
                first = off if self.fp8_block is None else off // self.fp8_block[0]  # its first scale row
                with torch.no_grad():
                    self.weight[off:off + size].copy_(tensor.q)
                    self.weight_scale[first:first + tensor.scale.shape[0]].copy_(tensor.scale)
                return
        elif self.is_fp8 and not is_bias:
            self.to_plain()  # the parts loaded in FP8 dequantized: the projection computes in the model dtype
        if not is_bias:
            self.loaded_plain = True
        target = self.bias if is_bias else self.weight
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard!r}: expected {size} rows, checkpoint has {tuple(tensor.shape)}")
        with torch.no_grad():
            target[off:off + size].copy_(tensor)


def copy_checked(target: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into a parameter (or a slice of one) of the same shape, casting dtype and moving
    device as needed; a clear error naming `what` otherwise."""
    if isinstance(tensor, Fp8Weight):  # a parameter that does not compute in FP8 takes the weight dequantized
        tensor = tensor.dequantize(target.dtype, target.device)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, checkpoint has {tuple(tensor.shape)}")
    with torch.no_grad():
        target.copy_(tensor)
