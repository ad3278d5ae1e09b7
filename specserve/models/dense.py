"""Dense decoder family: Llama (and SmolLM), Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

One implementation with three switches, set per architecture (DENSE_ARCHITECTURES) and by the config; the HF
`transformers` implementations are the oracle in tests. Parameter layout: fused qkv_proj and gate_up_proj (fewer,
larger GEMMs on the GPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specserve.batch import ForwardBatch, ForwardMode
from specserve.kernels import ops
from specserve.kernels.gemv_policy import FASTER_NORM_PREP, FASTER_PREP, fused_rows, prefer_fused
from specserve.kernels.rope_store import RopeStore
from specserve.kvcache.cache_spec import CacheSpec, MHACacheSpec
from specserve.layers.activation import silu_and_mul
from specserve.layers.attention import STORED, PagedAttention, QKPrep
from specserve.layers.embedding import LMHead, VocabEmbedding
from specserve.layers.linear import Linear, MergedLinear
from specserve.layers.moe import SparseMoEBlock
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from specserve.layers.rotary import RotaryEmbedding, inv_freq_from_config
from specserve.models.config import ModelConfig, optional, require, text_config
from specserve.models.dense_arch import DENSE_ARCHITECTURES, SILU, DenseArch, sliding_window

_FEATURE_MODES = (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)
@dataclass
class DenseConfig(ModelConfig):
    """The dense family's config: the core fields plus its attention and MLP shapes and switches."""

    # the architectures this config class parses (a family built on this one has its own table)
    arch_features: ClassVar[dict[str, DenseArch]] = DENSE_ARCHITECTURES

    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def dense_fields(cls, hf_config, arch: str) -> dict:
        if arch not in cls.arch_features:
            raise ValueError(f"{cls.__name__} does not parse architecture {arch!r}; it parses: "
                             f"{', '.join(sorted(cls.arch_features))}")
        features = cls.arch_features[arch]
        text = text_config(hf_config)
        num_heads = require(text, "num_attention_heads")
        if getattr(text, "mlp_bias", False):
            raise ValueError("mlp_bias=True checkpoints are not supported")
        act = optional(text, "hidden_act", "silu")
        if act not in SILU:
            raise ValueError(f"{arch}: hidden_act={act!r} is not supported (silu only)")
        attn_bias = bool(getattr(text, "attention_bias", False))
        qkv_bias = features.qkv_bias
        return dict(
            num_heads=num_heads,
            num_kv_heads=optional(text, "num_key_value_heads", num_heads),
            head_dim=optional(text, "head_dim", require(text, "hidden_size") // num_heads),
            intermediate_size=require(text, "intermediate_size"),
            qkv_bias=attn_bias if qkv_bias is None else qkv_bias,
            o_bias=attn_bias if qkv_bias is None else False,
            qk_norm=features.qk_norm or bool(getattr(text, "qk_norm", False)),
            sliding_window=sliding_window(text, features),
        )

    @classmethod
    def from_hf(cls, hf_config, arch: str) -> DenseConfig:
        cfg = cls(**ModelConfig.core_fields(hf_config, arch), **cls.dense_fields(hf_config, arch))
        if cfg.partial_rotary_factor != 1.0:
            raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor} is not supported by the dense "
                             "family (every head dim rotates)")
        return cfg


def make_rotary(cfg: DenseConfig, max_positions: int) -> RotaryEmbedding:
    inv_freq, scale = inv_freq_from_config(text_config(cfg.hf_config), cfg.head_dim)
    return RotaryEmbedding(cfg.head_dim, max_positions, inv_freq, scale, cfg.mrope_section)


