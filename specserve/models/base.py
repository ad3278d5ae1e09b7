"""The base of every model family: `CausalLM`, and `DecoderStack`, the module tree under it.

What every family shares lives here: the token embedding, the stack of decoder layers and its forward loop (with
the aux-layer outputs an EAGLE-3 style drafter reads), the final norm, the lm-head and logits, the cache specs,
tied embeddings and checkpoint loading. A family subclasses CausalLM (and nothing else) and supplies its config
class and the hooks below; its decoder layers subclass models/decoder_layer.py PreNormDecoderLayer and *use* the
shared blocks they need (the dense attention of models/dense.py, the MoE block of layers/moe.py, ...).

The module tree keeps the HF checkpoint's names: `model.embed_tokens`, `model.layers.{i}`, `model.norm`,
`lm_head`, so most checkpoint tensors load by name (models/tensor_loading.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from specserve.batch import ForwardBatch, ForwardMode
from specserve.kvcache.cache_spec import CacheSpec
from specserve.layers.embedding import LMHead, VocabEmbedding
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import ParallelLMHead, VocabParallelEmbedding
from specserve.layers.rotary import RotaryEmbedding
from specserve.models import tensor_loading
from specserve.models.config import ModelConfig

# the modes whose output feeds a drafter (extend, verify), so they also return the aux layers' outputs
_FEATURE_MODES = (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)


class DecoderStack(nn.Module):
    """embed_tokens -> layers -> norm (a CausalLM's `model`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, family: type[CausalLM]):
        """family: the model class whose hooks build the decoder layers, the rotary table and the norm."""
        super().__init__()
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if cfg.tp.size == 1
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.tp))
        self.rotary = family.make_rotary(cfg, max_positions)
        self.layers = nn.ModuleList([family.make_layer(cfg, i, self.rotary) for i in range(cfg.num_layers)])
        self.norm = family.make_norm(cfg, cfg.hidden_size)
        self.aux_layers: tuple[int, ...] = ()  # layers whose outputs are appended to the output (set_aux_layers)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """-> [T, H] final-norm hidden, or [T, (1 + k) H] = [final-norm | output of each of the k aux layers] in the
        modes whose output feeds a drafter (extend, verify; plain decode only needs logits)."""
        hidden = self.embed_tokens(fb.input_ids) if fb.input_embeds is None else fb.input_embeds
        residual = None
        aux = []
        aux_layers = self.aux_layers if fb.mode in _FEATURE_MODES else ()
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(fb.positions, hidden, residual, fb)
            if i in aux_layers:
                aux.append(hidden + residual)  # the residual stream after layer i (the block's output)
        hidden, _ = self.norm(hidden, residual)
        return torch.cat([hidden, *aux], dim=-1) if aux else hidden


class CausalLM(nn.Module):
    """A target model. forward() returns the features handed to the MTP drafter: the final-norm hidden state [T, H]
    (the lm-head input), followed by the outputs of the aux layers a drafter asked for (set_aux_layers), so
    [T, feature_size]. compute_logits reads the first H columns.

    A family supplies (docs/adding-a-model.md):
      * config_class: its ModelConfig subclass, with `from_hf(hf_config, arch)`;
      * make_layer, mtp_block: its decoder layer for layer i, and the block of its MTP layer (models/mtp.py);
      * make_rotary: its rotary table (the head dims that rotate);
      * tensor_parallel = True in its own class body once its layers split over ranks;
    and may override make_norm (its RMSNorm kind), checkpoint_name (tensors it skips or renames) and load_tensor
    (tensors that do not load by name or fused shard, models/tensor_loading.py)."""

    config_class: ClassVar[type[ModelConfig]]
    # built for a tensor-parallel group above one rank (cfg.tp); a family declares it itself (not inherited)
    tensor_parallel: ClassVar[bool] = False

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        if cfg.tp.size > 1 and not type(self).__dict__.get("tensor_parallel", False):
            raise ValueError(f"{type(self).__name__} ({cfg.architecture}) declares no tensor-parallel layers: "
                             "it runs on one rank only")
        self.config = cfg
        self.model = DecoderStack(cfg, max_positions, type(self))
        self.lm_head = (LMHead(cfg.vocab_size, cfg.hidden_size) if cfg.tp.size == 1
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.tp))
        self.tie_weights()

    # ------------------------------------------------------------------ family hooks
    @classmethod
    def make_layer(cls, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        """Decoder layer `layer_id` (a models/decoder_layer.py PreNormDecoderLayer)."""
        raise NotImplementedError

    @classmethod
    def mtp_block(cls, cfg: ModelConfig, rotary: RotaryEmbedding) -> nn.Module:
        """The decoder block of this family's MTP layer (its own caches: cache index 0 of the draft's pools)."""
        raise NotImplementedError

    @classmethod
    def make_rotary(cls, cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
        """The rotary table the layers share (also rebuilt in float32 after loading: models/loader.py)."""
        raise NotImplementedError

    @classmethod
    def make_norm(cls, cfg: ModelConfig, size: int) -> RMSNorm:
        """The family's RMSNorm outside the decoder blocks (final norm; the MTP layer's norms)."""
        return RMSNorm(size, cfg.rms_norm_eps)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """A checkpoint tensor's name as load_tensor reads it; None for tensors this family does not load (e.g. the
        vision tower of a vision-language checkpoint loaded as text only)."""
        return name

    @classmethod
    def load_tensor(cls, root: nn.Module, params: dict[str, nn.Parameter], name: str,
                    tensor: torch.Tensor) -> str | None:
        """Copy one HF-named tensor into root's parameters (root: the model, or its MTP draft); returns our
        parameter's name (None: no match)."""
        return tensor_loading.load_checkpoint_tensor(root, params, name, tensor)

    @classmethod
    def finish_loading(cls, root: nn.Module, loaded: set[str]) -> set[str]:
        """The parameters of root that are now completely loaded, of those load_tensor named (MoE blocks' stacked
        experts stream in pieces)."""
        return tensor_loading.finish_loading(root, loaded)

    # ------------------------------------------------------------------ what the engine calls
    def cache_specs(self) -> list[CacheSpec]:
        """One spec per cache-keeping layer, in layer order (kvcache/cache_spec.py)."""
        return [spec for layer in self.model.layers for spec in layer.cache_specs()]

    def tie_weights(self) -> None:
        """Share the embedding with the lm-head (tied checkpoints). Call again after to_empty(): moving a meta
        model to a device makes new Parameter objects per module and so unties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def embed_tokens(self) -> VocabEmbedding:
        return self.model.embed_tokens

    def set_aux_layers(self, layers: list[int]) -> None:
        """Append the outputs of these decoder layers to forward()'s result (an EAGLE-3 style drafter reads them)."""
        bad = [i for i in layers if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"aux hidden layers {bad} outside the target's {self.config.num_layers} layers")
        self.model.aux_layers = tuple(sorted(set(layers)))

    @property
    def feature_size(self) -> int:
        """Width of forward()'s output in extend and verify batches: H per aux layer beyond the final hidden."""
        return self.config.hidden_size * (1 + len(self.model.aux_layers))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, H] or [T, feature_size] (forward's output) -> logits [T, V]."""
        hidden_size = self.config.hidden_size
        if features.shape[-1] != hidden_size:
            features = features[..., :hidden_size].contiguous()
        return self.lm_head(features)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of our parameters that were written."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None or "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, tensor = tensor_loading.load_fp8_or_plain(self, name, tensor)
            if target is None:
                target = self.load_tensor(self, params, name, tensor)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}")
            loaded.add(target)
        return self.finish_loading(self, loaded)
