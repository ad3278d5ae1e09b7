"""Hybrid linear-attention family: Qwen3-Next, Qwen3.5 (dense) and Qwen3.5-MoE, and the text part of the
Qwen3.5 vision-language checkpoints.

Layers follow `layer_types` (or every `full_attention_interval`-th layer full attention, 3:1 by default):
  * linear attention: the gated delta net over slot-indexed recurrent state (layers/gdn.py);
  * full attention, gated: q_proj yields each head's query and an output gate side by side; per-head q/k RMSNorm;
    rotary on the first `partial_rotary_factor` of each head (0.25); out = o_proj(attn * sigmoid(gate)).
All RMSNorms outside the GDN are zero-centred (`(1 + w)`). MLP: Qwen3.5 a dense SiLU MLP everywhere; Qwen3.5-MoE an
MoE block everywhere; Qwen3-Next an MoE block on layers i with (i + 1) % decoder_sparse_step == 0 and i not in
mlp_only_layers. MoE: softmax top-k (renormalised per norm_topk_prob; always for Qwen3.5-MoE) with a shared expert
behind a sigmoid gate. The MTP layer ships in the checkpoint as `mtp.*` (models/mtp.py): one gated full-attention
layer with the target's MLP kind. transformers' implementations are the oracle in tests.

The family's classes are named after its first member (Qwen3NextConfig, Qwen3NextForCausalLM); every architecture
above maps to them (models/registry.py).

Rotary of the Qwen3.5 members: interleaved mRoPE, as transformers' Qwen3_5TextRotaryEmbedding does it for every
Qwen3.5 / Qwen3.5-MoE config (it reads neither rope_parameters' mrope_interleaved nor requires mrope_section, whose
default is [11, 11, 10]): positions [3, T] (time, height, width; models/mrope_positions.py) turn frequency band j
with row 1 where j % 3 == 1 and j < 3 s1, row 2 where j % 3 == 2 and j < 3 s2, else row 0. 1-D positions, or three
equal rows (text), give plain 1-D rope exactly. Qwen3-Next is text-only rope (no mrope_section).

A vision-language checkpoint (one with a `vision_config`): its `model.language_model.*` is read as `model.*` and its
vision tower `model.visual.*` into `self.visual` (models/qwen3_5_vision.py); `encode_images` turns an image request's
pixels into the rows that replace its `<|image_pad|>` embeddings (ForwardBatch.input_embeds, built by the engine),
and the engine feeds the request's 3-row mRoPE positions (models/mrope_positions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.kvcache.cache_spec import CacheSpec, MHACacheSpec
from specserve.layers.attention import PagedAttention, QKPrep
from specserve.layers.gdn import GatedDeltaNet
from specserve.layers.linear import Linear, MergedLinear
from specserve.layers.moe import GatedMLP, SparseMoEBlock
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import MergedColumnParallelLinear, RowParallelLinear
from specserve.layers.rotary import RotaryEmbedding, inv_freq_from_config
from specserve.models.base import CausalLM
from specserve.models.config import ModelConfig, optional, require, text_config
from specserve.models.decoder_layer import PreNormDecoderLayer
from specserve.models.qwen3_5_vision import Qwen3_5VisionConfig, Qwen3_5VisionEncoder
from specserve.weights.fp8 import Fp8Weight

LINEAR, FULL = "linear_attention", "full_attention"
_LINEAR_ATTN = ".linear_attn."
_VL_PREFIX = "model.language_model."
_VISION_PREFIXES = ("model.visual.", "visual.")
# transformers' Qwen3.5 text rotary takes these sections when rope_parameters has none
QWEN3_5_MROPE_SECTION = (11, 11, 10)


@dataclass
class Qwen3NextConfig(ModelConfig):
    """The core fields plus the gated attention's, the gated delta net's and the MLP's (dense and/or MoE)."""

    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    ssm_dtype: torch.dtype = torch.float32  # the recurrent state's dtype (mamba_ssm_dtype), not the model's
    intermediate_size: int = 0  # dense MLP width (0: no dense layer)
    num_experts: int = 0  # 0: dense family (Qwen3.5)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf_config, arch: str) -> Qwen3NextConfig:
        text = text_config(hf_config)
        core = ModelConfig.core_fields(hf_config, arch)
        if arch.startswith("Qwen3_5"):  # interleaved whatever the config says, as transformers (module docstring)
            core["mrope_section"] = core["mrope_section"] or list(QWEN3_5_MROPE_SECTION)
            core["mrope_interleaved"] = True
        else:  # Qwen3-Next: 1-D rope
            core["mrope_section"], core["mrope_interleaved"] = None, False
        core["num_nextn_predict_layers"] = int(optional(text, "mtp_num_hidden_layers",
                                                        core["num_nextn_predict_layers"]))
        num_layers = core["num_layers"]
        types = getattr(text, "layer_types", None)
        if not types:
            every = int(optional(text, "full_attention_interval", 4))
            types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(num_layers)]
        types = list(types)[:num_layers]
        bad = sorted(set(types) - {LINEAR, FULL})
        if len(types) != num_layers or bad:
            raise ValueError(f"{arch}: layer_types must name {num_layers} layers as {LINEAR!r} or {FULL!r} "
                             f"(got {bad or types})")
        if optional(text, "hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act={text.hidden_act!r} is not supported (silu only)")
        num_heads = require(text, "num_attention_heads")
        fields = dict(
            num_heads=num_heads, num_kv_heads=optional(text, "num_key_value_heads", num_heads),
            head_dim=optional(text, "head_dim", core["hidden_size"] // num_heads),
            attention_bias=bool(optional(text, "attention_bias", False)), layer_types=types,
            linear_num_key_heads=require(text, "linear_num_key_heads"),
            linear_num_value_heads=require(text, "linear_num_value_heads"),
            linear_key_head_dim=require(text, "linear_key_head_dim"),
            linear_value_head_dim=require(text, "linear_value_head_dim"),
            linear_conv_kernel_dim=int(optional(text, "linear_conv_kernel_dim", 4)),
            ssm_dtype=_dtype(optional(text, "mamba_ssm_dtype", "float32")),
        )
        if arch.startswith("Qwen3_5For"):  # dense: a SiLU MLP on every layer
            fields.update(intermediate_size=require(text, "intermediate_size"))
        else:
            fields.update(num_experts=require(text, "num_experts"),
                          num_experts_per_tok=require(text, "num_experts_per_tok"),
                          moe_intermediate_size=require(text, "moe_intermediate_size"),
                          shared_expert_intermediate_size=int(optional(text, "shared_expert_intermediate_size", 0)))
            if arch.startswith("Qwen3Next"):
                fields.update(intermediate_size=int(optional(text, "intermediate_size", 0)),
                              norm_topk_prob=bool(optional(text, "norm_topk_prob", True)),
                              decoder_sparse_step=int(optional(text, "decoder_sparse_step", 1)),
                              mlp_only_layers=[int(i) for i in optional(text, "mlp_only_layers", [])])
        cfg = cls(**core, **fields)
        if not 0 < cfg.partial_rotary_factor <= 1:
            raise ValueError(f"{arch}: partial_rotary_factor={cfg.partial_rotary_factor} must be in (0, 1]")
        if cfg.num_experts and not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts="
                             f"{cfg.num_experts}")
        if any(not cfg.is_sparse(i) for i in range(num_layers)) and cfg.intermediate_size <= 0:
            raise ValueError(f"{arch}: dense layers need intermediate_size")
        return cfg

    def is_sparse(self, layer_id: int) -> bool:
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# the recurrent state's dtypes served (a float8 state drifts off within a few chunks; float64 doubles its bytes)
_SSM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in _SSM_DTYPES:
        raise ValueError(f"mamba_ssm_dtype={name!r} is not supported; one of {', '.join(_SSM_DTYPES)}")
    return _SSM_DTYPES[key]