class DenseAttention(nn.Module):
    def __init__(self, cfg: DenseConfig, layer_id: int, rotary: RotaryEmbedding):
        """Under tensor parallelism (cfg.tp.size > 1) this rank keeps its query heads and its KV heads (replicated
        when there are fewer KV heads than ranks); o_proj sums the ranks' partial outputs."""
        super().__init__()
        tp, d = cfg.tp, cfg.head_dim
        self.head_dim = d
        if tp.size == 1:
            self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
            self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d,
                                                           "v": cfg.num_kv_heads * d}, bias=cfg.qkv_bias)
            self.o_proj = Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        else:
            self.num_heads = tp.split(cfg.num_heads, "attention heads")
            self.qkv_proj = MergedColumnParallelLinear(
                cfg.hidden_size, {"q": (cfg.num_heads * d, d), "k": (cfg.num_kv_heads * d, d),
                                  "v": (cfg.num_kv_heads * d, d)}, tp, bias=cfg.qkv_bias)
            self.num_kv_heads = self.qkv_proj.shard_offsets["k"][1] // d
            self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp, bias=cfg.o_bias)
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary  # shared module (not a parameter owner)
        # every layer of a dense model keeps K/V, so its MHA cache index is its layer number
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   cache_index=layer_id)

    def cache_spec(self) -> MHACacheSpec:
        return MHACacheSpec(self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(h), fb)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """qkv [T, q + 2kv] (the projection's output) -> the attention block's output [T, hidden]."""
        q, k, v = self._heads(qkv)
        # per-head norms (Qwen3) and rotary on the [T, heads, D] views of the projection, fused with the K/V store
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.o_proj(self.attn(q, k, v, fb, QKPrep(self.rotary, positions, *norms)))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The [T, heads, D] views of q, k, v in the projection's output qkv [T, q + 2kv]."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.reshape(t, self.num_heads, self.head_dim), k.reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))

    def prep_fusable(self) -> bool:
        """Whether the q/k prep can run in the epilogue of the qkv projection's fused GEMV: rotary on all of D with
        1-D positions, one device (q/k norms or not)."""
        return (type(self.qkv_proj) is MergedLinear and self.rotary.mrope_section is None
                and self.rotary.cos_sin_cache.shape[1] == self.head_dim)

    def attend_from_norm(self, norm: RMSNorm, h: torch.Tensor, residual: torch.Tensor | None,
                         positions: torch.Tensor, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the attention block's output [T, hidden], the new residual) with the input norm, the qkv projection,
        the q/k norms (Qwen3), rotary and the K/V store in one op (kernels/ops.py norm_gemv_rope_store;
        prep_fusable layers: 1-D positions); None when that op's launch cannot take this step: the caller runs the
        unfused path."""
        norms = {}
        if self.qk_norm:
            norms = dict(q_norm_w=self.q_norm.weight, k_norm_w=self.k_norm.weight, eps=self.q_norm.eps,
                         weight_offset=self.q_norm.weight_offset)
        rope = RopeStore(self.rotary.cos_sin_cache, positions, fb.out_cache_loc, *self.attn.kv_caches(fb),
                         self.num_heads, self.num_kv_heads, self.head_dim, **norms)
        out = ops.norm_gemv_rope_store(h, residual, norm.weight, norm.eps, norm.weight_offset, self.qkv_proj.weight,
                                       self.qkv_proj.bias, rope)
        if out is None:
            return None
        qkv, residual = out
        q, k, v = self._heads(qkv)
        return self.o_proj(self.attn(q, k, v, fb, STORED)), residual


class DenseMLP(nn.Module):
    def __init__(self, cfg: DenseConfig):
        """Under tensor parallelism each rank keeps a slice of the intermediate features."""
        super().__init__()
        tp, inter = cfg.tp, cfg.intermediate_size
        if tp.size == 1:
            self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": inter, "up": inter})
            self.down_proj = Linear(inter, cfg.hidden_size)
        else:
            self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, {"gate": (inter, 1), "up": (inter, 1)},
                                                           tp)
            self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(h)))


class PreNormDecoderLayer(nn.Module):
    """The pre-norm block every family shares: input_layernorm, the token mixer (`mix`: attention of the family's
    kind, or linear attention), post_attention_layernorm, mlp; the residual carried separately so add + norm fuse.
    Subclasses set the four modules and `mix`."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    # decode rows with the input norm fused into the mixer's input projection / the post-attention norm into a
    # dense MLP's gate/up (set_decode_gemv)
    fused_in = False
    fused_mlp = False
    fused_moe = False  # the post-attention norm inside an MoE block's router launch (layers/moe.py)
    fused_rows = 0  # the most rows a call fuses at ('auto': gemv_policy.fused_rows of the fused shapes)
    fused_prep = False  # with fused_in: the mixer's q/k prep in its input projection's epilogue (mix_from_norm)

    def mix(self, positions: torch.Tensor, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def mixer_projections(self) -> tuple[nn.Module, nn.Module] | None:
        """The token mixer's input and output projections, when it can run from its input projection's output
        (mix_projected); None: it cannot, and its decode rows stay unfused."""
        return None

    def mix_projected(self, positions: torch.Tensor, proj: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """mix, given the input projection's output proj [T, rows of mixer_projections()[0]]."""
        raise NotImplementedError

    def prep_fusable(self) -> bool:
        """Whether the mixer can take its input norm, input projection and q/k prep as one op (mix_from_norm)."""
        return False

    def prep_normed(self) -> bool:
        """Whether the mixer's fusable q/k prep has per-head q/k norms (a different epilogue, measured apart)."""
        return False

    def mix_from_norm(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                      fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mix of the input norm of h + residual, the new residual) with the norm, the input projection and the
        q/k prep in one op (prep_fusable mixers); None when that op cannot take this step."""
        return None

    def set_decode_gemv(self, mode: str) -> bool:
        """--decode-gemv: 'triton' runs this layer's decode rows through the fused GEMVs (kernels/triton_gemv.py:
        input norm + the mixer's input projection, its output projection, and for a dense SiLU-gated MLP the
        post-attention norm + gate/up + SiLU-mul and the down projection; for an MoE block with a softmax router
        the post-attention norm inside the router's launch), 'auto' each of those where its weight shape is
        measured faster (kernels/gemv_policy.py: at one row, and at verify's rows where FASTER_ROWS lists every
        fused shape of the layer; other rows stay on cuBLAS), 'cublas' none.
        Tensor-parallel projections keep the unfused path. Returns whether any part of the layer fuses."""
        projs = self.mixer_projections()
        if projs is None or type(projs[0]) is not MergedLinear or type(projs[1]) is not Linear:
            projs = None
        gate_up, down = _dense_mlp(self.mlp)

        def use(linear) -> bool:
            return linear is not None and (mode == "triton" or (mode == "auto"
                                                                and prefer_fused([tuple(linear.weight.shape)])))

        self.fused_in = bool(projs) and use(projs[0])
        # the q/k prep in the qkv GEMV's epilogue: under 'auto' only for weight shapes measured faster with it
        self.fused_prep = self.fused_in and self.prep_fusable() and (
            mode == "triton" or prefer_fused([tuple(projs[0].weight.shape)],
                                             FASTER_NORM_PREP if self.prep_normed() else FASTER_PREP))
        self.fused_mlp = use(gate_up)
        self.fused_moe = isinstance(self.mlp, SparseMoEBlock) and self.mlp.norm_fusable and use(self.mlp.gate)
        outputs = [lin for lin in (projs[1] if projs else None, down) if lin is not None]
        fused_in = [lin for lin, on in [(projs[0] if projs else None, self.fused_in), (gate_up, self.fused_mlp),
                                        (self.mlp.gate if self.fused_moe else None, self.fused_moe)] if on]

        def rows(lins) -> int:  # 'auto': up to the rows at which every shape was measured faster (1 unless listed)
            if mode == "triton":
                return ops.GEMV_MAX_ROWS
            return max(1, fused_rows([tuple(lin.weight.shape) for lin in lins])) if mode == "auto" else 0

        self.fused_rows = rows(fused_in)  # the norms fused into input projections (one row count for the layer)
        for lin in outputs:
            lin.decode_gemv = rows([lin]) if use(lin) else 0
        return any([self.fused_in, self.fused_mlp, self.fused_moe] + [lin.decode_gemv > 0 for lin in outputs])

    def forward(self, positions, h, residual, fb: ForwardBatch):
        """-> (h, residual). Decode rows (at most fused_rows) of a fused layer: one launch for each norm and
        the projection after it (enabled on CUDA only; ops' reference elsewhere)."""
        decode = h.shape[0] <= self.fused_rows
        mixed = self.mix_from_norm(positions, h, residual, fb) if self.fused_prep and decode else None
        if mixed is not None:
            h, residual = mixed
        elif self.fused_in and decode:
            proj, residual = _norm_linear(self.input_layernorm, self.mixer_projections()[0], h, residual)
            h = self.mix_projected(positions, proj, fb)
        else:
            if residual is None:
                residual = h
                h = self.input_layernorm(h)
            else:
                h, residual = self.input_layernorm(h, residual)
            h = self.mix(positions, h, fb)
        if self.fused_mlp and decode:  # [T, I] = silu(gate) * up
            gate_up, down = _dense_mlp(self.mlp)
            act, residual = _norm_linear(self.post_attention_layernorm, gate_up, h, residual, silu_mul=True)
            return down(act), residual
        if self.fused_moe and decode:
            return self.mlp.forward_with_norm(h, residual, self.post_attention_layernorm)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DenseDecoderLayer(PreNormDecoderLayer):
    """Attention + MLP block. `mlp`: the family's MLP for this layer (default: the dense SiLU-gated MLP; MoE families
    pass their sparse block)."""

    def __init__(self, cfg: DenseConfig, layer_id: int, rotary: RotaryEmbedding, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DenseAttention(cfg, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else DenseMLP(cfg)

    def cache_specs(self) -> list[CacheSpec]:
        return [self.self_attn.cache_spec()]

    def mix(self, positions, h, fb: ForwardBatch):
        return self.self_attn(positions, h, fb)

    def mixer_projections(self) -> tuple[nn.Module, nn.Module] | None:
        return self.self_attn.qkv_proj, self.self_attn.o_proj

    def mix_projected(self, positions, proj, fb: ForwardBatch):
        return self.self_attn.attend(positions, proj, fb)

    def prep_fusable(self) -> bool:
        return self.self_attn.prep_fusable()

    def prep_normed(self) -> bool:
        return self.self_attn.qk_norm

    def mix_from_norm(self, positions, h, residual, fb: ForwardBatch):
        return self.self_attn.attend_from_norm(self.input_layernorm, h, residual,
                                               self.self_attn.rotary.table_positions(positions), fb)


def _dense_mlp(mlp: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(gate_up_proj, down_proj) of a one-device SiLU-gated dense MLP (DenseMLP, or layers/moe.py GatedMLP), else
    (None, None)."""
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if type(gate_up) is MergedLinear and type(down) is Linear and not hasattr(mlp, "experts"):
        return gate_up, down
    return None, None


def _norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None,
                 silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)) [SiLU-and-mul'd], x + residual) in one launch (x when residual is None)."""
    return ops.norm_gemv(x, residual, norm.weight, norm.eps, norm.weight_offset, linear.weight, linear.bias, silu_mul)


def set_decode_gemv(model: nn.Module, mode: str) -> int:
    """Apply --decode-gemv to every pre-norm decoder layer of `model` (the MTP block's included) -> how many fuse."""
    return sum(m.set_decode_gemv(mode) for m in model.modules() if isinstance(m, PreNormDecoderLayer))


class DenseModel(nn.Module):
    def __init__(self, cfg: DenseConfig, max_positions: int, family: type[DenseForCausalLM]):
        """family: the model class whose hooks build the decoder layers, the rotary table and the norms."""
        super().__init__()
        self.embed_tokens = (VocabEmbedding(cfg.vocab_size, cfg.hidden_size) if cfg.tp.size == 1
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.tp))
        self.rotary = family.make_rotary(cfg, max_positions)
        self.layers = nn.ModuleList([family.make_layer(cfg, i, self.rotary) for i in range(cfg.num_layers)])
        self.norm = family.make_norm(cfg, cfg.hidden_size)
        self.aux_layers: tuple[int, ...] = ()  # layers whose outputs are appended to the output (set_aux_layers)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """-> [T, H] final-norm hidden, or [T, (1 + k) H] = [final-norm | output of each of the k aux layers] in the
        modes whose output feeds a drafter (extend, verify; plain decode only needs logits)."""
        h = self.embed_tokens(fb.input_ids)
        residual = None
        aux = []
        aux_layers = self.aux_layers if fb.mode in _FEATURE_MODES else ()
        for i, layer in enumerate(self.layers):
            h, residual = layer(fb.positions, h, residual, fb)
            if i in aux_layers:
                aux.append(h + residual)  # the residual stream after layer i (the block's output)
        h, _ = self.norm(h, residual)
        return torch.cat([h, *aux], dim=-1) if aux else h


class DenseForCausalLM(nn.Module):
    """Target model. forward() returns the features handed to the MTP drafter: the final-norm hidden state [T, H]
    (the lm-head input), followed by the outputs of the aux layers a drafter asked for (set_aux_layers), so
    [T, feature_size]. compute_logits reads the first H columns.

    The family hooks (classmethods, overridden by families built on this one, e.g. models/qwen3_moe.py):
    config_class (parsing), make_layer (the decoder layer), mtp_block (the MTP layer's block: the family's
    attention and MLP kind), make_rotary, make_norm, checkpoint_name and load_tensor (HF names -> parameters)."""

    config_class = DenseConfig
    # built for a tensor-parallel group above one rank (cfg.tp); a family declares it itself (not inherited)
    tensor_parallel = True

    def __init__(self, cfg: DenseConfig, max_positions: int):
        super().__init__()
        if cfg.tp.size > 1 and not type(self).__dict__.get("tensor_parallel", False):
            raise ValueError(f"{type(self).__name__} ({cfg.architecture}) declares no tensor-parallel layers: "
                             "it runs on one rank only")
        self.config = cfg
        self.model = DenseModel(cfg, max_positions, type(self))
        self.lm_head = (LMHead(cfg.vocab_size, cfg.hidden_size) if cfg.tp.size == 1
                        else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, cfg.tp))
        self.tie_weights()

    # ------------------------------------------------------------------ family hooks
    @classmethod
    def make_layer(cls, cfg: DenseConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return DenseDecoderLayer(cfg, layer_id, rotary)

    @classmethod
    def mtp_block(cls, cfg: DenseConfig, rotary: RotaryEmbedding) -> nn.Module:
        """The decoder block of this family's MTP layer (its own caches: cache index 0 of the draft's pools)."""
        return DenseDecoderLayer(cfg, 0, rotary)

    @classmethod
    def make_rotary(cls, cfg: DenseConfig, max_positions: int) -> RotaryEmbedding:
        return make_rotary(cfg, max_positions)

    @classmethod
    def make_norm(cls, cfg: ModelConfig, size: int) -> RMSNorm:
        """The family's RMSNorm outside the decoder blocks (final norm; the MTP layer's norms)."""
        return RMSNorm(size, cfg.rms_norm_eps)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """A checkpoint tensor's name as load_tensor reads it; None for tensors this family does not load (e.g. the
        vision tower of a vision-language checkpoint loaded as text only)."""
        return name

    @classmethod
    def load_tensor(cls, root: nn.Module, params: dict[str, nn.Parameter], name: str,
                    tensor: torch.Tensor) -> str | None:
        """Copy one HF-named tensor into root's parameters; returns our parameter's name (None: no match)."""
        return load_dense_tensor(root, params, name, tensor)

    @classmethod
    def finish_loading(cls, root: nn.Module, loaded: set[str]) -> set[str]:
        """The parameters of root that are now completely loaded, of those written (`loaded`); families whose
        parameters stream in pieces (stacked experts) drop the incomplete ones."""
        return loaded

    def cache_specs(self) -> list[CacheSpec]:
        """One spec per cache-keeping layer, in layer order (kvcache/cache_spec.py)."""
        return [spec for layer in self.model.layers for spec in layer.cache_specs()]

    def tie_weights(self) -> None:
        """Share the embedding with the lm-head (tied checkpoints). Call again after to_empty(): moving a meta
        model to a device makes new Parameter objects per module and so unties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def embed_tokens(self) -> VocabEmbedding:
        return self.model.embed_tokens

    def set_aux_layers(self, layers: list[int]) -> None:
        """Append the outputs of these decoder layers to forward()'s result (an EAGLE-3 style drafter reads them)."""
        bad = [i for i in layers if not 0 <= i < self.config.num_layers]
        if bad:
            raise ValueError(f"aux hidden layers {bad} outside the target's {self.config.num_layers} layers")
        self.model.aux_layers = tuple(sorted(set(layers)))

    @property
    def feature_size(self) -> int:
        """Width of forward()'s output in extend and verify batches: H per aux layer beyond the final hidden."""
        return self.config.hidden_size * (1 + len(self.model.aux_layers))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        return self.model(fb)

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, H] or [T, feature_size] (forward's output) -> logits [T, V]."""
        h = self.config.hidden_size
        return self.lm_head(features if features.shape[-1] == h else features[..., :h].contiguous())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the names of our parameters that were written."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None or "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target = self.load_tensor(self, params, name, tensor)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {self.config.architecture}")
            loaded.add(target)
        return self.finish_loading(self, loaded)


_SHARDS = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
}


def load_dense_tensor(root: nn.Module, params: dict[str, nn.Parameter], name: str,
                      tensor: torch.Tensor) -> str | None:
    """Copy one HF-named tensor into `root`'s parameters (fused shards included); returns our param name."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _SHARDS:
        fused, shard = _SHARDS[parts[-2]]
        mod_name = ".".join(parts[:-2] + [fused])
        module = root.get_submodule(mod_name)
        module.load_shard(shard, tensor, is_bias=parts[-1] == "bias")
        return f"{mod_name}.{parts[-1]}"
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
    p = params[name]
    if p.shape != tensor.shape:
        raise ValueError(f"{name}: parameter shape {tuple(p.shape)} != checkpoint shape {tuple(tensor.shape)}")
    with torch.no_grad():
        p.copy_(tensor)
    return name
