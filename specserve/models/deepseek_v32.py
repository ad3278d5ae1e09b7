"""MLA + DSA (DeepSeek Sparse Attention) + MoE: DeepSeek-V3.2 and GLM-5 (GlmMoeDsa), with DeepSeek-V3's layer.

Each attention layer is DeepSeek-V3's MLA with a DSA indexer (layers/dsa_indexer.py) that keeps the `index_topk`
best earlier tokens per query; attention sees only those (and, within them, stays causal). Differences:
  * DeepSeek-V3.2: every layer indexes; the indexer's rope is rotate-half (not interleaved);
  * GLM-5: `indexer_types` per layer, "full" layers index and "shared" ones reuse the previous full layer's choice;
    the indexer's rope is interleaved.
The main MLA rope is interleaved in both (DeepSeek's layout). MLP per `mlp_layer_types` (dense / sparse). The MTP
layer at model.layers.{L} is a full indexed MLA + MoE block with its own latent and index-key caches. transformers'
DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM are the oracles in tests; both architectures map to this file's
DeepseekV32Config and DeepseekV32ForCausalLM (models/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specserve.layers.dsa_indexer import DSAIndexer
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.base import CausalLM
from specserve.models.config import optional, require, text_config
from specserve.models.deepseek_v3 import DeepseekV3Config, DeepseekV3DecoderLayer, load_mla_tensor, mla_rotary

FULL, SHARED = "full", "shared"


@dataclass
class DeepseekV32Config(DeepseekV3Config):
    """DeepSeek-V3's fields plus the indexer's and the per-layer kinds."""

    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_rope_interleave: bool = False
    indexer_types: list[str] = field(default_factory=list)  # "full" | "shared" per layer
    mlp_layer_types: list[str] = field(default_factory=list)  # "dense" | "sparse" per layer

    @classmethod
    def from_hf(cls, hf_config, arch: str) -> DeepseekV32Config:
        base = DeepseekV3Config.from_hf(hf_config, arch)
        text = text_config(hf_config)
        num_layers = base.num_layers
        if not base.q_lora_rank:
            raise ValueError(f"{arch}: sparse attention's indexer reads the q-LoRA residual: q_lora_rank is needed")
        glm = arch.startswith("GlmMoeDsa")
        types = (list(optional(text, "indexer_types", None) or [FULL] * num_layers) if glm
                 else [FULL] * num_layers)
        mlp = list(optional(text, "mlp_layer_types", None)
                   or ["dense" if i < base.first_k_dense_replace else "sparse" for i in range(num_layers)])
        if len(types) != num_layers or set(types) - {FULL, SHARED} or types[0] != FULL:
            raise ValueError(f"{arch}: indexer_types must name {num_layers} layers 'full' or 'shared', the first "
                             "'full'")
        if len(mlp) != num_layers or set(mlp) - {"dense", "sparse"}:
            raise ValueError(f"{arch}: mlp_layer_types must name {num_layers} layers 'dense' or 'sparse'")
        fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
        return cls(**fields, index_topk=int(require(text, "index_topk")),
                   index_head_dim=int(require(text, "index_head_dim")),
                   index_n_heads=int(require(text, "index_n_heads")), indexer_rope_interleave=glm,
                   indexer_types=types, mlp_layer_types=mlp)

    def is_sparse(self, layer_id: int) -> bool:
        """MoE on the layers mlp_layer_types marks sparse; the MTP layer (index L) is sparse."""
        return layer_id >= len(self.mlp_layer_types) or self.mlp_layer_types[layer_id] == "sparse"


def _indexed_layer(cfg: DeepseekV32Config, latent_cache_index: int, index_cache_index: int | None,
                   rotary: RotaryEmbedding, sparse: bool) -> DeepseekV3DecoderLayer:
    """latent_cache_index: the layer's MLA latent cache; index_cache_index: its index among the indexing layers (its
    index-key cache), None for a "shared" layer."""
    indexer = None if index_cache_index is None else DSAIndexer(
        cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim,
        cfg.index_topk, cfg.indexer_rope_interleave, index_cache_index, rotary)
    return DeepseekV3DecoderLayer(cfg, latent_cache_index, rotary, sparse, indexer=indexer,
                                  shared_index=index_cache_index is None)


class DeepseekV32ForCausalLM(CausalLM):
    """The family's model class (the hooks of models/base.py CausalLM): DeepSeek-V3's layer with the DSA indexer,
    its rotary and weight names (models/deepseek_v3.py)."""

    config_class = DeepseekV32Config
    tensor_parallel = True  # as DeepSeek-V3; each rank runs the whole indexer

    @classmethod
    def make_layer(cls, cfg: DeepseekV32Config, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        full = cfg.indexer_types[layer_id] == FULL
        index_cache_index = cfg.indexer_types[:layer_id].count(FULL) if full else None
        return _indexed_layer(cfg, layer_id, index_cache_index, rotary, cfg.is_sparse(layer_id))

    @classmethod
    def mtp_block(cls, cfg: DeepseekV32Config, rotary: RotaryEmbedding) -> nn.Module:
        return _indexed_layer(cfg, 0, 0, rotary, cfg.is_sparse(cfg.num_layers))

    @classmethod
    def make_rotary(cls, cfg: DeepseekV32Config, max_positions: int) -> RotaryEmbedding:
        return mla_rotary(cfg, max_positions)

    @classmethod
    def load_tensor(cls, root: nn.Module, params: dict[str, nn.Parameter], name: str,
                    tensor: torch.Tensor) -> str | None:
        return load_mla_tensor(root, params, name, tensor)
