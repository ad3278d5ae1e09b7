"""Load a target model (HF folder or GGUF file) and its MTP drafter onto a device, with a progress bar.

Models are built on the meta device in the target dtype and materialised on the target device; checkpoint tensors
then stream in one at a time, shard by shard, each copied (and cast) straight into its device parameter. Peak host
memory is about one shard, not the model (a 30B model in float32 on the host would need ~120 GB). Per-expert
checkpoint keys are stacked into the families' [E, ...] expert tensors as they stream (layers/moe.py).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specserve.distributed.tp import TP1, TPGroup
from specserve.layers.dsa_indexer import DSAIndexer
from specserve.layers.moe import SparseMoEBlock
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.config import ModelConfig
from specserve.models.mtp import MTPDraftModel
from specserve.models.registry import config_from_hf, model_class
from specserve.models.tensor_loading import convert_fp8_holders
from specserve.weights.fp8 import Fp8Format, fp8_format, pair_stream
from specserve.weights.gguf_loader import iter_gguf
from specserve.weights.safetensors_loader import iter_safetensors, tensor_names

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
    if cfg_dtype is not None:  # e.g. a float32 checkpoint: served in bfloat16 unless --dtype says otherwise
        logger.info("checkpoint dtype %s: serving in bfloat16 on %s (--dtype float32 keeps it)", cfg_dtype,
                    device.type)
    return torch.bfloat16


_MTP_NAME = re.compile(r"^(mtp\.|model\.layers\.(\d+)\.)")


@dataclass
class LoadedTarget:
    model: torch.nn.Module
    config: ModelConfig
    source: ModelSource
    mtp_names: list[str] = field(default_factory=list)  # MTP layer tensors inside the target checkpoint (unread)
    fp8: Fp8Format | None = None  # the checkpoint's FP8 weight format (None: not quantized)

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_names)


def _is_mtp(name: str, num_layers: int) -> bool:
    match = _MTP_NAME.match(name)
    return bool(match) and (match.group(2) is None or int(match.group(2)) >= num_layers)


def materialize(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                max_positions: int, fp8_names: list[str] | None = None,
                fp8_block: tuple[int, int] | None = None) -> torch.nn.Module:
    """A model built on the meta device -> uninitialised parameters in `dtype` on `device` (integer buffers keep
    their dtype), with the rotary tables rebuilt in float32 (accurate angles at long positions). fp8_names: the
    weights (our names) an FP8 checkpoint holds in FP8; the layers that keep them are made FP8 before anything is
    allocated (tensor_loading.convert_fp8_holders), so the bf16 size is never allocated."""
    model = model.to(dtype=dtype)
    if fp8_names:
        convert_fp8_holders(model, fp8_names, fp8_block)
    model = model.to_empty(device=device)
    keep_float32_params(model)
    fresh = model_class(cfg.architecture).make_rotary(cfg, max_positions).cos_sin_cache.to(device)
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.cos_sin_cache = fresh
    return model


def keep_float32_params(model: torch.nn.Module) -> None:
    """Parameters a family keeps in float32 whatever the model dtype, as transformers does: the grouped sigmoid
    router's gate and correction bias (rounded to bfloat16 the bias moves expert choices) and the DSA indexer's
    head weights. Replaced by uninitialised float32 parameters, before loading."""
    for block in model.modules():
        if isinstance(block, DSAIndexer):
            names = ("weights_proj.weight",)  # transformers' _keep_in_fp32_modules
        elif isinstance(block, SparseMoEBlock) and block.router == "grouped_sigmoid":
            names = block.FLOAT32_PARAMS
        else:
            continue
        for name in names:
            owner_name, _, attr = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            param = getattr(owner, attr)
            if param is not None and param.dtype != torch.float32:
                setattr(owner, attr, torch.nn.Parameter(
                    torch.empty(param.shape, dtype=torch.float32, device=param.device),
                    requires_grad=param.requires_grad))


def _stream(src: ModelSource, cfg: ModelConfig, names: set[str] | None = None, desc: str = "Loading weights"):
    if src.is_gguf:
        it, total = iter_gguf(src.gguf_path, cfg.num_heads, cfg.num_kv_heads), None
    else:
        it = iter_safetensors(src.folder, names)
        total = len(names) if names is not None else len(tensor_names(src.folder))
    return tqdm(it, desc=desc, total=total, unit="tensor", leave=False, disable=None)


def _fp8_weight_names(src: ModelSource, fp8: Fp8Format, among: set[str] | None = None) -> list[str]:
    """The checkpoint's weights that come with an FP8 scale (their names), from the safetensors headers."""
    names = tensor_names(src.folder) if among is None else among
    return [n[:-len(fp8.scale_suffix)] for n in names if n.endswith(fp8.scale_suffix)]


def _fp8_paired(tensors, fp8: Fp8Format | None, tp: TPGroup):
    """The checkpoint's tensors with each FP8 weight and its scale paired (weights/fp8.py Fp8Weight): the layers
    that compute in FP8 keep them (above one rank, their slice with its scales: layers/parallel.py), the others
    take them dequantized."""
    if fp8 is None:
        return tensors
    logger.info("FP8 checkpoint: weights kept in FP8 (blocks %s, tensor-parallel size %d)", fp8.block, tp.size)
    return pair_stream(tensors, fp8)


