"""Dense decoder family: Llama (and SmolLM), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

One implementation with three switches, set per architecture (models/dense_arch.py DENSE_ARCHITECTURES) and by the
config; the HF `transformers` implementations are the oracle in tests. Parameter layout: fused qkv_proj and
gate_up_proj (fewer, larger GEMMs on the GPU).

Its attention block (DenseAttention) and layer (DenseDecoderLayer, which takes another MLP) are also what the
Qwen3-MoE family's layers are made of (models/qwen3_moe.py). Only this family's attention can take its q/k prep
(norms, rotary, K/V store) in the qkv GEMV's epilogue on decode rows, so that fusion lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.kernels import ops
from specserve.kernels.gemv_policy import FASTER_NORM_PREP, FASTER_PREP, prefer_fused
from specserve.kernels.rope_store import RopeStore
from specserve.kvcache.cache_spec import CacheSpec, MHACacheSpec
from specserve.layers.activation import silu_and_mul
from specserve.layers.attention import STORED, PagedAttention, QKPrep
from specserve.layers.linear import Linear, MergedLinear
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import MergedColumnParallelLinear, RowParallelLinear
from specserve.layers.rotary import RotaryEmbedding, inv_freq_from_config
from specserve.models.base import CausalLM
from specserve.models.config import ModelConfig, optional, require, text_config
from specserve.models.decoder_layer import PreNormDecoderLayer
from specserve.models.dense_arch import DENSE_ARCHITECTURES, SILU, DenseArch, sliding_window


@dataclass
class DenseConfig(ModelConfig):
    """The dense family's config: the core fields plus its attention and MLP shapes and switches. The config of a
    family whose layers are this attention block (Qwen3-MoE) extends it with its own fields and table."""

    # the architectures this config class parses
    arch_features: ClassVar[dict[str, DenseArch]] = DENSE_ARCHITECTURES

    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def dense_fields(cls, hf_config, arch: str) -> dict:
        if arch not in cls.arch_features:
            raise ValueError(f"{cls.__name__} does not parse architecture {arch!r}; it parses: "
                             f"{', '.join(sorted(cls.arch_features))}")
        features = cls.arch_features[arch]
        text = text_config(hf_config)
        num_heads = require(text, "num_attention_heads")
        if getattr(text, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported")
        activation = optional(text, "hidden_act", "silu")
        if activation not in SILU:
            raise ValueError(f"{arch}: hidden_act={activation!r} is not supported (silu only)")
        attn_bias = bool(getattr(text, "attention_bias", False))
        qkv_bias = features.qkv_bias
        return dict(
            num_heads=num_heads,
            num_kv_heads=optional(text, "num_key_value_heads", num_heads),
            head_dim=optional(text, "head_dim", require(text, "hidden_size") // num_heads),
            intermediate_size=require(text, "intermediate_size"),
            qkv_bias=attn_bias if qkv_bias is None else qkv_bias,
            o_bias=attn_bias if qkv_bias is None else False,
            qk_norm=features.qk_norm or bool(getattr(text, "qk_norm", False)),
            sliding_window=sliding_window(text, features),
        )

    @classmethod
    def from_hf(cls, hf_config, arch: str) -> DenseConfig:
        cfg = cls(**ModelConfig.core_fields(hf_config, arch), **cls.dense_fields(hf_config, arch))
        if cfg.partial_rotary_factor != 1.0:
            raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor} is not supported by the dense "
                             "family (every head dim rotates)")
        return cfg


def dense_rotary(cfg: DenseConfig, max_positions: int) -> RotaryEmbedding:
    """Rotary on every dim of each head (mRoPE sections when the config has them)."""
    inv_freq, scale = inv_freq_from_config(text_config(cfg.hf_config), cfg.head_dim)
    return RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, scale, cfg.mrope_section, cfg.mrope_interleaved)


class DenseAttention(nn.Module):
    """Multi-head attention with grouped K/V heads, q/k/v biases and per-head q/k norms as the config sets."""

    def __init__(self, cfg: DenseConfig, layer_id: int, rotary: RotaryEmbedding):
        """Under tensor parallelism (cfg.tp.size > 1) this rank keeps its query heads and its KV heads (replicated
        when there are fewer KV heads than ranks); o_proj sums the ranks' partial outputs."""
        super().__init__()
        tp, head_dim = cfg.tp, cfg.head_dim
        self.head_dim = head_dim
        q_rows, kv_rows = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
        if tp.size == 1:
            self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
            self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_rows, "k": kv_rows, "v": kv_rows},
                                         bias=cfg.qkv_bias)
            self.o_proj = Linear(q_rows, cfg.hidden_size, bias=cfg.o_bias)
        else:
            self.num_heads = tp.split(cfg.num_heads, "attention heads")
            self.qkv_proj = MergedColumnParallelLinear(
                cfg.hidden_size, {"q": (q_rows, head_dim), "k": (kv_rows, head_dim), "v": (kv_rows, head_dim)}, tp,
                bias=cfg.qkv_bias)
            self.num_kv_heads = self.qkv_proj.shard_offsets["k"][1] // head_dim
            self.o_proj = RowParallelLinear(q_rows, cfg.hidden_size, tp, bias=cfg.o_bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary  # shared module (not a parameter owner)
        # every layer of a dense model keeps K/V, so its MHA cache index is its layer number
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   cache_index=layer_id)

    def cache_spec(self) -> MHACacheSpec:
        return MHACacheSpec(self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), fb)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """qkv [T, q + 2kv] (the projection's output) -> the attention block's output [T, hidden]."""
        q, k, v = self._heads(qkv)
        # per-head norms (Qwen3) and rotary on the [T, heads, D] views of the projection, fused with the K/V store
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.o_proj(self.attn(q, k, v, fb, QKPrep(self.rotary, positions, *norms)))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The [T, heads, D] views of q, k, v in the projection's output qkv [T, q + 2kv]."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(num_tokens, self.num_heads, self.head_dim),
                k.reshape(num_tokens, self.num_kv_heads, self.head_dim),
                v.reshape(num_tokens, self.num_kv_heads, self.head_dim))

    def prep_fusable(self) -> bool:
        """Whether the q/k prep can run in the epilogue of the qkv projection's fused GEMV: rotary on all of D with
        1-D positions, one device (q/k norms or not)."""
        return (type(self.qkv_proj) is MergedLinear and self.rotary.mrope_section is None
                and self.rotary.cos_sin_cache.shape[1] == self.head_dim)

    def attend_from_norm(self, norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the attention block's output [T, hidden], the new residual) with the input norm, the qkv projection,
        the q/k norms (Qwen3), rotary and the K/V store in one op (kernels/ops.py norm_gemv_rope_store;
        prep_fusable layers: 1-D positions); None when that op's launch cannot take this step: the caller runs the
        unfused path."""
        norms = {}
        if self.qk_norm:
            norms = dict(q_norm_w=self.q_norm.weight, k_norm_w=self.k_norm.weight, eps=self.q_norm.eps,
                         weight_offset=self.q_norm.weight_offset)
        k_scale, v_scale = self.attn.kv_scales(fb)  # an FP8 cache's: the GEMV epilogue refuses it (RopeStore.fits)
        rope = RopeStore(self.rotary.cos_sin_cache, positions, fb.out_cache_loc, *self.attn.kv_caches(fb),
                         self.num_heads, self.num_kv_heads, self.head_dim, **norms, k_scale=k_scale, v_scale=v_scale)
        out = ops.norm_gemv_rope_store(hidden, residual, norm.weight, norm.eps, norm.weight_offset,
                                       self.qkv_proj.weight, self.qkv_proj.bias, rope)
        if out is None:
            return None
        qkv, residual = out
        q, k, v = self._heads(qkv)
        return self.o_proj(self.attn(q, k, v, fb, STORED)), residual


class DenseMLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DenseConfig):
        """Under tensor parallelism each rank keeps a slice of the intermediate features."""
        super().__init__()
        tp, intermediate = cfg.tp, cfg.intermediate_size
        if tp.size == 1:
            self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": intermediate, "up": intermediate})
            self.down_proj = Linear(intermediate, cfg.hidden_size)
        else:
            self.gate_up_proj = MergedColumnParallelLinear(
                cfg.hidden_size, {"gate": (intermediate, 1), "up": (intermediate, 1)}, tp)
            self.down_proj = RowParallelLinear(intermediate, cfg.hidden_size, tp)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))


class DenseDecoderLayer(PreNormDecoderLayer):
    """Attention + MLP block. `mlp`: the family's MLP for this layer (default: the dense SiLU-gated MLP; the
    Qwen3-MoE family passes its sparse block)."""

    def __init__(self, cfg: DenseConfig, layer_id: int, rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DenseAttention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else DenseMLP(cfg)

    def cache_specs(self) -> list[CacheSpec]:
        return [self.self_attn.cache_spec()]

    def mix(self, positions, hidden, fb: ForwardBatch):
        return self.self_attn(positions, hidden, fb)

    def mixer_projections(self) -> tuple[nn.Module, nn.Module] | None:
        return self.self_attn.qkv_proj, self.self_attn.o_proj

    def mix_projected(self, positions, proj, fb: ForwardBatch):
        return self.self_attn.attend(positions, proj, fb)

    def set_decode_gemv(self, mode: str) -> bool:
        """PreNormDecoderLayer.set_decode_gemv, and fused_prep: the q/k prep in the qkv GEMV's epilogue where the
        input norm fuses and the attention allows it (DenseAttention.prep_fusable); under 'auto' only for weight
        shapes measured faster with it (kernels/gemv_policy.py FASTER_PREP, FASTER_NORM_PREP with q/k norms)."""
        fused = super().set_decode_gemv(mode)
        qkv_shape = tuple(self.self_attn.qkv_proj.weight.shape)
        self.fused_prep = self.fused_in and self.self_attn.prep_fusable() and (
            mode == "triton" or prefer_fused([qkv_shape], FASTER_NORM_PREP if self.self_attn.qk_norm else FASTER_PREP))
        return fused

    def mix_from_norm(self, positions, hidden, residual, fb: ForwardBatch):
        """The input norm, the qkv projection, the q/k prep and the K/V store as one op
        (DenseAttention.attend_from_norm)."""
        return self.self_attn.attend_from_norm(self.input_layernorm, hidden, residual,
                                               self.self_attn.rotary.table_positions(positions), fb)


class DenseForCausalLM(CausalLM):
    """The dense family's model class (the hooks of models/base.py CausalLM)."""

    config_class = DenseConfig
    tensor_parallel = True

    @classmethod
    def make_layer(cls, cfg: DenseConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return DenseDecoderLayer(cfg, layer_id, rotary)

    @classmethod
    def mtp_block(cls, cfg: DenseConfig, rotary: RotaryEmbedding) -> nn.Module:
        return DenseDecoderLayer(cfg, 0, rotary)

    @classmethod
    def make_rotary(cls, cfg: DenseConfig, max_positions: int) -> RotaryEmbedding:
        return dense_rotary(cfg, max_positions)
