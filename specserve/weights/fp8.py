"""FP8 checkpoints: `quantization_config.quant_method == "fp8"` (the format DeepSeek-V3 / GLM / Qwen3 FP8 releases
ship: each quantized linear weight float8 e4m3 with a float32 `weight_scale_inv` beside it, one scale per block of
`weight_block_size` = [rows, cols], 128 x 128 in those releases, or one per tensor without a block size), and
llm-compressor's "compressed-tensors" FP8 (`weight_scale` per output row, per tensor or per block; activations
dynamic: the "-FP8-dynamic" / per-token-per-channel releases). The real weight is `weight * scale` broadcast over its
block or row.

The loader pairs each FP8 weight with its scale as they stream (`pair_stream`) and hands the model an `Fp8Weight`:
a layer that computes in FP8 (layers/linear.py Linear, layers/moe.py FusedMoE) keeps the FP8 values and the scales
as they are; any other parameter gets the weight dequantized into its own dtype (`Fp8Weight.dequantize`). A weight
and its scale may come in either order and from different shards: the first of the two waits (one tensor each)
until the other arrives. One scale per tensor becomes one per row (the same value), so a fused projection whose
parts have different scales (q, k, v) holds them side by side.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"  # "<name>.weight_scale_inv" scales "<name>.weight"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] | None  # [rows, cols] of one scale's block; None: one scale per tensor or per row
    scale_suffix: str = SCALE_SUFFIX  # "<name>.weight<suffix>" scales "<name>.weight"


def fp8_format(hf_config) -> Fp8Format | None:
    """The checkpoint's FP8 weight format from its config (None: not quantized): quant_method "fp8" (block or
    per-tensor `weight_scale_inv`) or "compressed-tensors" FP8 (llm-compressor's float-quantized checkpoints,
    e.g. the "-FP8-dynamic" / PTPC releases: per-channel, per-tensor or block `weight_scale`). Other quantization
    methods are a clear error, never weights read as if they were plain."""
    q = getattr(hf_config, "quantization_config", None)
    if not q:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_format(q)
    if method != "fp8":
        raise ValueError(f"quantization method {method!r} is not supported (FP8 checkpoints are: quant_method "
                         "'fp8', or 'compressed-tensors' with FP8 weights)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"FP8 activation scheme {q['activation_scheme']!r} is not supported (only 'dynamic': "
                         "activations quantised per token at each call; static input scales are not read)")
    block = q.get("weight_block_size")
    return Fp8Format(tuple(int(b) for b in block) if block else None)


def _compressed_tensors_format(q: dict) -> Fp8Format:
    """compressed-tensors' config: every config group FP8 (8-bit float) weights with one strategy (channel or tensor:
    scales per row or per tensor; block: block_structure), activations dynamic 8-bit float or none. Anything else
    (integer or 4-bit weights, static input scales, mixed strategies) is refused."""
    if q.get("format") not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"compressed-tensors format {q.get('format')!r} is not supported (float-quantized FP8 is)")
    blocks = set()
    for name, group in (q.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations")
        if w.get("type") != "float" or int(w.get("num_bits") or 0) != 8:
            raise ValueError(f"compressed-tensors group {name!r}: only 8-bit float (FP8) weights are supported, got "
                             f"{w.get('num_bits')}-bit {w.get('type')}")
        if a is not None and (a.get("type") != "float" or not a.get("dynamic")):
            raise ValueError(f"compressed-tensors group {name!r}: static activation scales are not supported "
                             "(activations are quantised per token at each call)")
        strategy = w.get("strategy")
        if strategy == "block":
            blocks.add(tuple(int(b) for b in w.get("block_structure") or ()))
        elif strategy in ("channel", "tensor"):
            blocks.add(None)
        else:
            raise ValueError(f"compressed-tensors group {name!r}: weight strategy {strategy!r} is not supported "
                             "(channel, tensor and block are)")
    if len(blocks) != 1:
        raise ValueError("compressed-tensors: the config groups must share one FP8 weight layout")
    return Fp8Format(blocks.pop(), scale_suffix="_scale")


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format,
               device: torch.device | None = None) -> torch.Tensor:
    """weight [O, I] float8; scale_inv [ceil(O / bo), ceil(I / bi)] float32 (or one value) -> [O, I] float32, computed
    on `device` (default: the weight's; the loader passes the model's, so a large checkpoint dequantizes on the GPU
    and crosses the bus in FP8)."""
    w = weight.to(device or weight.device).to(torch.float32)
    s = scale_inv.to(w.device, torch.float32)
    if fmt.block is None or s.numel() == 1:
        return w * s.reshape(())
    if w.dim() != 2:
        raise ValueError(f"a block-scaled FP8 weight must be 2-D, got {tuple(w.shape)}")
    bo, bi = fmt.block
    o, i = w.shape
    want = (-(-o // bo), -(-i // bi))
    if tuple(s.shape) != want:
        raise ValueError(f"FP8 scale of shape {tuple(s.shape)} does not fit a {o} x {i} weight in {bo} x {bi} "
                         f"blocks (expected {want})")
    return w * s.repeat_interleave(bo, dim=0)[:o].repeat_interleave(bi, dim=1)[:, :i]


@dataclass(frozen=True)
class Fp8Weight:
    """One checkpoint weight kept in FP8: q [O, I] float8; scale [ceil(O / bo), ceil(I / bi)] float32 with a block,
    or [O] (one per row) without one (a per-tensor scale expanded to its rows)."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """[O, I] in `dtype` (computed in float32 on `device`, default the weight's)."""
        if self.block is None:
            w = self.q.to(device or self.q.device).to(torch.float32)
            return (w * self.scale.to(w.device, torch.float32)[:, None]).to(dtype)
        return dequantize(self.q, self.scale, Fp8Format(self.block), device).to(dtype)

    def rows(self, start: int, size: int) -> Fp8Weight:
        """Rows [start, start + size) of the weight with their scales: a whole number of scale blocks (a fused
        projection's part, a column-parallel slice); ValueError otherwise."""
        if self.block is None:
            return Fp8Weight(self.q[start:start + size], self.scale[start:start + size], None)
        bo = self.block[0]
        if not slice_on_blocks(start, size, self.q.shape[0], bo):
            raise ValueError(f"rows {start}..{start + size} do not fall on the FP8 scale blocks of {bo} rows")
        return Fp8Weight(self.q[start:start + size], self.scale[start // bo:-(-(start + size) // bo)], self.block)

    def cols(self, start: int, size: int) -> Fp8Weight:
        """Columns [start, start + size) of the weight (a row-parallel slice of the input features) with their
        scales: every row's (per-channel: a row's scale covers all its columns), or the scale columns of a whole
        number of blocks; ValueError otherwise."""
        if self.block is None:
            return Fp8Weight(self.q[:, start:start + size], self.scale, None)
        bi = self.block[1]
        if not slice_on_blocks(start, size, self.q.shape[1], bi):
            raise ValueError(f"columns {start}..{start + size} do not fall on the FP8 scale blocks of {bi} columns")
        return Fp8Weight(self.q[:, start:start + size], self.scale[:, start // bi:-(-(start + size) // bi)],
                         self.block)


def slice_on_blocks(start: int, size: int, full: int, block: int) -> bool:
    """Whether [start, start + size) of a dimension of `full` is a whole number of scale blocks of `block` (the
    last block of the full dimension may be partial): its scales are then a slice of the full weight's."""
    return start % block == 0 and (size % block == 0 or start + size == full)


def paired(weight: torch.Tensor, scale_inv: torch.Tensor, fmt: Fp8Format) -> Fp8Weight:
    """A checkpoint's FP8 weight and its scale -> Fp8Weight (shapes checked; a per-tensor scale one per row)."""
    if weight.dim() != 2:
        raise ValueError(f"an FP8 weight must be 2-D, got {tuple(weight.shape)}")
    s = scale_inv.to(torch.float32)
    if s.numel() == 1:
        return Fp8Weight(weight, s.reshape(1).expand(weight.shape[0]).contiguous(), None)
    if fmt.block is None:  # one scale per output row ([O] or compressed-tensors' [O, 1])
        if s.numel() != weight.shape[0]:
            raise ValueError(f"FP8 scale of shape {tuple(s.shape)} fits neither one scale per tensor nor one per row "
                             f"of a {tuple(weight.shape)} weight")
        return Fp8Weight(weight, s.reshape(-1).contiguous(), None)
    bo, bi = fmt.block
    o, i = weight.shape
    want = (-(-o // bo), -(-i // bi))
    if tuple(s.shape) != want:
        raise ValueError(f"FP8 scale of shape {tuple(s.shape)} does not fit a {o} x {i} weight in {bo} x {bi} "
                         f"blocks (expected {want})")
    return Fp8Weight(weight, s, fmt.block)


def pair_stream(tensors: Iterable[tuple[str, torch.Tensor]], fmt: Fp8Format
                ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """(name, tensor) of a checkpoint -> the same with every FP8 weight and its scale as one Fp8Weight under the
    weight's name; other tensors pass through. An FP8 weight without its scale (or a scale without its weight) at
    the end is an error."""
    weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale
    scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, by the weight's name
    suffix = fmt.scale_suffix
    for name, t in tensors:
        if name.endswith(suffix):
            wname = name[:-len(suffix)]
            if wname in weights:
                yield wname, paired(weights.pop(wname), t, fmt)
            else:
                scales[wname] = t
        elif t.dtype in _FP8:
            if name in scales:
                yield name, paired(t, scales.pop(name), fmt)
            else:
                weights[name] = t
        else:
            yield name, t
    if weights or scales:
        left = sorted(weights) + sorted(n + suffix for n in scales)
        raise ValueError(f"FP8 checkpoint: {len(left)} weight(s) without their scale or scale(s) without their "
                         f"weight, e.g. {left[0]}")
