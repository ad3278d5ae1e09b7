"""Tensor-parallel layers (Megatron layout) over a TPGroup (distributed/tp.py), each loading its rank's slice of a
full checkpoint tensor (`load_full` / `load_shard`), so the loaders stay the same for every size:

- ColumnParallelLinear: a slice of the output features (weight rows), the output stays sharded;
- MergedColumnParallelLinear: q|k|v or gate|up, each part sliced on its own; a part of fewer units (KV heads) than
  ranks is replicated: rank r keeps unit r * units // size;
- RowParallelLinear: a slice of the input features (weight columns); the partial products are summed over the
  ranks (all-reduce), then the full bias is added once;
- VocabParallelEmbedding: a slice of the vocabulary; ids outside it give zeros, summed over the ranks;
- ParallelLMHead: a slice of the vocabulary's logits, gathered to the full [T, V] on every rank.

FP8 (layers/linear.py): the linear layers keep their rank's slice of a checkpoint's FP8 weight with the matching
slice of its scales (`fp8_slice`). Per-channel scales ([N], one per output row) follow the rows of a column slice
and are all kept by a row-parallel (K) slice. Block scales are kept only where the slice is a whole number of blocks
(column: this rank's rows, of each fused part; row: its input columns; the last block of the full tensor may be
partial): otherwise `fp8_blocks_fit` says no and that layer takes the weight dequantized. A row-parallel FP8
forward quantises its input slice per token (per bk columns with blocks, the full layer's groups when the slice is
on blocks; per-channel, over this rank's columns only, as other engines do, rather than a collective for the
row's amax), multiplies in FP8, then the partial sums are all-reduced.

Only built when the group's size is above 1 (the models keep the plain layers at size 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.distributed.tp import TPGroup
from specserve.kernels import ops
from specserve.layers.embedding import LMHead, VocabEmbedding
from specserve.layers.linear import Linear, MergedLinear, copy_checked
from specserve.weights.fp8 import Fp8Weight, slice_on_blocks


def _plain_weight(layer: Linear, tensor: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """A plain weight for `layer` (an FP8 one it does not keep, dequantized); a layer made FP8 before allocation
    turned back to plain values first, so the tensor is never cast into FP8 without scales."""
    if layer.is_fp8:
        layer.to_plain()
    return tensor.dequantize(layer.weight.dtype, layer.weight.device) if isinstance(tensor, Fp8Weight) else tensor


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__(in_features, tp.split(out_features, "output features"), bias)
        self.tp = tp

    def _block_aligned(self, block: tuple[int, int] | None):
        n = self.out_features
        yield block is None or slice_on_blocks(self.tp.rank * n, n, n * self.tp.size, block[0])

    def fp8_slice(self, w: Fp8Weight) -> Fp8Weight:
        return w.rows(self.tp.rank * self.out_features, self.out_features)  # [N / size, K], its scale rows

    def load_full(self, tensor: torch.Tensor | Fp8Weight, is_bias: bool = False) -> None:
        if is_bias:
            copy_checked(self.bias, self.tp.shard(tensor, 0, "output features"), "column-parallel bias")
        elif not (isinstance(tensor, Fp8Weight) and self.keep_fp8(tensor)):
            copy_checked(self.weight, self.tp.shard(_plain_weight(self, tensor), 0, "output features"),
                         "column-parallel linear")


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__(tp.split(in_features, "input features"), out_features, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in / size] -> [T, out]
        if self.is_fp8:  # this rank's partial product in FP8 (the bias is added once, after the sum)
            y = ops.fp8_linear(x, self.weight, self.weight_scale, self.fp8_block)
        else:
            y = F.linear(x, self.weight)
        self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def _block_aligned(self, block: tuple[int, int] | None):
        k = self.in_features
        yield block is None or slice_on_blocks(self.tp.rank * k, k, k * self.tp.size, block[1])

    def fp8_slice(self, w: Fp8Weight) -> Fp8Weight:
        return w.cols(self.tp.rank * self.in_features, self.in_features)  # [N, K / size], its scale columns

    def load_full(self, tensor: torch.Tensor | Fp8Weight, is_bias: bool = False) -> None:
        if is_bias:
            copy_checked(self.bias, tensor, "row-parallel bias")
        elif not (isinstance(tensor, Fp8Weight) and self.keep_fp8(tensor)):
            copy_checked(self.weight, self.tp.shard(_plain_weight(self, tensor), 1, "input features"),
                         "row-parallel linear")


class MergedColumnParallelLinear(MergedLinear):
    def __init__(self, in_features: int, parts: dict[str, tuple[int, int]], tp: TPGroup, bias: bool = False):
        """parts: name -> (full output rows, rows per unit), e.g. {"q": (H * D, D), "k": (KV * D, D), ...}: each part
        is split over the ranks in whole units (heads), or replicated unit by unit when it has fewer units than
        ranks (the count must then divide the ranks)."""
        self.tp = tp
        self.unit_ranges: dict[str, tuple[int, int]] = {}  # name -> (first full row, rows) kept by this rank
        self.full_rows = {name: rows for name, (rows, _) in parts.items()}
        local = {}
        for name, (rows, unit) in parts.items():
            units = rows // unit
            if units * unit != rows:
                raise ValueError(f"part {name!r}: {rows} rows are not whole units of {unit}")
            if units >= tp.size:
                per = tp.split(units, f"units of part {name!r}")
                self.unit_ranges[name] = (tp.rank * per * unit, per * unit)
            elif tp.size % units == 0:
                self.unit_ranges[name] = (tp.rank * units // tp.size * unit, unit)  # replicated unit
            else:
                raise ValueError(f"part {name!r}: {units} units cannot be replicated over {tp.size} ranks")
            local[name] = self.unit_ranges[name][1]
        super().__init__(in_features, local, bias)

    def _block_aligned(self, block: tuple[int, int] | None):
        """Each part's local offset (MergedLinear) and this rank's rows of each part (a replicated unit's too) on
        the scale blocks."""
        yield from super()._block_aligned(block)
        for name, (start, rows) in self.unit_ranges.items():
            yield block is None or slice_on_blocks(start, rows, self.full_rows[name], block[0])

    def load_shard(self, shard: str, tensor: torch.Tensor | Fp8Weight, is_bias: bool = False) -> None:
        start, rows = self.unit_ranges[shard]
        if isinstance(tensor, Fp8Weight):
            if self.accepts_fp8(tensor.block):  # this rank's rows with their scale rows, kept in FP8
                super().load_shard(shard, tensor.rows(start, rows), is_bias)
                return
            tensor = tensor.dequantize(self.weight.dtype, self.weight.device)
        super().load_shard(shard, tensor.narrow(0, start, rows), is_bias)


class VocabParallelEmbedding(VocabEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__(tp.split(vocab_size, "vocabulary size"), hidden_size)
        self.tp = tp
        self.start = tp.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        n = self.weight.shape[0]
        local = ids - self.start
        inside = (local >= 0) & (local < n)
        out = F.embedding(local.clamp(0, n - 1), self.weight) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def load_full(self, tensor: torch.Tensor, is_bias: bool = False) -> None:
        copy_checked(self.weight, self.tp.shard(tensor, 0, "vocabulary size"), "vocab-parallel embedding")


class ParallelLMHead(LMHead):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup):
        super().__init__(tp.split(vocab_size, "vocabulary size"), hidden_size)
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, V] float32, on every rank
        return self.tp.all_gather(super().forward(hidden), dim=-1)

    def load_full(self, tensor: torch.Tensor, is_bias: bool = False) -> None:
        copy_checked(self.weight, self.tp.shard(tensor, 0, "vocabulary size"), "parallel lm-head")
