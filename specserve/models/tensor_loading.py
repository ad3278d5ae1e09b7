"""One checkpoint tensor -> our parameter: the mapping every family's `load_tensor` starts from (models/base.py).

Our parameter names are the HF checkpoint's, except where we fuse projections: q/k/v into `qkv_proj` and
gate/up into `gate_up_proj` (each checkpoint tensor is copied into its slice), and an MoE block's per-expert
tensors, which the block stacks into its [E, ...] tensors as they stream in (layers/moe.py). Under tensor
parallelism each layer keeps its rank's slice (layers/parallel.py `load_full` / `load_shard`), of an FP8 weight
too (with its scales) where the slice falls on the scale blocks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from specserve.layers.linear import Linear, MergedLinear
from specserve.layers.moe import FusedMoE, SparseMoEBlock
from specserve.weights.fp8 import Fp8Weight

# checkpoint projection -> (our fused projection, its shard)
_SHARDS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}
_MLP = ".mlp."
logger = logging.getLogger(__name__)


def load_checkpoint_tensor(root: nn.Module, params: dict[str, nn.Parameter], name: str,
                           tensor: torch.Tensor) -> str | None:
    """Copy one HF-named tensor into root's parameters; returns our parameter's name (None: no match). An MoE
    block's tensors go to the block (a name it reports once the parameter is complete: finish_loading); fused
    projections take theirs into their slice; any other tensor goes to the parameter of its name."""
    offset = name.find(_MLP)
    if offset >= 0:
        prefix = name[:offset + len(_MLP) - 1]  # "model.layers.3.mlp" (or "decoder.mlp" in an MTP layer)
        try:
            block = root.get_submodule(prefix)
        except AttributeError:  # no such module: the name matches no parameter (reported by the caller)
            block = None
        if isinstance(block, SparseMoEBlock):
            return name if block.load_weight(name[offset + len(_MLP):], tensor) else None
    return load_fused_or_param(root, params, name, tensor)


def load_fp8_or_plain(root: nn.Module, name: str, tensor: torch.Tensor | Fp8Weight
                      ) -> tuple[str | None, torch.Tensor | None]:
    """(our parameter's name, None) when `tensor` is an FP8 weight now loaded in FP8 (load_fp8_weight); else
    (None, the tensor to load as usual: an FP8 weight dequantized to float32, or the tensor as it came). A plain
    weight for a linear layer made FP8 before allocation (a checkpoint whose scale list said otherwise) turns the
    layer back to plain values first, so it is never cast into FP8 without scales."""
    if not isinstance(tensor, Fp8Weight):
        module = fp8_holder(root, name)
        if isinstance(module, Linear) and not isinstance(module, MergedLinear) and module.is_fp8 \
                and name.endswith(".weight"):
            module.to_plain()
        return None, tensor
    target = load_fp8_weight(root, name, tensor)
    return (target, None) if target is not None else (None, tensor.dequantize(torch.float32))


def fp8_holder(root: nn.Module, name: str) -> nn.Module | None:
    """The module that holds the weight `name` (ours, HF-style) when it is kept in FP8: a Linear (a fused
    projection for a q/k/v or gate/up part) or an MoE block's expert stack / shared-expert projection; None for
    names no FP8 layer holds."""
    moe = _moe_block(root, name)
    if moe is not None:
        return moe[0].fp8_module(moe[1])
    module, _, _ = _weight_module(root, name)
    return module if isinstance(module, (Linear, FusedMoE)) else None


def _moe_block(root: nn.Module, name: str) -> tuple[SparseMoEBlock, str] | None:
    """(the MoE block, the name inside its mlp) for a weight under a sparse MoE block's `mlp.`; else None."""
    offset = name.find(_MLP)
    if offset >= 0:
        block = _submodule(root, name[:offset + len(_MLP) - 1])
        if isinstance(block, SparseMoEBlock):
            return block, name[offset + len(_MLP):]
    return None


def _weight_module(root: nn.Module, name: str) -> tuple[nn.Module | None, str, str | None]:
    """(module, its name, part) for a `….weight` name: the module it names, or for a q/k/v or gate/up part the
    fused projection holding it with the part's name; (None, "", None) where neither exists."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return None, "", None
    module_name = ".".join(parts[:-1])
    module = _submodule(root, module_name)
    if module is not None or parts[-2] not in _SHARDS:
        return module, module_name, None
    fused, shard = _SHARDS[parts[-2]]
    module_name = ".".join(parts[:-2] + [fused])
    return _submodule(root, module_name), module_name, shard


def convert_fp8_holders(root: nn.Module, names, block: tuple[int, int] | None) -> int:
    """Before the weights are allocated (root on the meta device): the modules that will hold the FP8 weights
    `names` (ours) made FP8 now, so an FP8 checkpoint never takes its bf16 size on the device, even for a moment.
    Modules that cannot hold them (accepts_fp8) stay as they are and get the weights dequantized; one log line
    names those whose blocks do not fall on their parts or tensor-parallel slice. Returns how many modules were
    converted."""
    done, misaligned = set(), {}
    for name in names:
        module = fp8_holder(root, name)
        if module is None or id(module) in done or module.is_fp8:
            continue
        if module.accepts_fp8(block):
            module.to_fp8(block)
            done.add(id(module))
        elif module.fp8_capable and not module.fp8_blocks_fit(block):
            misaligned.setdefault(id(module), name)
    if misaligned:
        logger.info("FP8 checkpoint: %d layer(s) whose parts or tensor-parallel slices do not fall on the %s scale "
                    "blocks take their weights dequantized (e.g. %s)", len(misaligned), block,
                    next(iter(misaligned.values())))
    return len(done)


def load_fp8_weight(root: nn.Module, name: str, w: Fp8Weight) -> str | None:
    """Keep a checkpoint's FP8 weight in FP8 where the layer it names computes in FP8 (a Linear, a q/k/v or gate/up
    part of a fused one, an MoE block's experts and shared expert; under tensor parallelism this rank's slice of
    it); returns our parameter's name, or None: the caller loads it dequantized like a plain tensor (any other
    parameter, a slice off the scale blocks)."""
    moe = _moe_block(root, name)
    if moe is not None:
        return name if moe[0].load_fp8_weight(moe[1], w) else None
    module, module_name, shard = _weight_module(root, name)
    if not isinstance(module, Linear):
        return None
    if shard is None:
        if not module.keep_fp8(w):
            return None
    elif isinstance(module, MergedLinear) and module.accepts_fp8(w.block):
        module.load_shard(shard, w)  # this part (this rank's rows of it) in FP8, or dequantized by the layer
    else:
        return None
    return f"{module_name}.weight"


def _submodule(root: nn.Module, name: str) -> nn.Module | None:
    try:
        return root.get_submodule(name)
    except AttributeError:
        return None


def finish_loading(root: nn.Module, loaded: set[str]) -> set[str]:
    """The parameters of root that are now completely loaded, of the names load_checkpoint_tensor returned: an
    MoE block's names are replaced by its parameters whose every piece was written."""
    blocks = {prefix: m for prefix, m in root.named_modules() if isinstance(m, SparseMoEBlock)}
    if not blocks:
        return loaded
    out = {n for n in loaded if not any(n.startswith(prefix + ".") for prefix in blocks)}
    for prefix, block in blocks.items():
        out |= {f"{prefix}.{n}" for n in block.loaded_param_names()}
    return out


