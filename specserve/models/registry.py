"""Architecture registry: HF `architectures` name -> model class."""

from __future__ import annotations

from specserve.models.llama import DenseForCausalLM

_MODEL_TYPE_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

MODEL_REGISTRY: dict[str, type] = {
    "LlamaForCausalLM": DenseForCausalLM,
    "MistralForCausalLM": DenseForCausalLM,
    "Qwen2ForCausalLM": DenseForCausalLM,
    "Qwen3ForCausalLM": DenseForCausalLM,
}


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPE_ARCH:
        return _MODEL_TYPE_ARCH[model_type]
    raise ValueError(f"cannot tell the architecture of a {model_type!r} config (no 'architectures' field)")


def model_class(arch: str) -> type:
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[arch]
