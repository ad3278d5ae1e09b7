"""ModelConfig: the few numbers the engine needs, read from a transformers config object."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.layers.rotary import rope_parameters


@dataclass
class ModelConfig:
    hf_config: object = field(repr=False)
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mrope_section: list[int] | None
    num_nextn_predict_layers: int
    eos_token_ids: list[int]
    # draft checkpoints only: target layers whose outputs the draft reads beside the final hidden state (EAGLE-3
    # style low/mid/high features; models/mtp.py)
    aux_hidden_layers: list[int] = field(default_factory=list)

    @staticmethod
    def from_hf(hf_config) -> ModelConfig:
        from specserve.models.registry import architecture_of

        arch = architecture_of(hf_config)
        # Vision-language configs keep the language model's numbers in text_config.
        text = getattr(hf_config, "text_config", None) or hf_config
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        params = rope_parameters(text)
        mrope = params.get("mrope_section")
        if arch.startswith("Qwen3") and "Moe" not in arch:
            qk_norm = True
        else:
            qk_norm = bool(getattr(text, "qk_norm", False))
        # Qwen2 has q/k/v biases and no o_proj bias; Llama/Qwen3's attention_bias covers all four projections.
        attn_bias = bool(getattr(text, "attention_bias", False))
        qkv_bias = True if arch.startswith("Qwen2") else attn_bias
        o_bias = False if arch.startswith("Qwen2") else attn_bias
        if getattr(text, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported")
        eos = getattr(hf_config, "eos_token_id", None)
        if eos is None:
            eos_ids = []
        elif isinstance(eos, int):
            eos_ids = [eos]
        else:
            eos_ids = list(eos)
        return ModelConfig(
            hf_config=hf_config,
            architecture=arch,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=text.intermediate_size,
            vocab_size=text.vocab_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            mrope_section=list(mrope) if mrope else None,
            num_nextn_predict_layers=int(getattr(text, "num_nextn_predict_layers", 0) or 0),
            eos_token_ids=eos_ids,
            aux_hidden_layers=[int(i) for i in getattr(hf_config, "aux_hidden_state_layer_ids", None) or []],
        )