def _norm(cfg: Qwen3NextConfig, size: int) -> RMSNorm:
    return RMSNorm(size, cfg.rms_norm_eps, zero_centered=True)


class GatedAttention(nn.Module):
    """Full attention with an output gate, per-head zero-centred q/k norms and partial rotary."""

    def __init__(self, cfg: Qwen3NextConfig, cache_index: int, rotary: RotaryEmbedding):
        """Under tensor parallelism (cfg.tp) this rank keeps its query heads (with their gates) and KV heads."""
        super().__init__()
        tp, head_dim = cfg.tp, cfg.head_dim
        self.head_dim = head_dim
        q_rows, kv_rows = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
        # q_proj: per head, the query's head_dim rows then the gate's (checkpoint order), 2 q_size in all
        if tp.size == 1:
            self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
            self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": 2 * q_rows, "k": kv_rows, "v": kv_rows},
                                         bias=cfg.attention_bias)
            self.o_proj = Linear(q_rows, cfg.hidden_size, bias=cfg.attention_bias)
        else:
            self.num_heads = tp.split(cfg.num_heads, "attention heads")
            self.qkv_proj = MergedColumnParallelLinear(
                cfg.hidden_size, {"q": (2 * q_rows, 2 * head_dim), "k": (kv_rows, head_dim),
                                  "v": (kv_rows, head_dim)}, tp, bias=cfg.attention_bias)
            self.num_kv_heads = self.qkv_proj.shard_offsets["k"][1] // head_dim
            self.o_proj = RowParallelLinear(q_rows, cfg.hidden_size, tp, bias=cfg.attention_bias)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.q_norm = _norm(cfg, self.head_dim)
        self.k_norm = _norm(cfg, self.head_dim)
        self.rotary = rotary  # shared module
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   cache_index=cache_index)

    def cache_spec(self) -> MHACacheSpec:
        return MHACacheSpec(self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), fb)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """qkv [T, 2q + 2kv] (the projection's output) -> the block's output [T, hidden]."""
        num_tokens, head_dim = qkv.shape[0], self.head_dim
        query_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        query_gate = query_gate.view(num_tokens, self.num_heads, 2 * head_dim)
        # [T, Hq, D], [T, Hq * D]
        q, gate = query_gate[..., :head_dim], query_gate[..., head_dim:].reshape(num_tokens, self.q_size)
        k = k.view(num_tokens, self.num_kv_heads, head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, head_dim)
        # per-head norms and partial rotary on the [T, heads, D] views of the projection, fused with the K/V store
        out = self.attn(q, k, v, fb, QKPrep(self.rotary, positions, self.q_norm, self.k_norm))  # [T, Hq * D]
        return self.o_proj(out * torch.sigmoid(gate))


