"""Write a trained head as a draft checkpoint folder (`--speculative-draft-model-path`) and the training report.

Layout (what specserve.models.loader.load_mtp_draft reads, docs/architecture.md):
  config.json        the target's HF config with num_hidden_layers = 1, num_nextn_predict_layers = 1,
                     architectures = [<target architecture> + "NextN"]
                     (+ aux_hidden_state_layer_ids: the target layers an EAGLE-3 style head reads, models/mtp.py)
  model.safetensors  model.layers.0.{enorm,hnorm,eh_proj,shared_head.norm}.weight (+ aux_fc.weight with aux
                     layers) and the block under its HF names
                     (fused qkv_proj / gate_up_proj split back into q/k/v_proj and gate/up_proj); with a reduced
                     vocabulary also draft_vocab [Vd] int64 and, when the head rows were trained,
                     model.layers.0.shared_head.head.weight [Vd, H] (else the target's rows are used).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from specserve.layers.linear import MergedLinear
from specserve.models.config import ModelConfig
from specserve.models.mtp import MTPDraftModel

PREFIX = "model.layers.0."
# our head-level module names -> DeepSeek-V3 NextN names (the inverse of the loader's mapping)
_HEAD_NAMES = {"aux_fc": "aux_fc", "enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
               "final_norm": "shared_head.norm", "lm_head": "shared_head.head", "embed_tokens": "embed_tokens"}


def draft_tensors(draft: MTPDraftModel, dtype: torch.dtype, include_head: bool = True) -> dict[str, torch.Tensor]:
    """HF-named tensors of the draft's own parameters (the target's shared embedding/lm-head are not included).
    include_head=False leaves out a reduced head that is just the target's lm-head rows of `draft_vocab`: the loader
    rebuilds it from the target."""
    modules = dict(draft.named_modules())
    out: dict[str, torch.Tensor] = {}
    for name, p in draft.named_parameters():
        if name == "lm_head.weight" and not include_head:
            continue
        mod_name, leaf = name.rsplit(".", 1)
        t = p.detach().to(device="cpu", dtype=dtype)
        head, _, rest = mod_name.partition(".")
        if head == "decoder":
            module = modules[mod_name]
            if isinstance(module, MergedLinear):
                # fused [q | k | v] or [gate | up] rows -> one tensor per HF projection (q_proj, gate_proj, ...)
                parent = mod_name.rsplit(".", 1)[0][len("decoder."):]
                for shard, (off, size) in module.shard_offsets.items():
                    out[f"{PREFIX}{parent}.{shard}_proj.{leaf}"] = t[off:off + size].contiguous()
                continue
            out[f"{PREFIX}{rest}.{leaf}"] = t.contiguous()
        elif head in _HEAD_NAMES and not rest:
            out[f"{PREFIX}{_HEAD_NAMES[head]}.{leaf}"] = t.contiguous()
        else:
            raise ValueError(f"draft parameter {name!r} has no checkpoint name")
    if draft.draft_vocab is not None:
        out["draft_vocab"] = draft.draft_vocab.detach().to(device="cpu", dtype=torch.int64).contiguous()
    return out


def draft_config(target_cfg: ModelConfig, dtype: torch.dtype, draft_vocab_size: int | None,
                 aux_layers: list[int] | None = None) -> dict:
    c = target_cfg.hf_config.to_dict()
    c["num_hidden_layers"] = 1
    c["num_nextn_predict_layers"] = 1
    c["architectures"] = [target_cfg.architecture + "NextN"]
    c["dtype"] = str(dtype).replace("torch.", "")
    c.pop("torch_dtype", None)
    if draft_vocab_size:
        c["draft_vocab_size"] = draft_vocab_size
    if aux_layers:
        c["aux_hidden_state_layer_ids"] = list(aux_layers)
    return c


def write_draft_checkpoint(draft: MTPDraftModel, target_cfg: ModelConfig, out_dir: str,
                           dtype: torch.dtype = torch.bfloat16, include_head: bool = True) -> str:
    os.makedirs(out_dir, exist_ok=True)
    vd = None if draft.draft_vocab is None else int(draft.draft_vocab.shape[0])
    save_file(draft_tensors(draft, dtype, include_head), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(draft_config(target_cfg, dtype, vd, draft.aux_layers), f, indent=2)
    return out_dir


def write_report(out_dir: str, report: dict) -> str:
    path = os.path.join(out_dir, "report.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=2)
    os.replace(path + ".tmp", path)
    return path
