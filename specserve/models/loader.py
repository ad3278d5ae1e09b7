"""Load a target model (HF folder or GGUF file) and its MTP drafter onto a device, with a progress bar."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specserve.models.config import ModelConfig
from specserve.models.mtp import MTPDraftModel
from specserve.models.registry import model_class
from specserve.weights.gguf_loader import iter_gguf
from specserve.weights.safetensors_loader import iter_safetensors

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """Where a checkpoint lives: an HF folder, or a GGUF file (folder + file name)."""

    folder: str
    gguf_file: str | None = None

    @staticmethod
    def resolve(path: str) -> ModelSource:
        if os.path.isfile(path) and path.endswith(".gguf"):
            return ModelSource(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
        if os.path.isdir(path):
            if os.path.exists(os.path.join(path, "config.json")):
                return ModelSource(path)
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return ModelSource(path, ggufs[0])
            raise ValueError(f"{path}: no config.json, and not exactly one .gguf file")
        raise ValueError(f"model path {path!r} is neither a checkpoint folder nor a .gguf file")

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_path(self) -> str:
        return os.path.join(self.folder, self.gguf_file)


def load_hf_config(src: ModelSource):
    from transformers import AutoConfig

    if src.is_gguf:
        return AutoConfig.from_pretrained(src.folder, gguf_file=src.gguf_file)
    return AutoConfig.from_pretrained(src.folder)


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32  # bf16 GEMMs on CPU are slow and gain nothing here
    cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if cfg_dtype in (torch.bfloat16, "bfloat16", torch.float16, "float16"):
        return torch.bfloat16 if cfg_dtype in (torch.bfloat16, "bfloat16") else torch.float16
    return torch.bfloat16


def _iter_weights(src: ModelSource, cfg: ModelConfig):
    if src.is_gguf:
        return iter_gguf(src.gguf_path, cfg.num_heads, cfg.num_kv_heads)
    return iter_safetensors(src.folder)


def _count_tensors(src: ModelSource) -> int | None:
    if src.is_gguf:
        return None
    index = os.path.join(src.folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return len(json.load(f)["weight_map"])
    return None


_MTP_NAME = re.compile(r"^(mtp\.|model\.layers\.(\d+)\.)")


@dataclass
class LoadedTarget:
    model: torch.nn.Module
    config: ModelConfig
    source: ModelSource
    mtp_tensors: dict[str, torch.Tensor]  # MTP layer tensors found inside the target checkpoint


def load_target(src: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int,
                hf_config=None) -> LoadedTarget:
    hf_config = hf_config or load_hf_config(src)
    cfg = ModelConfig.from_hf(hf_config)
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, max_positions)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    _reset_buffers(model, cfg, max_positions)
    mtp: dict[str, torch.Tensor] = {}

    def target_only():
        for name, t in tqdm(_iter_weights(src, cfg), desc="Loading weights", total=_count_tensors(src),
                            unit="tensor", leave=False, disable=None):
            m = _MTP_NAME.match(name)
            if m and (m.group(2) is None or int(m.group(2)) >= cfg.num_layers):
                mtp[name] = t
                continue
            yield name, t

    loaded = model.load_weights(target_only())
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks parameters: {', '.join(missing[:8])}")
    model = model.to(device=device, dtype=dtype)
    model.tie_weights()
    _keep_float32_buffers(model)
    model.eval().requires_grad_(False)
    return LoadedTarget(model, cfg, src, mtp)


def _reset_buffers(model: torch.nn.Module, cfg: ModelConfig, max_positions: int) -> None:
    """Buffers made on the meta device hold nothing: rebuild the rotary caches for real."""
    from specserve.models.llama import make_rotary

    fresh = make_rotary(cfg, max_positions).cos_sin_cache
    for mod in model.modules():
        if hasattr(mod, "cos_sin_cache"):
            mod.cos_sin_cache = fresh


def _keep_float32_buffers(model: torch.nn.Module) -> None:
    # .to(dtype) casts buffers too; the rotary table stays float32 for accurate angles at long positions.
    from specserve.layers.rotary import RotaryEmbedding

    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.cos_sin_cache = mod.cos_sin_cache.float()


def load_mtp_draft(target: LoadedTarget, draft_path: str | None, dtype: torch.dtype, device: torch.device,
                   max_positions: int) -> MTPDraftModel:
    """The MTP drafter: from a separate draft folder when given, else from the target checkpoint's MTP layer."""
    if draft_path:
        dsrc = ModelSource.resolve(draft_path)
        if dsrc.is_gguf:
            raise ValueError("a GGUF draft checkpoint is not supported; give a folder with config.json")
        dcfg = ModelConfig.from_hf(load_hf_config(dsrc))
        tensors = dict(iter_safetensors(dsrc.folder))
        layer_index = None
        _check_draft_matches(dcfg, target.config)
    else:
        if not target.mtp_tensors:
            raise ValueError(
                f"{target.config.architecture} checkpoint has no MTP layer (num_nextn_predict_layers="
                f"{target.config.num_nextn_predict_layers}); pass --speculative-draft-model-path"
            )
        dcfg = target.config
        tensors = target.mtp_tensors
        layer_index = target.config.num_layers
    names = set(tensors)
    own_embed = any(n.endswith("embed_tokens.weight") for n in names)
    own_head = any(n.endswith("shared_head.head.weight") or n == "lm_head.weight" for n in names)
    vocab = tensors.get("draft_vocab", tensors.get("d2t_ids"))
    with torch.device("meta"):
        draft = MTPDraftModel(dcfg, max_positions, own_embed=own_embed, own_head=own_head,
                              draft_vocab_size=None if vocab is None else int(vocab.shape[0]))
    draft = draft.to_empty(device="cpu")
    _reset_buffers(draft, dcfg, max_positions)
    head_from_target = vocab is not None and not own_head
    if head_from_target:
        # A reduced vocabulary without its own head rows: the target's lm-head rows of those tokens.
        with torch.no_grad():
            rows = target.model.lm_head.weight.detach().to("cpu", torch.float32)[vocab.to(torch.int64)]
            draft.lm_head.weight.copy_(rows)
    draft.load_weights(tensors.items(), layer_index, preset={"lm_head.weight"} if head_from_target else set())
    draft = draft.to(device=device, dtype=dtype)  # integer buffers (draft_vocab) keep their dtype
    draft.share_target(target.model.embed_tokens, target.model.lm_head)
    _keep_float32_buffers(draft)
    draft.eval().requires_grad_(False)
    return draft


def _check_draft_matches(d: ModelConfig, t: ModelConfig) -> None:
    for field in ("hidden_size", "vocab_size"):
        if getattr(d, field) != getattr(t, field):
            raise ValueError(f"draft {field}={getattr(d, field)} does not match the target's {getattr(t, field)}")
