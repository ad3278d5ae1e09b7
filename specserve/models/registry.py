"""Architecture registry: HF `architectures` name -> the family's model class, imported only when asked for, and
the config parsed by that family (config_from_hf).

One family per file, the classes named after it: models/<family>.py holds <Family>Config and <Family>ForCausalLM
(dense.py: DenseConfig, DenseForCausalLM; qwen3_next.py: Qwen3NextConfig, Qwen3NextForCausalLM). A draft
checkpoint names its target's architecture with a "NextN" suffix (e.g. "LlamaForCausalLMNextN"); its family is the
target's.
"""

from __future__ import annotations

import importlib

from specserve.models.config import ModelConfig

_MODEL_TYPE_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}

# architecture -> (module, class): one entry per family member; the module is imported on first use
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("specserve.models.dense", "DenseForCausalLM"),
    "MistralForCausalLM": ("specserve.models.dense", "DenseForCausalLM"),
    "Qwen2ForCausalLM": ("specserve.models.dense", "DenseForCausalLM"),
    "Qwen3ForCausalLM": ("specserve.models.dense", "DenseForCausalLM"),
    "Qwen3MoeForCausalLM": ("specserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    # multi-head latent attention + MoE
    "DeepseekV3ForCausalLM": ("specserve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    # + DeepSeek sparse attention (the DSA indexer)
    "DeepseekV32ForCausalLM": ("specserve.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("specserve.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    # hybrid linear attention (gated delta net + gated attention); the vision-language ones as text only
    "Qwen3NextForCausalLM": ("specserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("specserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("specserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("specserve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("specserve.models.qwen3_next", "Qwen3NextForCausalLM"),
}

_DRAFT_SUFFIX = "NextN"


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPE_ARCH:
        return _MODEL_TYPE_ARCH[model_type]
    raise ValueError(f"cannot tell the architecture of a {model_type!r} config (no 'architectures' field)")


def model_class(arch: str) -> type:
    """The model class of an architecture (a draft's "<Arch>NextN" gives <Arch>'s family)."""
    family = arch.removesuffix(_DRAFT_SUFFIX)
    if family not in MODEL_REGISTRY:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    module, name = MODEL_REGISTRY[family]
    return getattr(importlib.import_module(module), name)


def config_from_hf(hf_config) -> ModelConfig:
    """The config of the checkpoint's family (by its architecture), parsed by that family's config class."""
    arch = architecture_of(hf_config)
    return model_class(arch).config_class.from_hf(hf_config, arch)
