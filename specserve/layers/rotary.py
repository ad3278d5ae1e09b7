"""Rotary embeddings (1-D and 3-row mRoPE) with a cos/sin cache.

Inverse frequencies come from transformers' ROPE_INIT_FUNCTIONS for every scaled rope type (llama3, yarn, linear,
dynamic...), so we do not re-derive the scaling formulas.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.kernels import ops


def inv_freq_from_config(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("default", "mrope"):
        base = float(params.get("rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    with torch.device("cpu"):  # even while the model is being built under a meta/cuda device context
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_parameters(hf_config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs use rope_theta + rope_scaling."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):
        params["rope_theta"] = hf_config.rope_theta
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 mrope_section: list[int] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.mrope_section = list(mrope_section) if mrope_section else None
        # Built on the CPU (transformers' rope init functions return CPU tensors), then placed on the device the
        # module is being built on (a `with torch.device(...)` context, or meta for checkpoint loading).
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq.to("cpu", torch.float32))  # [P, D/2]
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)
        cache = cache.to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [P, D] float32

    def table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] or [3, T] as the table is read: a 1-D RoPE model fed mRoPE rows takes row 0 (text rows are
        identical)."""
        return positions[0] if positions.dim() == 2 and self.mrope_section is None else positions

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] or [3, T]; q [T, Hq, D]; k [T, Hkv, D]. With a rotary dim (the table's width) below D
        (partial rotary, e.g. Qwen3-Next's 0.25) only the first rotary-dim dims of each head rotate."""
        positions = self.table_positions(positions)
        rd = self.head_dim
        if q.shape[-1] == rd:
            return ops.rope(q, k, self.cos_sin_cache, positions, self.mrope_section)
        # The Triton kernel rotates the leading-dims views in place; the reference returns new tensors, which are
        # written back into those dims.
        q_rot, k_rot = ops.rope(q[..., :rd], k[..., :rd], self.cos_sin_cache, positions, self.mrope_section)
        if q_rot.data_ptr() != q.data_ptr():
            q[..., :rd] = q_rot
            k[..., :rd] = k_rot
        return q, k
