"""Quantisation applied to a loaded model: weight-only int8 for a drafter on CPU
(`--speculative-draft-model-quantization int8`) and online FP8 (`--quantization fp8`, or SGLang's
`--model-loader-extra-config` online_quant_config "ptpc_fp8").

int8: a CPU decode step streams every weight from DRAM, so a draft forward costs its weight bytes; a per-row int8
copy (layers/cpu_linear.py Int8Weight) stores a quarter of float32's. Only draft tokens change, and only a little:
verification keeps the output exactly the target's.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass

import torch
from torch import nn

from specserve.layers.cpu_linear import Int8Weight
from specserve.layers.embedding import LMHead
from specserve.layers.linear import Linear, MergedLinear
from specserve.layers.moe import FusedMoE


def quantize_weights_int8(model: nn.Module) -> int:
    """Give every linear layer and LM head of `model` (its own modules: not the target's embedding or head that a
    draft shares) a weight-only int8 copy, used on CPU. Returns how many layers now have one."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear | LMHead):
            module.int8 = Int8Weight()
            count += 1
    return count


def quantize_draft(draft: nn.Module, quantization: str | None, device: torch.device) -> None:
    """Apply --speculative-draft-model-quantization to a loaded draft ("int8": CPU only; None/"none": nothing)."""
    if quantization != "int8":
        return
    if device.type != "cpu":
        raise ValueError("--speculative-draft-model-quantization int8 is implemented for CPU serving only")
    quantize_weights_int8(draft)


# ---------------------------------------------------------------- online FP8 (--quantization fp8)
ONLINE_QUANT_SCHEMES = ("ptpc_fp8",)  # SGLang's name: per-token activations, per-channel weights, FP8
# Kept in the model dtype whatever the exclusions: a gated delta net's decay and beta gate rows (its in_proj_ba /
# in_proj_b / in_proj_a, fused into its one input projection here, which stays whole). Their error compounds through
# the recurrent state; quantised, a tiny Qwen3-Next's next token changed at a third of the prompt positions where
# the float model led by more than a nat (tests/test_fp8_model.py), and public FP8 recipes exclude them too.
ALWAYS_EXCLUDED = ("*.linear_attn.in_proj_ba", "*.linear_attn.in_proj_b", "*.linear_attn.in_proj_a")


@dataclass(frozen=True)
class OnlineFp8:
    """Online FP8 of a bf16/fp16 checkpoint: every linear layer that computes through its forward (under
    tensor parallelism each rank's slice) quantised at load, one scale per output row (the input per token at each
    call), and the routed experts in 128 x 128 blocks (the fused MoE kernel's FP8 form, the input per token per 128
    columns), except the modules whose name matches one of `exclude` (fnmatch globs over our module names and, for
    a fused projection, its checkpoint parts' names: `model.layers.3.self_attn.q_proj` names the fused qkv_proj;
    the experts are `model.layers.3.mlp.experts`). Embeddings and the lm-head are not linear layers here and stay
    in the model dtype."""

    exclude: tuple[str, ...] = ()

    @staticmethod
    def from_flags(quantization: str | None, loader_extra_config: str | None) -> OnlineFp8 | None:
        """--quantization and --model-loader-extra-config (SGLang's JSON: {"online_quant_config":
        {"global_quant_config": "ptpc_fp8", "exclude_layer": [globs]}}) -> the online FP8 asked for, or None.
        ValueError for anything else."""
        if quantization not in (None, "fp8"):
            raise ValueError(f"--quantization {quantization!r} is not supported (fp8 is)")
        config = json.loads(loader_extra_config) if loader_extra_config and loader_extra_config.strip() else {}
        if not isinstance(config, dict):
            raise ValueError("--model-loader-extra-config must be a JSON object")
        unknown = sorted(set(config) - {"online_quant_config"})
        if unknown:
            raise ValueError(f"--model-loader-extra-config: unsupported keys {unknown} (online_quant_config is)")
        online = config.get("online_quant_config")
        if online is None:
            return OnlineFp8() if quantization == "fp8" else None
        if not isinstance(online, dict):
            raise ValueError("online_quant_config must be a JSON object")
        unknown = sorted(set(online) - {"global_quant_config", "exclude_layer"})
        if unknown:
            raise ValueError(f"online_quant_config: unsupported keys {unknown} (global_quant_config and "
                             "exclude_layer are)")
        scheme = online.get("global_quant_config")
        if scheme not in ONLINE_QUANT_SCHEMES:
            raise ValueError(f"online_quant_config.global_quant_config {scheme!r} is not supported "
                             f"({', '.join(ONLINE_QUANT_SCHEMES)} is)")
        exclude = online.get("exclude_layer", [])
        if not isinstance(exclude, list) or not all(isinstance(g, str) and g for g in exclude):
            raise ValueError("online_quant_config.exclude_layer must be a list of non-empty strings (globs)")
        return OnlineFp8(tuple(exclude))

    def excluded(self, name: str, module: nn.Module) -> bool:
        names = [name]
        if isinstance(module, MergedLinear):  # a fused projection also answers to its checkpoint parts' names
            prefix = name.rpartition(".")[0]
            names += [f"{prefix}.{part}" if prefix else part for part in module.part_names]
        return any(fnmatch.fnmatchcase(n, g) for n in names for g in self.exclude + ALWAYS_EXCLUDED)


def quantize_fp8_online(model: nn.Module, config: OnlineFp8, linear_block: tuple[int, int] | None = None) -> int:
    """Apply online FP8 to a loaded model (or draft): each eligible linear layer's weight replaced by FP8 values and
    per-row scales (linear_block: scales per block of that shape instead, as block-scaled checkpoints hold them;
    scripts/gpu/bench_fp8_decode.py times both), one layer at a time (the bf16 copy of that layer freed as it goes).
    Returns how many."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not config.excluded(name, module):
            # 128 x 128 blocks, as block-scaled FP8 checkpoints: finer scales (weights and activations) than the
            # per-channel form the fused MoE kernel also runs, which is not measured faster (bench_moe.py --fp8
            # [--per-channel] compares them on a GPU)
            count += module.quantize_fp8()
        elif (isinstance(module, Linear) and module.fp8_capable and not module.is_fp8
                and not config.excluded(name, module)):
            module.quantize_fp8(linear_block)
            count += 1
    return count
