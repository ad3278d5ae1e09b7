"""From resolved server args to a ready model runner: the device, the target and draft models (this rank's slice under
tensor parallelism), and the model runner with its graphs captured. Shared by the engine (engine/engine.py) and the
tensor-parallel follower ranks (engine/tp_ranks.py), which build their model runner alike."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.defaults import embedded_draft_path, embedded_model_path
from specserve.distributed.tp import TP1, TPGroup
from specserve.engine.model_runner import ModelRunner
from specserve.layers.quant import OnlineFp8, quantize_draft, quantize_fp8_online
from specserve.models.loader import (
    LoadedTarget,
    ModelSource,
    load_hf_config,
    load_mtp_draft,
    load_target,
    resolve_dtype,
)
from specserve.models.registry import config_from_hf
from specserve.models.token_map import load_token_map
from specserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


@dataclass
class LoadedModels:
    src: ModelSource
    target: LoadedTarget
    draft: torch.nn.Module | None
    dtype: torch.dtype
    context_len: int


def load_models(args: ServerArgs, device: torch.device, tp: TPGroup = TP1) -> LoadedModels:
    """The target (and draft, when speculating) of resolved args, this rank's slice under tensor parallelism."""
    model_path = args.model_path or embedded_model_path()
    draft_path = args.speculative_draft_model_path
    if args.spec_enabled and draft_path is None and args.model_path is None:
        draft_path = embedded_draft_path()
        if draft_path is None:
            raise ValueError("this build ships no MTP head for the embedded model; pass "
                             "--speculative-draft-model-path")
    src = ModelSource.resolve(model_path)
    hf_config = load_hf_config(src)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    model_cfg = config_from_hf(hf_config)
    context_len = model_cfg.context_len(args.context_length)  # within a sliding window
    max_positions = max(context_len, model_cfg.max_position_embeddings) + args.num_draft_steps + 2
    # a bad token map fails here, before any weight loads
    token_map = load_token_map(args.speculative_token_map, model_cfg.vocab_size) if args.speculative_token_map else None
    torch.manual_seed(args.random_seed)
    target = load_target(src, dtype, device, max_positions, hf_config, tp=tp,
                         expert_parallel=args.moe_expert_parallel)
    draft = None
    if args.spec_enabled:
        draft = load_mtp_draft(target, draft_path, dtype, device, max_positions, token_map)
    online = OnlineFp8.from_flags(args.quantization, args.model_loader_extra_config)
    if online is not None and target.fp8 is None:  # (an FP8 checkpoint is served in its own FP8)
        n = sum(quantize_fp8_online(m, online) for m in (target.model, draft) if m is not None)
        logger.info("online FP8: %d linear layers quantised (a scale per output row)", n)
    if draft is not None:
        quantize_draft(draft, args.speculative_draft_model_quantization, device)
    return LoadedModels(src, target, draft, dtype, context_len)


def build_model_runner(args: ServerArgs, device: torch.device, tp: TPGroup = TP1) -> ModelRunner:
    """Models, pools and captured graphs of resolved args (a tensor-parallel follower rank's whole engine)."""
    models = load_models(args, device, tp)
    model_runner = ModelRunner(args, models.target.model, models.target.config, models.draft, device, models.dtype,
                               models.context_len)
    model_runner.capture_graphs()
    return model_runner
