"""The dense family's architectures: what each one's transformers implementation fixes about the block (q/k/v
biases, q/k norms, which config field turns a sliding window on), as a table keyed by the registry's names."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.models.config import optional

# transformers' names of the SiLU its gated MLPs use (ACT2FN maps both to SiLU)
SILU = ("silu", "swish")


@dataclass(frozen=True)
class DenseArch:
    """What an architecture's transformers implementation fixes about the dense block, beside its config's fields."""

    # q/k/v biases and no o_proj bias whatever the config says (Qwen2); None: the config's attention_bias covers
    # q, k, v and o together
    qkv_bias: bool | None = None
    qk_norm: bool = False  # per-head q/k RMSNorm always (Qwen3); otherwise only when the config sets qk_norm
    # the config field that turns its sliding_window on: "sliding_window" (on whenever set: Mistral),
    # "use_sliding_window" (Qwen); None: the architecture has no sliding window (full attention)
    window_switch: str | None = None


def with_drafts(archs: dict[str, DenseArch]) -> dict[str, DenseArch]:
    """archs plus their MTP draft checkpoints' names ("<Arch>NextN", models/registry.py): the same block."""
    return {**archs, **{f"{name}NextN": arch for name, arch in archs.items()}}


# every architecture of the dense family (models/registry.py), its drafts included
DENSE_ARCHITECTURES: dict[str, DenseArch] = with_drafts({
    "LlamaForCausalLM": DenseArch(),
    "MistralForCausalLM": DenseArch(window_switch="sliding_window"),
    "Qwen2ForCausalLM": DenseArch(qkv_bias=True, window_switch="use_sliding_window"),
    "Qwen3ForCausalLM": DenseArch(qk_norm=True, window_switch="use_sliding_window"),
})


def sliding_window(text, arch: DenseArch) -> int | None:
    """The window of an architecture's sliding-window attention as the config sets it; None: full attention."""
    if arch.window_switch is None:
        return None
    if arch.window_switch == "use_sliding_window" and not optional(text, "use_sliding_window", False):
        return None
    window = optional(text, "sliding_window", None)
    return None if window is None else int(window)
