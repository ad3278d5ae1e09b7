"""Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): the dense Qwen3 block (q/k RMSNorm, GQA) with a sparse MoE
MLP (softmax router over `num_experts`, top `num_experts_per_tok`, renormalised when `norm_topk_prob`, no shared
expert) on layers i with (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers; a dense MLP of
`intermediate_size` elsewhere. The MTP block (DeepSeek layout inside the checkpoint, or a separate draft folder) is
the same attention with the MoE MLP. transformers' Qwen3MoeForCausalLM is the oracle in tests.

Checkpoints store experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); they are stacked into the
block's [E, ...] tensors as they stream in (layers/moe.py, models/tensor_loading.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from specserve.layers.moe import SparseMoEBlock
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.base import CausalLM
from specserve.models.config import ModelConfig, optional, require, text_config
from specserve.models.dense import DenseConfig, DenseDecoderLayer, dense_rotary
from specserve.models.dense_arch import DenseArch, with_drafts


@dataclass
class Qwen3MoeConfig(DenseConfig):
    """The dense block's fields (Qwen3's attention) plus the MoE MLP's."""

    # the attention of Qwen3 (per-head q/k RMSNorm; a sliding window only with use_sliding_window)
    arch_features: ClassVar[dict[str, DenseArch]] = with_drafts({
        "Qwen3MoeForCausalLM": DenseArch(qk_norm=True, window_switch="use_sliding_window")})

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf_config, arch: str) -> Qwen3MoeConfig:
        text = text_config(hf_config)
        cfg = cls(**ModelConfig.core_fields(hf_config, arch), **cls.dense_fields(hf_config, arch),
                  num_experts=require(text, "num_experts"), num_experts_per_tok=require(text, "num_experts_per_tok"),
                  moe_intermediate_size=require(text, "moe_intermediate_size"),
                  norm_topk_prob=bool(optional(text, "norm_topk_prob", True)),
                  decoder_sparse_step=int(optional(text, "decoder_sparse_step", 1)),
                  mlp_only_layers=[int(i) for i in optional(text, "mlp_only_layers", [])])
        if cfg.partial_rotary_factor != 1.0:
            raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor} is not supported by Qwen3-MoE")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts="
                             f"{cfg.num_experts}")
        return cfg

    def is_sparse(self, layer_id: int) -> bool:
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


def moe_block(cfg: Qwen3MoeConfig) -> SparseMoEBlock:
    return SparseMoEBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                          renormalize=cfg.norm_topk_prob, router="softmax", tp=cfg.tp,
                          expert_parallel=cfg.moe_expert_parallel)


class Qwen3MoeForCausalLM(CausalLM):
    """The family's model class (the hooks of models/base.py CausalLM): the dense family's layer (models/dense.py
    DenseDecoderLayer) with the MoE block as its MLP on sparse layers."""

    config_class = Qwen3MoeConfig
    tensor_parallel = True  # attention and dense MLPs split as dense models, experts split over the same ranks

    @classmethod
    def make_layer(cls, cfg: Qwen3MoeConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return DenseDecoderLayer(cfg, layer_id, rotary, moe_block(cfg) if cfg.is_sparse(layer_id) else None)

    @classmethod
    def mtp_block(cls, cfg: Qwen3MoeConfig, rotary: RotaryEmbedding) -> nn.Module:
        return DenseDecoderLayer(cfg, 0, rotary, moe_block(cfg))

    @classmethod
    def make_rotary(cls, cfg: Qwen3MoeConfig, max_positions: int) -> RotaryEmbedding:
        return dense_rotary(cfg, max_positions)
