"""MLA + MoE family: DeepSeek-V3 / R1 (and DeepSeek-V2-style checkpoints without q-LoRA).

Decoder layer: RMSNorm, multi-head latent attention (layers/mla.py: latent cache of kv_lora_rank + rope dims per
token), RMSNorm, and an MLP: dense (SiLU, intermediate_size) on layers before first_k_dense_replace, else the MoE
block — sigmoid scores with the correction bias used for the choice only, group-limited top-k (n_group, topk_group),
weights renormalised (norm_topk_prob) and scaled by routed_scaling_factor, plus n_shared_experts always-on experts
(layers/moe.py). The MTP layer sits at model.layers.{num_hidden_layers} in the DeepSeek layout (models/mtp.py); its
block is this family's MLA + MoE layer with its own latent cache. transformers' DeepseekV3ForCausalLM is the oracle
in tests. The sparse-attention family (models/deepseek_v32.py: DeepSeek-V3.2, GLM-5) uses this file's layer, rotary
and weight names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.kvcache.cache_spec import CacheSpec
from specserve.layers.mla import MLAAttention
from specserve.layers.moe import GatedMLP, SparseMoEBlock
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding, inv_freq_from_config, rope_parameters, rope_type_of
from specserve.models.base import CausalLM
from specserve.models.config import ModelConfig, optional, require, text_config
from specserve.models.decoder_layer import PreNormDecoderLayer
from specserve.models.tensor_loading import load_checkpoint_tensor, load_param

_SELF_ATTN = ".self_attn."


@dataclass
class DeepseekV3Config(ModelConfig):
    num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention_bias: bool = False
    rope_interleave: bool = True
    attn_scaling: float = 1.0  # softmax scale: qk_head_dim^-0.5, times mscale^2 under yarn with mscale_all_dim
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0

    @classmethod
    def from_hf(cls, hf_config, arch: str) -> DeepseekV3Config:
        text = text_config(hf_config)
        if optional(text, "hidden_act", "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act={text.hidden_act!r} is not supported (silu only)")
        nope, rope = require(text, "qk_nope_head_dim"), require(text, "qk_rope_head_dim")
        scaling = (nope + rope) ** -0.5
        params = rope_parameters(text)
        if rope_type_of(params) != "default" and params.get("mscale_all_dim"):
            factor = float(params["factor"])
            mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scaling *= mscale * mscale  # as transformers' yarn_apply_mscale
        q_lora = getattr(text, "q_lora_rank", None)
        cfg = cls(
            **ModelConfig.core_fields(hf_config, arch),
            num_heads=require(text, "num_attention_heads"), q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=require(text, "kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
            v_head_dim=require(text, "v_head_dim"), attention_bias=bool(optional(text, "attention_bias", False)),
            rope_interleave=bool(optional(text, "rope_interleave", True)), attn_scaling=scaling,
            intermediate_size=require(text, "intermediate_size"),
            moe_intermediate_size=require(text, "moe_intermediate_size"),
            n_routed_experts=require(text, "n_routed_experts"),
            num_experts_per_tok=require(text, "num_experts_per_tok"),
            n_group=int(optional(text, "n_group", 1)), topk_group=int(optional(text, "topk_group", 1)),
            routed_scaling_factor=float(optional(text, "routed_scaling_factor", 1.0)),
            n_shared_experts=int(optional(text, "n_shared_experts", 0)),
            norm_topk_prob=bool(optional(text, "norm_topk_prob", True)),
            first_k_dense_replace=int(optional(text, "first_k_dense_replace", 0)),
        )
        if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..n_routed_experts="
                             f"{cfg.n_routed_experts}")
        return cfg

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace


def moe_block(cfg: DeepseekV3Config) -> SparseMoEBlock:
    return SparseMoEBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                          renormalize=cfg.norm_topk_prob, router="grouped_sigmoid", n_group=cfg.n_group,
                          topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                          shared_expert_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
                          tp=cfg.tp, expert_parallel=cfg.moe_expert_parallel)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    """Pre-norm block: MLA + (dense or MoE) MLP."""

    def __init__(self, cfg: DeepseekV3Config, cache_index: int, rotary: RotaryEmbedding, sparse: bool,
                 indexer: nn.Module | None = None, shared_index: bool = False):
        """indexer / shared_index: the sparse-attention family's DSA indexer (models/deepseek_v32.py)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                                      cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rms_norm_eps,
                                      cfg.attn_scaling, cfg.rope_interleave, cfg.attention_bias, cache_index, rotary,
                                      indexer=indexer, shared_index=shared_index, tp=cfg.tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = moe_block(cfg) if sparse else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.tp)

    def cache_specs(self) -> list[CacheSpec]:
        return self.self_attn.cache_specs()

    def mix(self, positions, hidden, fb: ForwardBatch):
        return self.self_attn(positions, hidden, fb)


def mla_rotary(cfg: DeepseekV3Config, max_positions: int) -> RotaryEmbedding:
    """Rotary on the qk_rope_head_dim dims of each head (MLA's decoupled rope)."""
    inv_freq, scale = inv_freq_from_config(text_config(cfg.hf_config), cfg.qk_rope_head_dim)
    return RotaryEmbedding(cfg.qk_rope_head_dim, max_positions, inv_freq, scale)


def load_mla_tensor(root: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """MLA projections are copied by name (a q_proj without q-LoRA is not a fused q/k/v shard); the rest as every
    family's (models/tensor_loading.py)."""
    if _SELF_ATTN in name:
        return load_param(root, params, name, tensor)
    return load_checkpoint_tensor(root, params, name, tensor)


class DeepseekV3ForCausalLM(CausalLM):
    """The family's model class (the hooks of models/base.py CausalLM)."""

    config_class = DeepseekV3Config
    tensor_parallel = True  # MLA heads and dense MLPs split, experts over the same ranks (latent and indexer whole)

    @classmethod
    def make_layer(cls, cfg: DeepseekV3Config, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekV3DecoderLayer(cfg, layer_id, rotary, cfg.is_sparse(layer_id))  # every layer keeps a latent

    @classmethod
    def mtp_block(cls, cfg: DeepseekV3Config, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekV3DecoderLayer(cfg, 0, rotary, cfg.is_sparse(cfg.num_layers))

    @classmethod
    def make_rotary(cls, cfg: DeepseekV3Config, max_positions: int) -> RotaryEmbedding:
        return mla_rotary(cfg, max_positions)

    @classmethod
    def load_tensor(cls, root: nn.Module, params: dict[str, nn.Parameter], name: str,
                    tensor: torch.Tensor) -> str | None:
        return load_mla_tensor(root, params, name, tensor)
