"""The pre-norm decoder layer every family's layers are built on, and --decode-gemv's fused decode rows.

A layer is input_layernorm -> token mixer (`mix`: the family's attention, or linear attention) ->
post_attention_layernorm -> mlp, with the residual carried beside the hidden state so that each add + norm is one
op. A family's layer sets the four modules and implements `mix` and `cache_specs`. It may expose its mixer's input
and output projections (`mixer_projections`, `mix_projected`); decode rows can then run each norm inside the GEMV
of the projection after it (set_decode_gemv). A mixer that can also take its own prep into that op (the dense
family's attention: q/k norms, rotary, K/V store) implements `mix_from_norm` and sets `fused_prep` in its layer's
set_decode_gemv. What a family's MLP allows is read off the module it uses: a one-device SiLU-gated MLP (gate/up
after the norm), an MoE block whose router takes the norm (layers/moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.kernels import ops
from specserve.kernels.gemv_policy import fused_rows, prefer_fused
from specserve.kvcache.cache_spec import CacheSpec
from specserve.layers.linear import Linear, MergedLinear
from specserve.layers.moe import SparseMoEBlock
from specserve.layers.norm import RMSNorm


class PreNormDecoderLayer(nn.Module):
    """The pre-norm block skeleton; subclasses set input_layernorm, post_attention_layernorm and mlp, and
    implement `mix` and `cache_specs`."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: nn.Module

    # decode rows with the input norm fused into the mixer's input projection / the post-attention norm into a
    # gated MLP's gate/up (set_decode_gemv)
    fused_in = False
    fused_mlp = False
    fused_moe = False  # the post-attention norm inside an MoE block's router launch (layers/moe.py)
    fused_rows = 0  # the most rows a call fuses at ('auto': gemv_policy.fused_rows of the fused shapes)
    # with fused_in: the mixer's own prep (q/k norms, rotary, K/V store) in the same op (mix_from_norm); a family's
    # layer whose mixer has that op sets it in its set_decode_gemv (models/dense.py DenseDecoderLayer)
    fused_prep = False

    def cache_specs(self) -> list[CacheSpec]:
        """The caches this layer keeps, one spec each (kvcache/cache_spec.py)."""
        raise NotImplementedError

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The token mixer on the normed hidden states [T, H] -> [T, H]."""
        raise NotImplementedError

    def mixer_projections(self) -> tuple[nn.Module, nn.Module] | None:
        """The token mixer's input and output projections, when it can run from its input projection's output
        (mix_projected); None: it cannot, and its decode rows stay unfused."""
        return None

    def mix_projected(self, positions: torch.Tensor, proj: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """mix, given the input projection's output proj [T, rows of mixer_projections()[0]]."""
        raise NotImplementedError

    def mix_from_norm(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                      fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mix of the input norm of hidden + residual, the new residual) with the norm, the input projection and
        the mixer's prep in one op (layers with fused_prep); None when that op cannot take this step."""
        return None

    def set_decode_gemv(self, mode: str) -> bool:
        """--decode-gemv: 'triton' runs this layer's decode rows through the fused GEMVs (kernels/triton_gemv.py:
        input norm + the mixer's input projection, its output projection, and for a SiLU-gated MLP the
        post-attention norm + gate/up + SiLU-mul and the down projection; for an MoE block with a softmax router
        the post-attention norm inside the router's launch), 'auto' each of those where its weight shape is
        measured faster (kernels/gemv_policy.py: at one row, and at verify's rows where FASTER_ROWS lists every
        fused shape of the layer; other rows stay on cuBLAS), 'cublas' none.
        Tensor-parallel projections keep the unfused path. Returns whether any part of the layer fuses."""
        projs = self.mixer_projections()
        if projs is None or type(projs[0]) is not MergedLinear or type(projs[1]) is not Linear:
            projs = None
        gate_up, down = gated_mlp_projections(self.mlp)

        def use(linear) -> bool:  # (the fused GEMVs read bf16 weights: an FP8 layer keeps its own forward)
            return linear is not None and not linear.is_fp8 and (
                mode == "triton" or (mode == "auto" and prefer_fused([tuple(linear.weight.shape)])))

        self.fused_in = bool(projs) and use(projs[0])
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

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden, residual). Decode rows (at most fused_rows) of a fused layer: one launch for each norm and
        the projection after it (enabled on CUDA only; ops' reference elsewhere)."""
        decode = hidden.shape[0] <= self.fused_rows
        mixed = self.mix_from_norm(positions, hidden, residual, fb) if self.fused_prep and decode else None
        if mixed is not None:
            hidden, residual = mixed
        elif self.fused_in and decode:
            proj, residual = norm_linear(self.input_layernorm, self.mixer_projections()[0], hidden, residual)
            hidden = self.mix_projected(positions, proj, fb)
        else:
            if residual is None:
                residual = hidden
                hidden = self.input_layernorm(hidden)
            else:
                hidden, residual = self.input_layernorm(hidden, residual)
            hidden = self.mix(positions, hidden, fb)
        if self.fused_mlp and decode:  # [T, I] = silu(gate) * up
            gate_up, down = gated_mlp_projections(self.mlp)
            act, residual = norm_linear(self.post_attention_layernorm, gate_up, hidden, residual, silu_mul=True)
            return down(act), residual
        if self.fused_moe and decode:
            return self.mlp.forward_with_norm(hidden, residual, self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


def gated_mlp_projections(mlp: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(gate_up_proj, down_proj) of a one-device SiLU-gated MLP (models/dense.py DenseMLP, or layers/moe.py
    GatedMLP), else (None, None)."""
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if type(gate_up) is MergedLinear and type(down) is Linear and not hasattr(mlp, "experts"):
        return gate_up, down
    return None, None


def norm_linear(norm: RMSNorm, linear: Linear, x: torch.Tensor, residual: torch.Tensor | None,
                silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm(x + residual)) [SiLU-and-mul'd], x + residual) in one launch (x when residual is None)."""
    return ops.norm_gemv(x, residual, norm.weight, norm.eps, norm.weight_offset, linear.weight, linear.bias, silu_mul)


def set_decode_gemv(model: nn.Module, mode: str) -> int:
    """Apply --decode-gemv to every pre-norm decoder layer of `model` (the MTP block's included) -> how many fuse."""
    return sum(layer.set_decode_gemv(mode) for layer in model.modules() if isinstance(layer, PreNormDecoderLayer))