def _mlp(cfg: Qwen3NextConfig, sparse: bool) -> nn.Module:
    if not sparse:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.tp)
    return SparseMoEBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                          renormalize=cfg.norm_topk_prob, router="softmax",
                          shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                          shared_expert_gated=cfg.shared_expert_intermediate_size > 0, tp=cfg.tp,
                          expert_parallel=cfg.moe_expert_parallel)


class Qwen3NextDecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: (GDN or gated attention) + MLP."""

    def __init__(self, cfg: Qwen3NextConfig, kind: str, cache_index: int, rotary: RotaryEmbedding, sparse: bool):
        super().__init__()
        self.input_layernorm = _norm(cfg, cfg.hidden_size)
        self.post_attention_layernorm = _norm(cfg, cfg.hidden_size)
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                             cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             cfg.linear_conv_kernel_dim, cfg.rms_norm_eps, cache_index, cfg.ssm_dtype,
                                             cfg.tp)
        else:
            self.self_attn = GatedAttention(cfg, cache_index, rotary)
        self.mlp = _mlp(cfg, sparse)

    def cache_specs(self) -> list[CacheSpec]:
        return [self.linear_attn.cache_spec() if self.kind == LINEAR else self.self_attn.cache_spec()]

    def mix(self, positions, hidden, fb: ForwardBatch):
        return self.linear_attn(hidden, fb) if self.kind == LINEAR else self.self_attn(positions, hidden, fb)

    def mixer_projections(self):
        if self.kind == LINEAR:
            return self.linear_attn.in_proj, self.linear_attn.out_proj
        return self.self_attn.qkv_proj, self.self_attn.o_proj

    def mix_projected(self, positions, proj, fb: ForwardBatch):
        if self.kind == LINEAR:
            return self.linear_attn.forward_projected(proj, fb)
        return self.self_attn.attend(positions, proj, fb)


class Qwen3NextForCausalLM(CausalLM):
    """The family's model class (the hooks of models/base.py CausalLM)."""

    config_class = Qwen3NextConfig
    tensor_parallel = True  # GDN and attention heads, dense MLPs split; experts split over the same ranks

    def __init__(self, cfg: Qwen3NextConfig, max_positions: int):
        super().__init__(cfg, max_positions)
        hf = cfg.hf_config
        # the vision tower of a vision-language checkpoint (not split over tensor-parallel ranks: each holds it all)
        self.visual: Qwen3_5VisionEncoder | None = None
        self.image_token_id: int | None = None
        if getattr(hf, "vision_config", None) is not None:
            self.visual = Qwen3_5VisionEncoder(Qwen3_5VisionConfig.from_hf(hf))
            self.image_token_id = int(hf.image_token_id)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One request's images: pixel_values [N, patch_dim] (the processor's, any float dtype, any device) and
        grid_thw [num_images, 3] -> [N / merge^2, hidden] in the model's dtype, image after image (one row per
        `<|image_pad|>` of the expanded prompt, in order)."""
        if self.visual is None:
            raise ValueError(f"{self.config.architecture}: this checkpoint has no vision tower (no vision_config)")
        weight = self.visual.patch_embed.proj.weight
        return self.visual(pixel_values.to(device=weight.device, dtype=weight.dtype), grid_thw).to(weight.dtype)

    def load_weights(self, weights):
        """As CausalLM's, with the vision tower's tensors (model.visual.*) loaded into `visual`."""
        if self.visual is None:
            return super().load_weights(weights)
        vision_loaded: set[str] = set()

        def text_only():
            for name, tensor in weights:
                if isinstance(tensor, Fp8Weight) and name.startswith(_VISION_PREFIXES):
                    tensor = tensor.dequantize(torch.float32)  # the tower computes in the model dtype
                ours = self.visual.load_tensor(name, tensor)
                if ours is not None:
                    vision_loaded.add("visual." + ours)
                    continue
                yield name, tensor

        return super().load_weights(text_only()) | vision_loaded

    @classmethod
    def make_layer(cls, cfg: Qwen3NextConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        kind = cfg.layer_types[layer_id]
        cache_index = cfg.layer_types[:layer_id].count(kind)  # its index among the layers of its cache kind
        return Qwen3NextDecoderLayer(cfg, kind, cache_index, rotary, cfg.is_sparse(layer_id))

    @classmethod
    def mtp_block(cls, cfg: Qwen3NextConfig, rotary: RotaryEmbedding) -> nn.Module:
        return Qwen3NextDecoderLayer(cfg, FULL, 0, rotary, cfg.num_experts > 0)

    @classmethod
    def make_rotary(cls, cfg: Qwen3NextConfig, max_positions: int) -> RotaryEmbedding:
        inv_freq, scale = inv_freq_from_config(text_config(cfg.hf_config), cfg.rotary_dim)
        return RotaryEmbedding(cfg.rotary_dim, max_positions, inv_freq, scale, cfg.mrope_section,
                               cfg.mrope_interleaved)

    @classmethod
    def make_norm(cls, cfg: Qwen3NextConfig, size: int) -> RMSNorm:
        return _norm(cfg, size)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        if name.startswith(_VL_PREFIX):
            return "model." + name[len(_VL_PREFIX):]
        return name

    @classmethod
    def load_tensor(cls, root: nn.Module, params: dict[str, nn.Parameter], name: str,
                    tensor: torch.Tensor) -> str | None:
        """The gated delta net's tensors go to its module (layers/gdn.py); the rest as every family's."""
        offset = name.find(_LINEAR_ATTN)
        if offset >= 0:
            prefix = name[:offset + len(_LINEAR_ATTN) - 1]
            ours = root.get_submodule(prefix).load_tensor(name[offset + len(_LINEAR_ATTN):], tensor)
            return None if ours is None else f"{prefix}.{ours}"
        return super().load_tensor(root, params, name, tensor)
