"""Rotary embeddings (1-D and 3-row mRoPE) with a cos/sin cache.

Inverse frequencies of the scaled rope types come from transformers' ROPE_INIT_FUNCTIONS, so we do not re-derive
the scaling formulas. Those functions read a transformers config with standardized `rope_parameters`; a checkpoint's
config may instead be a plain object in the old layout (top-level rope_theta + rope_scaling, e.g. read from a GGUF
file or an old config.json), so they are handed a config built from the merged parameters (rope_init_config): both
layouts give the same tables.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.kernels import ops

# Scaled rope types whose frequencies transformers computes once from the config: a static cos/sin table is exact.
# Not here: "dynamic" (NTK) and "longrope" change their frequencies with the sequence length at run time.
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn")
# the parameters each scaled type cannot do without (transformers would raise a KeyError)
_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
# scaled types whose parameters carry the pretraining context length (original_max_position_embeddings)
_ORIGINAL_CONTEXT_TYPES = ("llama3", "yarn")


def inv_freq_from_config(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim / 2] float32, attention scaling of the cos/sin table). head_dim: the dims that rotate
    (a family with partial rotary passes its rotary dim)."""
    params = rope_parameters(hf_config)
    rope_type = rope_type_of(params)
    if rope_type in ("default", "mrope"):
        base = rope_theta(params)
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)).float(), 1.0
    if rope_type not in SCALED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} (rope_parameters / rope_scaling) is not supported; supported: "
                         f"default, {', '.join(SCALED_ROPE_TYPES)}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # even while the model is being built under a meta/cuda device context
        config = rope_init_config(hf_config, params, rope_type, head_dim)
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_type_of(params: dict) -> str:
    """The rope type of merged rope parameters (old configs name it `type`), as transformers standardizes it."""
    return params.get("rope_type", params.get("type", "default")) or "default"


def rope_theta(params: dict) -> float:
    """The base of merged rope parameters; transformers' default when the config has none."""
    theta = params.get("rope_theta")
    return 10000.0 if theta is None else float(theta)


def rope_parameters(hf_config) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs use rope_theta + rope_scaling."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    if "rope_theta" not in params and hasattr(hf_config, "rope_theta"):
        params["rope_theta"] = hf_config.rope_theta
    return params


def rope_init_config(hf_config, params: dict, rope_type: str, head_dim: int):
    """A transformers config holding what its rope init functions read, in the standardized layout whatever the
    source's: rope_parameters (type, theta, the scaling fields; partial_rotary_factor 1, since head_dim is already
    the rotating dims), head_dim, max_position_embeddings (yarn's factor when the parameters have none)."""
    from transformers import PretrainedConfig

    missing = [k for k in _REQUIRED[rope_type] if k not in params]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in rope_parameters / rope_scaling")
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    params = {k: v for k, v in params.items() if k != "type"}
    params.update(rope_type=rope_type, rope_theta=rope_theta(params), partial_rotary_factor=1.0)
    if rope_type in _ORIGINAL_CONTEXT_TYPES:
        # as transformers' standardize_rope_params: a top-level original_max_position_embeddings wins, else the
        # parameters' own, else max_position_embeddings
        top = getattr(hf_config, "original_max_position_embeddings", None)
        params["original_max_position_embeddings"] = (
            top if top is not None else params.get("original_max_position_embeddings", max_positions))
        if params["original_max_position_embeddings"] is None:
            raise ValueError(f"rope type {rope_type!r} needs original_max_position_embeddings or "
                             "max_position_embeddings in the config")
    # hidden_size / num_attention_heads: some init functions evaluate their head_dim fallback even when head_dim
    # is set; one head of head_dim keeps the two consistent
    return PretrainedConfig(rope_parameters=params, head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                            max_position_embeddings=max_positions)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                 mrope_section: list[int] | None = None, mrope_interleaved: bool = False):
        """mrope_section (s0, s1, s2): 3-row positions [3, T] pick each frequency band's row by these sections,
        in contiguous bands or, mrope_interleaved, interleaved (Qwen3.5; kernels/reference.py rope_cos_sin).
        1-D positions rotate as plain rope either way."""
        super().__init__()
        self.head_dim = head_dim
        self.mrope_section = list(mrope_section) if mrope_section else None
        self.mrope_interleaved = bool(mrope_interleaved) and self.mrope_section is not None
        # Built on the CPU (transformers' rope init functions return CPU tensors), then placed on the device the
        # module is being built on (a `with torch.device(...)` context, or meta for checkpoint loading).
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq.to("cpu", torch.float32))  # [P, D/2]
        cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)
        cache = cache.to(torch.get_default_device())
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [P, D] float32

    def table_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] or [3, T] as the table is read: a 1-D RoPE model fed mRoPE rows takes row 0 (text rows are
        identical); an mRoPE model fed 1-D positions keeps them (1-D rope == mRoPE of three equal rows, in either
        band layout, since every band reads the same table row)."""
        return positions[0] if positions.dim() == 2 and self.mrope_section is None else positions

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [T] or [3, T]; q [T, Hq, D]; k [T, Hkv, D]. With a rotary dim (the table's width) below D
        (partial rotary, e.g. Qwen3-Next's 0.25) only the first rotary-dim dims of each head rotate."""
        positions = self.table_positions(positions)
        rd = self.head_dim
        if q.shape[-1] == rd:
            return ops.rope(q, k, self.cos_sin_cache, positions, self.mrope_section, self.mrope_interleaved)
        # The Triton kernel rotates the leading-dims views in place; the reference returns new tensors, which are
        # written back into those dims.
        q_rot, k_rot = ops.rope(q[..., :rd], k[..., :rd], self.cos_sin_cache, positions, self.mrope_section,
                                self.mrope_interleaved)
        if q_rot.data_ptr() != q.data_ptr():
            q[..., :rd] = q_rot
            k[..., :rd] = k_rot
        return q, k
