"""The CPU fast paths of y = x @ W^T + b that Linear (layers/linear.py) and LMHead (layers/embedding.py) share: a
oneDNN-prepacked copy of a float32 weight (`PackedWeight`, `packed_cpu_linear`) and a drafter's weight-only int8
copy (`Int8Weight`, `int8_cpu_linear`, applied by layers/quant.py). Each returns None where the caller should use
F.linear (GPU, other dtypes, training, row counts outside its range).

This module imports no other layer: the layers that use these paths sit above it.
"""

from __future__ import annotations

import torch

# Row counts up to this take the prepacked oneDNN path on CPU. Why: MKL's sgemm with a few rows costs well over
# its 1-row call although both read the weight once, while oneDNN on a prepacked weight costs about its own 1-row
# call; the prepacked path wins or ties up to this many rows and loses at prefill's hundreds, which keep F.linear.
# Re-measure with scripts/cpu/bench_linear.py (figures in BENCHMARKS.md).
PACKED_MAX_ROWS = 64
_ONEDNN = torch.backends.mkldnn.is_available()


class PackedWeight:
    """A oneDNN-prepacked copy of a float32 CPU weight [out, in], built lazily and rebuilt whenever the weight
    changes: weights are loaded by in-place copies after construction, and tests edit them. A change is seen through
    the weight's data_ptr and autograd version counter (bumped by every in-place op on it, though not by writes
    through `.data`).

    Memory: one more copy of the weight. Modules hold it as a plain attribute, not a buffer, so state_dict and .to()
    never see it.
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


class Int8Weight:
    """A per-row int8 copy of a float32 CPU weight [out, in] and its bfloat16 scales [out], built lazily and rebuilt
    whenever the weight changes (keyed as PackedWeight: data_ptr, version counter, shape). Per output row,
    symmetric: scale = max |w| / 127."""

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
    """x [..., in] @ dequant(weight)^T (+ bias) in x's dtype through torch's CPU kernel for it
    (`aten._weight_int8pack_mm`, bfloat16 activations), or None where the caller should use its float path: no
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