def load_fused_or_param(root: nn.Module, params: dict[str, nn.Parameter], name: str,
                        tensor: torch.Tensor) -> str | None:
    """Copy one HF-named tensor into `root`'s parameters, a q/k/v or gate/up projection into its slice of the fused
    projection; returns our parameter's name."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _SHARDS:
        fused, shard = _SHARDS[parts[-2]]
        module_name = ".".join(parts[:-2] + [fused])
        module = root.get_submodule(module_name)
        module.load_shard(shard, tensor, is_bias=parts[-1] == "bias")
        return f"{module_name}.{parts[-1]}"
    return load_param(root, params, name, tensor)


def load_param(root: nn.Module, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """copy_param, except that a tensor-parallel layer (layers/parallel.py) keeps only its rank's slice."""
    parts = name.split(".")
    if len(parts) >= 2 and name in params:
        module = root.get_submodule(".".join(parts[:-1]))
        if hasattr(module, "load_full"):
            module.load_full(tensor, is_bias=parts[-1] == "bias")
            return name
    return copy_param(params, name, tensor)


def copy_param(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """Copy a tensor into the parameter of the same name (shape checked); None when there is none."""
    if name not in params:
        return None
    param = params[name]
    if isinstance(tensor, Fp8Weight):
        tensor = tensor.dequantize(param.dtype, param.device)
    if param.shape != tensor.shape:
        raise ValueError(f"{name}: parameter shape {tuple(param.shape)} != checkpoint shape {tuple(tensor.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return name
