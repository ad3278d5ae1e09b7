"""The Qwen3.5 vision encoder: an image's patches -> one embedding per merged block of patches, in the language
model's hidden size, ready to take the place of the prompt's image placeholder tokens.

Qwen3.5 and Qwen3.5-MoE vision-language checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`) share this tower unchanged; it ships as `model.visual.*` (or `visual.*`).
transformers' `Qwen3_5VisionModel` is the oracle in tests (tests/test_qwen3_5_vision.py). Our own module rather than
transformers' so that the engine owns its parameters (names, dtype, device, loading as the checkpoint streams in)
like every other model here.

Input: the image processor's output (transformers' Qwen2VLImageProcessor for these checkpoints): `pixel_values`
[N, C * Tp * P * P], every patch flattened as (channel, frame, row, column), the patches of all images one after
the other, and `grid_thw` [num_images, 3], each image's (frames, patch rows, patch columns). Within a frame the
processor emits the patches block by block: merge blocks of m x m patches (m = spatial_merge_size) in row-major
order, and each block's patches row-major; the position tables below are built in that order (_merge_block_order),
and the merger relies on it (a block's m * m patches are consecutive rows).

Pipeline:
  1. patch embedding: the checkpoint's Conv3d has kernel == stride [Tp, P, P], so it is one Linear over each
     flattened patch (its weight [hidden, C, Tp, P, P] is reshaped to [hidden, C * Tp * P * P] on load);
  2. plus a learned absolute position embedding: a square table (side = sqrt(num_position_embeddings)) resampled
     bilinearly (align_corners) to each image's patch grid;
  3. `depth` pre-norm blocks: LayerNorm, attention with a 2-D rotary (half of each head's rotary pairs turn with the
     patch's row, half with its column), LayerNorm, MLP. Attention is full within one frame of one image and never
     across frames or images (block-diagonal);
  4. the patch merger: LayerNorm, each block's m * m patches concatenated, a 2-layer MLP (exact GELU) to
     out_hidden_size (the language model's hidden size).
Qwen3.5 has no windowed attention (Qwen2.5-VL's) and no deepstack features (Qwen3-VL's): every block attends over
the whole frame, and the merged embeddings are the only output the language model consumes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels.reference import apply_rope
from specserve.layers.linear import Linear
from specserve.models.config import optional, require
from specserve.models.tensor_loading import copy_param

VISION_PREFIXES = ("model.visual.", "visual.")
_PATCH_WEIGHT = "patch_embed.proj.weight"
_LN_EPS = 1e-6  # transformers' Qwen3_5VisionBlock / PatchMerger LayerNorms (not in the config)

# the MLP activations of the blocks (hidden_act); the merger's is always the exact GELU
_ACTS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


@dataclass(frozen=True)
class Qwen3_5VisionConfig:
    """The numbers the encoder needs, read from the checkpoint config's `vision_config` (from_hf)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, hf_config) -> Qwen3_5VisionConfig:
        """hf_config: the checkpoint's config, as a transformers config or its config.json dict; its `vision_config`
        (itself a config or a dict) is read. ValueError for a field we need that is missing, or a setting this
        encoder does not implement."""
        if isinstance(hf_config, dict):
            vision = hf_config.get("vision_config")
        else:
            vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            raise ValueError("the checkpoint config has no 'vision_config' (not a vision-language checkpoint)")
        v = SimpleNamespace(**vision) if isinstance(vision, dict) else vision
        hidden, heads = require(v, "hidden_size"), require(v, "num_heads")
        act = optional(v, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported; one of {', '.join(_ACTS)}")
        if list(optional(v, "deepstack_visual_indexes", [])):
            raise ValueError("vision_config.deepstack_visual_indexes is not empty: Qwen3.5's vision tower has no "
                             "deepstack mergers (transformers' Qwen3_5VisionModel ignores them); not supported")
        rope = optional(v, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_type={rope['rope_type']!r} is not supported (axial only)")
        cfg = cls(
            depth=require(v, "depth"), hidden_size=hidden, num_heads=heads,
            intermediate_size=require(v, "intermediate_size"), out_hidden_size=require(v, "out_hidden_size"),
            hidden_act=act, in_channels=int(optional(v, "in_channels", 3)),
            patch_size=_one_size(optional(v, "patch_size", 16), "patch_size"),
            temporal_patch_size=_one_size(optional(v, "temporal_patch_size", 2), "temporal_patch_size"),
            spatial_merge_size=int(optional(v, "spatial_merge_size", 2)),
            num_position_embeddings=int(optional(v, "num_position_embeddings", 2304)),
            rope_theta=float(rope.get("rope_theta", optional(v, "rope_theta", 10000.0))),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a head "
                             "size divisible by 4 (the 2-D rotary turns head_dim / 4 pairs of dims with the patch's "
                             "row, head_dim / 4 with its column)")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings={self.num_position_embeddings} must be a square (a "
                             "square table of learned positions)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The width of one flattened patch of pixel_values: C * Tp * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def _one_size(value, name: str) -> int:
    """A size the config may give as an int or as equal per-axis values."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision {name}={value}: only equal sizes per axis are supported")
        value = value[0]
    return int(value)


def vision_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name inside the vision tower (`model.visual.blocks.0...` -> `blocks.0...`), None when it
    is not a vision tensor."""
    for prefix in VISION_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def merged_token_counts(grid_thw: torch.Tensor | Sequence[Sequence[int]], spatial_merge_size: int) -> list[int]:
    """The number of merged embeddings (= placeholder tokens in the prompt) of each image: t * h * w / m^2."""
    return [t * h * w // spatial_merge_size ** 2 for t, h, w in _grids(grid_thw)]


def _grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def _merge_block_order(x: torch.Tensor, m: int) -> torch.Tensor:
    """x [h, w, ...] in raster order -> [h * w, ...] in the processor's patch order (merge blocks row-major, each
    block's m x m patches row-major)."""
    h, w = x.shape[:2]
    rest = x.shape[2:]
    return x.reshape(h // m, m, w // m, m, *rest).transpose(1, 2).reshape(h * w, *rest)


class VisionAttention(nn.Module):
    """Multi-head self-attention with a 2-D rotary, over each segment of the rows on its own (one frame of one
    image)."""

    def __init__(self, cfg: Qwen3_5VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)  # q | k | v, each heads x head_dim
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
        """x [N, hidden]; cos, sin [N, head_dim / 2] float32; seg_lens: the segments' row counts (sum N)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, head_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # rotated in float32, as transformers does
        if len(set(seg_lens)) == 1:  # equal segments (one image, or frames of one size): one batched call
            s = len(seg_lens)
            q, k, v = (t.view(s, n // s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v)  # [S, heads, L, head_dim]
            out = out.transpose(1, 2).reshape(n, -1)
        else:
            # [heads, L, head_dim] per segment: block-diagonal attention without materialising an N x N mask
            out = torch.cat([F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                                            vs.transpose(0, 1)).transpose(0, 1)
                             for qs, ks, vs in zip(q.split(seg_lens), k.split(seg_lens), v.split(seg_lens))])
            out = out.reshape(n, -1)
        return self.proj(out)


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3_5VisionConfig):
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3_5VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg_lens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The Conv3d (kernel == stride) as a Linear over flattened patches; `proj` keeps the checkpoint's name."""

    def __init__(self, cfg: Qwen3_5VisionConfig):
        super().__init__()
        self.proj = Linear(cfg.patch_dim, cfg.hidden_size, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))  # the processor gives float32 pixels


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's m * m patches (consecutive rows) concatenated -> MLP."""

    def __init__(self, cfg: Qwen3_5VisionConfig):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS)
        self.linear_fc1 = Linear(self.merged, self.merged, bias=True)
        self.linear_fc2 = Linear(self.merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N / m^2, out_hidden_size]."""
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.merged))))


class Qwen3_5VisionEncoder(nn.Module):
    """pixel_values [N, patch_dim] + grid_thw [num_images, 3] -> merged embeddings [N / m^2, out_hidden_size], the
    images' rows in the order of grid_thw (merged_token_counts splits them per image). Parameter names are the
    checkpoint's without the `model.visual.` prefix (load_tensor / load_weights)."""

    def __init__(self, cfg: Qwen3_5VisionConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.grid_side = math.isqrt(cfg.num_position_embeddings)
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = _grids(grid_thw)
        self._check_inputs(pixel_values, grids)
        x = self.patch_embed(pixel_values)  # [N, hidden]
        x = x + self._position_embedding(grids).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)  # [N, head_dim / 2] float32 each
        seg_lens = [h * w for t, h, w in grids for _ in range(t)]  # one attention segment per frame
        for block in self.blocks:
            x = block(x, cos, sin, seg_lens)
        return self.merger(x)

    def _check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> None:
        m = self.cfg.spatial_merge_size
        if pixel_values.dim() != 2 or pixel_values.shape[1] != self.cfg.patch_dim:
            raise ValueError(f"pixel_values: expected [patches, {self.cfg.patch_dim}] (C * Tp * P * P), got "
                             f"{tuple(pixel_values.shape)}")
        if any(t < 1 or h % m or w % m or h < 1 or w < 1 for t, h, w in grids):
            raise ValueError(f"grid_thw {grids}: h and w must be positive multiples of spatial_merge_size={m}")
        total = sum(t * h * w for t, h, w in grids)
        if total != pixel_values.shape[0]:
            raise ValueError(f"grid_thw {grids} covers {total} patches, pixel_values has {pixel_values.shape[0]}")

    def _position_embedding(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned table resampled to each image's grid, in patch order -> [N, hidden] float32."""
        side, m = self.grid_side, self.cfg.spatial_merge_size
        table = self.pos_embed.weight.float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, hidden, side, side]
        per_size: dict[tuple[int, int], torch.Tensor] = {}  # images of one size share the resampled table
        out = []
        for t, h, w in grids:
            if (h, w) not in per_size:
                grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)  # [1, hidden, h, w]
                per_size[h, w] = _merge_block_order(grid[0].permute(1, 2, 0), m)  # [h * w, hidden]
            out.append(per_size[h, w].repeat(t, 1))  # every frame of an image at the same positions
        return torch.cat(out)

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim / 2] float32: the first head_dim / 4 pairs turn with the patch's row, the rest with
        its column, at frequencies theta^(-4i / head_dim) (computed in float32 like the checkpoint's training)."""
        m, quarter = self.cfg.spatial_merge_size, self.cfg.head_dim // 4
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32,
                                                                device=device) / (2 * quarter)))  # [head_dim / 4]
        pos = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
            cols = torch.arange(w, device=device).view(1, w).expand(h, w)
            pos.append(_merge_block_order(torch.stack([rows, cols], dim=-1), m).repeat(t, 1))  # [t * h * w, 2]
        angles = (torch.cat(pos).float()[..., None] * inv_freq).flatten(1)  # [N, 2 * head_dim / 4]: rows | cols
        return angles.cos(), angles.sin()

    # ---- weights ----

    def load_tensor(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy one checkpoint tensor (its full name, `model.visual.*` or `visual.*`) into its parameter; returns our
        parameter's name, None when the tensor is not the vision tower's. ValueError for a vision tensor that
        matches no parameter, or one of the wrong shape."""
        local = vision_tensor_name(name)
        if local is None:
            return None
        if local == _PATCH_WEIGHT:
            cfg = self.cfg
            conv = (cfg.hidden_size, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
            if tuple(tensor.shape) != conv:
                raise ValueError(f"{name}: expected the Conv3d weight {conv}, checkpoint has {tuple(tensor.shape)}")
            # kernel == stride: the conv is a Linear over (C, Tp, P, P)-flattened patches, the processor's layout
            tensor = tensor.reshape(cfg.hidden_size, -1)
        if copy_param(dict(self.named_parameters()), local, tensor) is None:
            raise ValueError(f"{name}: the Qwen3.5 vision encoder has no parameter {local!r}")
        return local

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the vision tensors among (name, tensor) pairs (other names are skipped: the language model's);
        returns the parameters loaded. ValueError when a parameter is left without its tensor."""
        loaded = {ours for name, tensor in tensors if (ours := self.load_tensor(name, tensor)) is not None}
        missing = sorted(set(dict(self.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} vision tensor(s), e.g. "
                             f"{VISION_PREFIXES[0]}{missing[0]}")
        return loaded