def load_target(src: ModelSource, dtype: torch.dtype, device: torch.device, max_positions: int,
                hf_config=None, tp: TPGroup = TP1, expert_parallel: bool = True) -> LoadedTarget:
    """tp: the tensor-parallel group this rank belongs to (its slice of each weight is loaded); expert_parallel: MoE
    experts partitioned over its ranks, else each expert split over them (ModelConfig.moe_expert_parallel)."""
    hf_config = hf_config or load_hf_config(src)
    cfg = config_from_hf(hf_config)
    cfg.tp = tp
    cfg.moe_expert_parallel = expert_parallel
    fp8 = fp8_format(hf_config)
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, max_positions)
    fp8_names = None
    if fp8 is not None:
        fp8_names = [ours for n in _fp8_weight_names(src, fp8) if not _is_mtp(n, cfg.num_layers)
                     and (ours := cls.checkpoint_name(n)) is not None]
    model = materialize(model, cfg, dtype, device, max_positions, fp8_names, fp8.block if fp8 else None)
    model.tie_weights()  # to_empty makes new Parameters per module, which unties shared ones
    mtp: list[str] = []

    def target_only():
        for name, tensor in _stream(src, cfg):
            if _is_mtp(name, cfg.num_layers):
                mtp.append(name)  # read again by load_mtp_draft, only if speculating (FP8 scales included)
                continue
            yield name, tensor

    with torch.no_grad():
        loaded = model.load_weights(_fp8_paired(target_only(), fp8, tp))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks parameters: {', '.join(missing[:8])}")
    model.eval().requires_grad_(False)
    return LoadedTarget(model, cfg, src, mtp, fp8)


def load_mtp_draft(target: LoadedTarget, draft_path: str | None, dtype: torch.dtype, device: torch.device,
                   max_positions: int, token_map: torch.Tensor | None = None) -> MTPDraftModel:
    """The MTP drafter: from a separate draft folder when given, else from the target checkpoint's MTP layer.
    token_map [Vd] int64 ascending (models/token_map.py): the only tokens it may propose (its head restricted)."""
    if draft_path:
        draft_src = ModelSource.resolve(draft_path)
        if draft_src.is_gguf:
            raise ValueError("a GGUF draft checkpoint is not supported; give a folder with config.json")
        draft_hf_config = load_hf_config(draft_src)
        draft_cfg = config_from_hf(draft_hf_config)
        fp8 = fp8_format(draft_hf_config)
        names = set(tensor_names(draft_src.folder))
        layer_index = None
        _check_draft_matches(draft_cfg, target.config)
    else:
        if not target.mtp_names:
            raise ValueError(
                f"{target.config.architecture} checkpoint has no MTP layer (num_nextn_predict_layers="
                f"{target.config.num_nextn_predict_layers}); pass --speculative-draft-model-path"
            )
        draft_src, draft_cfg, names, fp8 = target.source, target.config, set(target.mtp_names), target.fp8
        layer_index = target.config.num_layers
    own_embed = any(n.endswith("embed_tokens.weight") for n in names)
    own_head = any(n.endswith("shared_head.head.weight") or n == "lm_head.weight" for n in names)
    vocab_name = next((n for n in ("draft_vocab", "d2t_ids") if n in names), None)
    vocab = next(iter_safetensors(draft_src.folder, {vocab_name}))[1] if vocab_name else None
    # A reduced vocabulary without its own head rows is the target's lm-head rows of those tokens: restrict_vocab
    # after loading, as a --speculative-token-map is.
    head_from_target = vocab is not None and not own_head
    with torch.device("meta"):
        draft = MTPDraftModel(draft_cfg, max_positions, own_embed=own_embed, own_head=own_head,
                              draft_vocab_size=None if vocab is None or head_from_target else int(vocab.shape[0]))
    fp8_names = None
    if fp8 is not None:
        fp8_names = [ours for n in _fp8_weight_names(draft_src, fp8, names)
                     if (ours := draft.map_name(n, layer_index)) not in (None, "draft_vocab")]
    draft = materialize(draft, draft_cfg, dtype, device, max_positions, fp8_names, fp8.block if fp8 else None)
    if head_from_target:
        names = names - {vocab_name}
    with torch.no_grad():
        tensors = _stream(draft_src, draft_cfg, names, "Loading MTP weights")
        draft.load_weights(_fp8_paired(tensors, fp8, target.config.tp), layer_index)
    draft.share_target(target.model.embed_tokens, target.model.lm_head)
    if head_from_target:
        draft.restrict_vocab(vocab.to(torch.int64))
    if token_map is not None:
        draft.restrict_vocab(token_map)
    draft.eval().requires_grad_(False)
    return draft


def _check_draft_matches(draft: ModelConfig, target: ModelConfig) -> None:
    for field_name in ("hidden_size", "vocab_size"):
        if getattr(draft, field_name) != getattr(target, field_name):
            raise ValueError(f"draft {field_name}={getattr(draft, field_name)} does not match the target's "
                             f"{getattr(target, field_name)}")
