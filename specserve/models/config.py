"""The core model config: the few numbers every family and the engine need, read from a transformers config.

Each family extends it with its own fields and parsing (`<Family>Config.from_hf(hf_config, arch)`, e.g.
models/dense.py); models/registry.py config_from_hf picks the family by the checkpoint's `architectures`. Reading
goes through `require` / `optional`, so a config that lacks a field the family needs is a clear error, never an
AttributeError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.distributed.tp import TP1, TPGroup
from specserve.layers.rotary import rope_parameters


def text_config(hf_config):
    """Vision-language configs keep the language model's numbers in text_config."""
    return getattr(hf_config, "text_config", None) or hf_config


def require(cfg, name: str):
    """A config field the family cannot do without (ValueError naming it when absent)."""
    value = getattr(cfg, name, None)
    if value is None:
        arch = (getattr(cfg, "architectures", None) or [getattr(cfg, "model_type", "?")])[0]
        raise ValueError(f"the {arch} config has no {name!r}, which this model family needs")
    return value


def optional(cfg, name: str, default):
    value = getattr(cfg, name, None)
    return default if value is None else value


def eos_ids(hf_config) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


@dataclass
class ModelConfig:
    hf_config: object = field(repr=False)
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mrope_section: list[int] | None
    num_nextn_predict_layers: int
    eos_token_ids: list[int]
    # draft checkpoints only: target layers whose outputs the draft reads beside the final hidden state (EAGLE-3
    # style low/mid/high features; models/mtp.py)
    aux_hidden_layers: list[int] = field(default_factory=list)
    # rope: the fraction of each head's dims that rotate (top-level or in rope_parameters, as the config has it)
    partial_rotary_factor: float = 1.0
    # mRoPE band layout (with mrope_section): interleaved over the three position rows (Qwen3-VL / Qwen3.5), else
    # contiguous bands (Qwen2-VL). From the rope parameters' mrope_interleaved; families whose transformers code
    # interleaves whatever the config says set it themselves (models/qwen3_next.py)
    mrope_interleaved: bool = False
    # the window of the architecture's sliding-window attention, as its config turns it on (None: full attention).
    # Attention here is full attention, which equals a window's only while the whole context fits in the window,
    # so the context served is bounded by it (context_len)
    sliding_window: int | None = None
    # the tensor-parallel group the model is built for (distributed/tp.py; size 1: one device)
    tp: TPGroup = field(default=TP1, repr=False, compare=False)
    # MoE experts under tensor parallelism: partitioned over tp's ranks (--ep-size = --tp-size), or each expert
    # split over them by its intermediate features (--ep-size 1; layers/moe.py SparseMoEBlock)
    moe_expert_parallel: bool = field(default=True, repr=False, compare=False)

    @staticmethod
    def core_fields(hf_config, architecture: str) -> dict:
        """The core fields of any family's config, for its from_hf."""
        text = text_config(hf_config)
        params = rope_parameters(text)
        mrope = params.get("mrope_section")
        partial = params.get("partial_rotary_factor", optional(text, "partial_rotary_factor", 1.0))
        return dict(
            hf_config=hf_config,
            architecture=architecture,
            hidden_size=require(text, "hidden_size"),
            num_layers=require(text, "num_hidden_layers"),
            vocab_size=require(text, "vocab_size"),
            rms_norm_eps=optional(text, "rms_norm_eps", 1e-6),
            max_position_embeddings=optional(text, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            mrope_section=list(mrope) if mrope else None,
            num_nextn_predict_layers=int(optional(text, "num_nextn_predict_layers", 0)),
            eos_token_ids=eos_ids(hf_config),
            aux_hidden_layers=[int(i) for i in getattr(hf_config, "aux_hidden_state_layer_ids", None) or []],
            partial_rotary_factor=float(partial),
            mrope_interleaved=bool(mrope) and bool(params.get("mrope_interleaved", False)),
        )

    def context_len(self, asked: int | None) -> int:
        """The context length to serve: `asked` (--context-length), else max_position_embeddings; with a sliding
        window, at most the window (ValueError when `asked` exceeds it: our full attention would attend to tokens
        the window hides)."""
        window = self.sliding_window
        if window is None:
            return asked or self.max_position_embeddings
        if asked is not None and asked > window:
            raise ValueError(f"--context-length {asked} exceeds the {self.architecture} config's sliding_window="
                             f"{window}: attention here is full attention, which equals sliding-window attention "
                             f"only while the context fits in the window; pass --context-length {window} or less")
        return asked or min(self.max_position_embeddings, window)
