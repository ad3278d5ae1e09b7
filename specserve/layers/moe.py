"""Mixture-of-experts layer: routers, stacked routed experts, optional shared expert.

Families: Qwen2-MoE / Qwen3-Next (softmax router, sigmoid-gated shared expert), Qwen3-MoE (softmax router, no shared
expert), DeepSeek-V3 / GLM-4.5 (grouped sigmoid router with a choice-only correction bias, plain shared experts).
The transformers implementations are the oracle in tests/test_moe_layer.py.

Routers are pure functions of the router logits made of fixed-shape device ops only (no .item(), no nonzero), so a
decode step that routes stays capturable in a CUDA graph. Routed experts run through ops.fused_moe.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.distributed.tp import TP1, TPGroup
from specserve.kernels import ops
from specserve.layers.activation import silu_and_mul
from specserve.layers.linear import Linear, MergedLinear, copy_checked
from specserve.layers.parallel import MergedColumnParallelLinear, RowParallelLinear
from specserve.weights.fp8 import Fp8Weight, slice_on_blocks

ROUTERS = ("softmax", "grouped_sigmoid")
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next: softmax over all experts, keep the top_k, optionally rescale the kept
    weights to sum to 1. logits [T, E] -> (topk_weights [T, K] float32, topk_ids [T, K] int64), ids by descending
    weight, equal weights by ascending id (kernels/reference.py softmax_topk; one Triton kernel on CUDA)."""
    return ops.softmax_topk(logits, top_k, renormalize)


class FusedMoE(nn.Module):
    """The routed experts as two stacked weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and
    w2 [E, H, I]; the grouped GEMM in ops.fused_moe reads only the chosen experts.

    Checkpoints arrive tensor by tensor, one expert projection at a time, so the module records which pieces were
    written (`loaded_param_names`): a name-based "was this parameter touched" check would pass a w13 of which only
    expert 0's gate rows were ever loaded.

    tp: above one rank, each expert's intermediate features are split over the ranks (tensor-parallel MoE): this
    rank keeps its slice of every expert's gate and up rows and down columns, and its output is a partial sum.

    FP8 experts (to_fp8; kernels/reference_moe_fp8.py has both layouts), w13 / w2 float8_e4m3fn with float32 scales:
    block-scaled, fp8_block = (bn, bk): w13_scale [E, 2I/bn, ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)]
    (DeepSeek / GLM / Qwen FP8 releases, and online FP8); per-channel, fp8_block None (`fp8_per_channel`):
    w13_scale [E, 2I], w2_scale [E, H], one scale per weight row (compressed-tensors' channel strategy; a per-tensor
    checkpoint's scale repeated over its projection's rows, so an expert's gate and up, or a fused shared expert,
    keep their own). Under tensor parallelism each rank keeps its I slice in FP8 with its scales: w13's gate and up
    rows and their scale rows, w2's columns with their scale columns (block) or all of w2's row scales (per-channel);
    block-scaled only where the slice falls on the blocks (fp8_blocks_fit), else dequantized.
    """

    fp8_capable = True  # (as Linear's attribute: the loader asks either)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup = TP1):
        super().__init__()
        intermediate_size = tp.split(intermediate_size, "MoE intermediate size")  # this rank's slice
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.tp = tp
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))  # [E, H, I]
        self.fp8_block: tuple[int, int] | None = None  # FP8 experts: one scale per block; None: per row (to_fp8)
        self.loaded_plain = False  # a plain piece was loaded: later FP8 pieces come dequantized
        # Pieces still unwritten per parameter (plain attribute: not state, survives to_empty()).
        self.pending: dict[str, set[tuple[int, str]]] = {
            "w13": {(i, p) for i in range(num_experts) for p in ("gate_proj", "up_proj")},
            "w2": {(i, "down_proj") for i in range(num_experts)},
        }

    @property
    def is_fp8(self) -> bool:
        return self.w13.dtype == torch.float8_e4m3fn

    @property
    def fp8_per_channel(self) -> bool:
        """FP8 experts with one scale per weight row (w13_scale [E, 2I], w2_scale [E, H]) rather than per block."""
        return self.is_fp8 and self.fp8_block is None

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, K] float32, topk_ids [T, K] int64 -> [T, H] in x's dtype."""
        if self.is_fp8:
            return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, w13_scale=self.w13_scale,
                                 w2_scale=self.w2_scale, block=self.fp8_block)
        return ops.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)

    def to_fp8(self, block: tuple[int, int] | None) -> None:
        """FP8 experts (zeros, unit scales) with one scale per `block` [rows, cols] of each expert's weights (None:
        one per row); the loader copies the checkpoint's values in (or quantize_fp8 the loaded ones)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        dev = self.w13.device
        self.plain_dtype = self.w13.dtype  # to_plain's
        fp8 = torch.float8_e4m3fn
        self.w13 = nn.Parameter(torch.zeros((e, 2 * i, h), dtype=fp8, device=dev), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros((e, h, i), dtype=fp8, device=dev), requires_grad=False)
        if block is None:
            s13, s2 = (e, 2 * i), (e, h)  # [E, 2I], [E, H]: a scale per row
        else:
            bn, bk = block
            s13, s2 = (e, 2 * i // bn, -(-h // bk)), (e, -(-h // bn), -(-i // bk))  # [E, 2I/bn, H/bk], [E, H/bn, I/bk]
        self.register_buffer("w13_scale", torch.ones(s13, device=dev))
        self.register_buffer("w2_scale", torch.ones(s2, device=dev))
        self.fp8_block = block

    def to_plain(self) -> None:
        """Back from FP8 to the dtype before to_fp8, the values dequantized."""
        from specserve.kernels.reference_moe_fp8 import dequantize_experts

        w13 = dequantize_experts(self.w13, self.w13_scale, self.fp8_block).to(self.plain_dtype)  # [E, 2I, H]
        w2 = dequantize_experts(self.w2, self.w2_scale, self.fp8_block).to(self.plain_dtype)  # [E, H, I]
        del self.w13_scale, self.w2_scale
        self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        self.fp8_block = None

    def accepts_fp8(self, block: tuple[int, int] | None) -> bool:
        """Whether the experts can hold FP8 weights with `block` scales (None: one per row, which every shape
        and slice takes): a block that fits (fp8_blocks_fit), no plain piece loaded yet."""
        if self.is_fp8:
            return self.fp8_block == block
        return not self.loaded_plain and self.fp8_blocks_fit(block)

    def fp8_blocks_fit(self, block: tuple[int, int] | None) -> bool:
        """A block the kernel takes (the gate and up rows each a whole number of blocks; a power-of-two column
        block of at least 16) and, under tensor parallelism, this rank's I slice of w2's columns on the blocks
        (the gate / up row slices are then too: I / size a multiple of bn)."""
        if block is None:
            return True
        bn, bk = block
        i, tp = self.intermediate_size, self.tp
        return (i % bn == 0 and bk >= 16 and bk & (bk - 1) == 0
                and slice_on_blocks(tp.rank * i, i, i * tp.size, bk))

    def fp8_ready(self, w: Fp8Weight) -> bool:
        """Whether the experts keep `w` in FP8 (converting on the first one unless converted before allocation)."""
        if w.q.dtype != torch.float8_e4m3fn or not self.accepts_fp8(w.block):
            return False
        if not self.is_fp8:
            self.to_fp8(w.block)
        return True

    def load_expert_fp8(self, expert: int, proj: str, w: Fp8Weight) -> bool:
        """load_expert for an FP8 checkpoint piece kept in FP8; False: the caller loads it dequantized."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside the layer's {self.num_experts} experts")
        if proj not in _EXPERT_PROJS or not self.accepts_fp8(w.block):
            return False
        i = self.intermediate_size
        if self.tp.size > 1:  # this rank's intermediate features: gate / up rows, down's columns (with scales)
            start = self.tp.rank * i
            w = w.cols(start, i) if proj == "down_proj" else w.rows(start, i)
        if not self.fp8_ready(w):
            return False
        if proj == "down_proj":
            targets, param = (self.w2[expert], self.w2_scale[expert]), "w2"
        else:
            rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
            bn = 1 if self.fp8_block is None else self.fp8_block[0]  # per-channel: a scale a row
            scales = slice(rows.start // bn, rows.stop // bn)
            targets, param = (self.w13[expert, rows], self.w13_scale[expert, scales]), "w13"
        copy_checked(targets[0], w.q, f"experts.{expert}.{proj}")
        copy_checked(targets[1], w.scale, f"experts.{expert}.{proj} scale")
        self.pending[param].discard((expert, proj))
        return True

    def quantize_fp8(self, block: tuple[int, int] | None = (128, 128)) -> bool:
        """Online FP8 of loaded bf16 experts (--quantization fp8): `block` scales, as block-scaled FP8 checkpoints
        hold them (the default: layers/quant.py says why), or None: one scale per row. False (left as they are)
        where the block does not fit. Under tensor parallelism each rank quantises its slice: the same values and
        scales as the full experts' slice where the blocks fit it (and per-channel for w13's rows; w2's row scales
        then span this rank's columns only)."""
        from specserve.kernels.reference_moe_fp8 import quantize_blocks, quantize_channels

        if self.is_fp8 or not self.fp8_blocks_fit(block):
            return False
        if block is None:
            q13, s13 = quantize_channels(self.w13.detach())  # [E, 2I, H] fp8, [E, 2I]
            q2, s2 = quantize_channels(self.w2.detach())  # [E, H, I] fp8, [E, H]
        else:
            q13, s13 = quantize_blocks(self.w13.detach(), block)  # [E, 2I, H] fp8, [E, 2I/bn, H/bk]
            q2, s2 = quantize_blocks(self.w2.detach(), block)  # [E, H, I] fp8, [E, H/bn, I/bk]
        self.to_fp8(block)
        with torch.no_grad():
            self.w13.copy_(q13)
            self.w2.copy_(q2)
            self.w13_scale.copy_(s13)
            self.w2_scale.copy_(s2)
        return True

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        """One per-expert HF tensor: gate_proj / up_proj [I, H], down_proj [H, I]."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside the layer's {self.num_experts} experts")
        i = self.intermediate_size
        if self.tp.size > 1 and proj in _EXPERT_PROJS:  # this rank's intermediate features: rows, or down's columns
            tensor = self.tp.shard(tensor, 1 if proj == "down_proj" else 0, f"experts.{expert}.{proj}")
        if self.is_fp8:  # a plain piece after FP8 ones: all of them dequantized, the experts in the model dtype
            self.to_plain()
        if proj == "gate_proj":
            target, param = self.w13[expert, :i], "w13"
        elif proj == "up_proj":
            target, param = self.w13[expert, i:], "w13"
        elif proj == "down_proj":
            target, param = self.w2[expert], "w2"
        else:
            raise ValueError(f"unknown expert projection {proj!r} (expected one of {_EXPERT_PROJS})")
        copy_checked(target, tensor, f"experts.{expert}.{proj}")
        self.loaded_plain = True
        self.pending[param].discard((expert, proj))

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        """transformers-5 in-memory layouts: gate_up_proj [E, 2I, H] (gate rows then up rows, as ours), down_proj
        [E, H, I]. E may be fewer than ours: a fused shared expert sits after the routed ones (SparseMoEBlock)."""
        if name == "gate_up_proj":
            param, projs = "w13", ("gate_proj", "up_proj")
        elif name == "down_proj":
            param, projs = "w2", ("down_proj",)
        else:
            raise ValueError(f"unknown fused expert tensor {name!r} (expected 'gate_up_proj' or 'down_proj')")
        n = tensor.shape[0]
        if self.tp.size > 1:  # this rank's intermediate features: of the gate and of the up rows, down's columns
            what = f"experts.{name}"
            tensor = (self.tp.shard(tensor, 2, what) if name == "down_proj" else
                      torch.cat([self.tp.shard(half, 1, what) for half in tensor.chunk(2, dim=1)], dim=1))
        copy_checked(getattr(self, param)[:n], tensor, f"experts.{name}")
        self.pending[param] -= {(i, p) for i in range(n) for p in projs}

    def loaded_param_names(self) -> set[str]:
        return {name for name, left in self.pending.items() if not left}


class GatedMLP(nn.Module):
    """A dense SiLU-gated MLP (the shared expert): fused gate|up projection, then down, like models/dense DenseMLP
    but sized by arguments rather than a model config."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup = TP1):
        """tp: above one rank, each keeps a slice of the intermediate features (the down projection sums them)."""
        super().__init__()
        inter = intermediate_size
        if tp.size == 1:
            self.gate_up_proj = MergedLinear(hidden_size, {"gate": inter, "up": inter})
            self.down_proj = Linear(inter, hidden_size)
        else:
            self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate": (inter, 1), "up": (inter, 1)}, tp)
            self.down_proj = RowParallelLinear(inter, hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, H]


class SparseMoEBlock(nn.Module):
    """Router + routed experts (+ shared expert): the MLP of an MoE decoder layer. forward(x [T, H]) -> [T, H].

    Parameter names (ours; HF names in load_weight): gate.weight [E, H], e_score_correction_bias [E]
    (grouped_sigmoid only), experts.w13 / experts.w2, shared_expert.gate_up_proj.weight / .down_proj.weight
    (when shared_expert_intermediate_size > 0), shared_expert_gate.weight [1, H] (when shared_expert_gated). A
    gated shared expert as wide as the routed ones is fused instead (`fused_shared`): expert E of experts.w13 / w2
    and row E of gate.weight [E + 1, H].

    Router precision follows HF per family: the softmax router's logits come from the gate in the model dtype (HF
    Qwen), the grouped sigmoid router's from float32 input and weight (HF DeepSeek-V3 / GLM keep gate.weight and the
    correction bias in float32, `_keep_in_fp32_modules_strict`). Both then route in float32. A model cast to
    bfloat16 by `.to(dtype)` would round the correction bias, which can move expert choices: the loader keeps
    `FLOAT32_PARAMS` of a grouped-sigmoid block in float32 (models/loader.py keep_float32_params).
    """

    FLOAT32_PARAMS = ("gate.weight", "e_score_correction_bias")

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int, *,
                 renormalize: bool, router: str = "softmax", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, shared_expert_intermediate_size: int = 0,
                 shared_expert_gated: bool = False, tp: TPGroup = TP1, expert_parallel: bool = True):
        """tp: the tensor-parallel group; above one rank the ranks' partial outputs are summed (all-reduce), and
        the experts are split over the ranks one of two ways (SGLang's --ep-size): expert_parallel (--ep-size =
        --tp-size), each rank keeps num_experts / size routed experts whole; else (--ep-size 1) each rank keeps
        every expert's slice of the intermediate features. The router is whole on every rank; a shared expert
        fused into the experts is split as they are, an unfused one runs whole on rank 0."""
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r} (expected one of {ROUTERS})")
        if router == "softmax" and routed_scaling_factor != 1.0:
            raise ValueError("routed_scaling_factor applies to the grouped_sigmoid router only")
        if router == "grouped_sigmoid" and (num_experts % n_group or num_experts // n_group < 2
                                            or not 0 < topk_group <= n_group):
            raise ValueError(f"grouped_sigmoid router: {num_experts} experts cannot form {n_group} groups of >= 2 "
                             f"with {topk_group} kept")
        if shared_expert_gated and shared_expert_intermediate_size <= 0:
            raise ValueError("shared_expert_gated needs shared_expert_intermediate_size > 0")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.router, self.renormalize = router, renormalize
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.shared_expert_gated = shared_expert_gated
        self.tp = tp
        self.ep = ep = tp if expert_parallel else TP1  # the group the routed experts are partitioned over
        expert_tp = TP1 if expert_parallel else tp  # the group each expert's intermediate features are split over
        local = ep.split(num_experts, "routed experts")  # this rank's experts: expert_start .. + local
        self.expert_start = ep.rank * local
        # A shared expert as wide as a routed one runs as one more expert, E, inside the grouped GEMM: one kernel
        # chain instead of two GEMMs, an activation and the add (and a gate GEMM and elementwise kernels) beside the
        # routed experts (unless the experts are partitioned over ranks). Sigmoid-gated (Qwen3-Next, Qwen3.5-MoE):
        # its gate is router row E and its weight sigmoid(gate); plain (DeepSeek-V3, GLM, beside the grouped
        # router): weight 1.
        self.fused_shared = (shared_expert_intermediate_size == moe_intermediate_size and ep.size == 1
                             and shared_expert_gated == (router == "softmax"))
        extra = int(self.fused_shared)
        gate_row = int(self.fused_shared and shared_expert_gated)
        self.gate = Linear(hidden_size, num_experts + gate_row)  # [E (+ 1), H] router (+ the shared expert's gate)
        self.gate.fp8_capable = False  # the routing kernels read gate.weight themselves
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts)) if router == "grouped_sigmoid"
                                        else None)  # [E]; a Parameter so the loader's all-loaded check covers it
        self.experts = FusedMoE(local + extra, hidden_size, moe_intermediate_size, expert_tp)
        self.shared_expert = (GatedMLP(hidden_size, shared_expert_intermediate_size)
                              if shared_expert_intermediate_size > 0 and not self.fused_shared else None)
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert_gated and not self.fused_shared else None
        # Pieces of our non-expert parameters still unwritten (plain attribute; experts track their own).
        self.pending: dict[str, set[str]] = {n: {"all"} for n, _ in self.named_parameters()
                                             if not n.startswith(("experts.", "shared_expert.gate_up_proj."))}
        if self.shared_expert is not None:
            self.pending["shared_expert.gate_up_proj.weight"] = {"gate", "up"}
        if gate_row:
            self.pending["gate.weight"] = {"router", "shared_gate"}

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, K] float32, topk_ids [T, K] int64); [T, K + 1] with the fused shared
        expert (id E, weight sigmoid(its gate), or 1 for a plain one)."""
        if self.router == "softmax":
            # On CUDA the gate (bias-free, a plain weight there) and the routing are one launch for decode-sized
            # batches (ops.router_softmax_topk, which falls back to the GEMM otherwise); on a CPU the gate's own
            # forward (prepacked or int8 linears)
            if x.is_cuda:
                return ops.router_softmax_topk(x, self.gate.weight, self.top_k, self.renormalize, self.fused_shared)
            return ops.softmax_topk(self.gate(x), self.top_k, self.renormalize, self.fused_shared)
        # logits F.linear(x.float(), gate.weight.float()) as HF DeepSeek-V3; one launch on CUDA at decode sizes
        return ops.router_grouped_sigmoid_topk(x, self.gate.weight, self.e_score_correction_bias, self.top_k,
                                               self.n_group, self.topk_group, self.routed_scaling_factor,
                                               self.renormalize, self.fused_shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mix(x, *self.route(x))

    @property
    def norm_fusable(self) -> bool:
        """Whether forward_with_norm can fold the norm before the block into the router's launch (softmax
        routers, one rank)."""
        return self.router == "softmax" and self.tp.size == 1

    def forward_with_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                          norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(h + residual)), h + residual) with the RMSNorm computed inside the router's launch on CUDA
        (ops.norm_router_softmax_topk; decode-sized batches): norm_fusable blocks only."""
        w, ids, x, residual = ops.norm_router_softmax_topk(h, residual, norm.weight, norm.eps, norm.weight_offset,
                                                           self.gate.weight, self.top_k, self.renormalize,
                                                           self.fused_shared)
        return self._mix(x, w, ids), residual

    def _mix(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts (and shared expert) over x [T, H] with the routing -> [T, H]."""
        ep = self.ep
        if ep.size > 1:  # this rank's experts only: the others' choices get weight 0 (on local expert 0)
            local_ids = topk_ids - self.expert_start
            inside = (local_ids >= 0) & (local_ids < self.experts.num_experts)
            topk_weights = torch.where(inside, topk_weights, 0.0)
            topk_ids = torch.where(inside, local_ids, 0)
        out = self.experts(x, topk_weights, topk_ids)  # [T, H]
        if self.shared_expert is not None and self.tp.rank == 0:
            shared = self.shared_expert(x)  # [T, H]
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared  # [T, 1] gate per token
            out = out + shared
        return self.tp.all_reduce(out)

    def load_weight(self, rest: str, tensor: torch.Tensor) -> bool:
        """Copy one HF tensor named below the block (`model.layers.N.mlp.` stripped); False for a name this block
        has no place for (the caller decides whether that is an error). Accepts per-expert checkpoint names
        (experts.3.gate_proj.weight), transformers-5 fused ones (experts.gate_up_proj, experts.down_proj), both
        shared-expert spellings (Qwen shared_expert., DeepSeek shared_experts.), shared_expert_gate.weight and
        gate.e_score_correction_bias."""
        parts = rest.split(".")
        e = self.num_experts
        if self.fused_shared:  # the shared expert is expert E (its gate, if any, router row E)
            if self.shared_expert_gated and rest == "gate.weight":
                return self._load_piece("gate.weight", "router", self.gate.weight[:e], tensor)
            if self.shared_expert_gated and rest == "shared_expert_gate.weight":
                return self._load_piece("gate.weight", "shared_gate", self.gate.weight[e:], tensor)
            if (parts[0] in ("shared_expert", "shared_experts") and len(parts) == 3 and parts[2] == "weight"
                    and parts[1] in _EXPERT_PROJS):
                self.experts.load_expert(e, parts[1], tensor)
                return True
        if rest == "gate.weight":
            return self._load_whole("gate.weight", self.gate.weight, tensor)
        if rest == "gate.e_score_correction_bias":
            if self.e_score_correction_bias is None:
                return False
            return self._load_whole("e_score_correction_bias", self.e_score_correction_bias, tensor)
        if rest == "shared_expert_gate.weight":
            if self.shared_expert_gate is None:
                return False
            return self._load_whole("shared_expert_gate.weight", self.shared_expert_gate.weight, tensor)
        if parts[0] == "experts":
            if len(parts) == 2 and parts[1] in ("gate_up_proj", "down_proj"):
                local = self.experts.num_experts - int(self.fused_shared)
                self.experts.load_fused(parts[1], tensor[self.expert_start:self.expert_start + local]
                                        if self.ep.size > 1 else tensor)
                return True
            if len(parts) == 4 and parts[1].isdigit() and parts[2] in _EXPERT_PROJS and parts[3] == "weight":
                if int(parts[1]) >= e:  # (a fused shared expert's index is ours, not the checkpoint's)
                    raise ValueError(f"expert {parts[1]} outside the layer's {e} experts")
                j = int(parts[1]) - self.expert_start
                if 0 <= j < self.experts.num_experts - int(self.fused_shared):  # another rank's expert: skipped
                    self.experts.load_expert(j, parts[2], tensor)
                return True
            return False
        if parts[0] in ("shared_expert", "shared_experts") and len(parts) == 3 and parts[2] == "weight":
            if self.shared_expert is None:
                return False
            if parts[1] == "down_proj":
                return self._load_whole("shared_expert.down_proj.weight", self.shared_expert.down_proj.weight,
                                        tensor)
            if parts[1] in ("gate_proj", "up_proj"):
                shard = parts[1].removesuffix("_proj")
                self.shared_expert.gate_up_proj.load_shard(shard, tensor)
                self.pending["shared_expert.gate_up_proj.weight"].discard(shard)
                return True
        return False

    def fp8_module(self, rest: str) -> nn.Module | None:
        """The module that would hold the FP8 weight named `rest` (below the block) in FP8: the expert stack (an
        expert's or the fused shared expert's projection) or a projection of the separate shared expert; None for
        the router and other tensors."""
        parts = rest.split(".")
        if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[3] == "weight":
            return self.experts
        if len(parts) == 3 and parts[0] in ("shared_expert", "shared_experts") and parts[2] == "weight":
            if self.fused_shared:
                return self.experts
            if self.shared_expert is not None and parts[1] in _EXPERT_PROJS:
                return self.shared_expert.down_proj if parts[1] == "down_proj" else self.shared_expert.gate_up_proj
        return None

    def load_fp8_weight(self, rest: str, w: Fp8Weight) -> bool:
        """load_weight for an FP8 checkpoint weight kept in FP8 (block-scaled or per-channel, as FusedMoE and Linear
        take them): a routed expert's projection, a fused shared expert's, or the separate shared expert's
        projections. False: the caller loads it dequantized through load_weight (a block the kernels do not
        take or a tensor-parallel slice off the blocks, a stack that already holds a plain piece)."""
        parts = rest.split(".")
        e = self.num_experts
        if len(parts) == 4 and parts[0] == "experts" and parts[1].isdigit() and parts[3] == "weight":
            if int(parts[1]) >= e:
                raise ValueError(f"expert {parts[1]} outside the layer's {e} experts")
            j = int(parts[1]) - self.expert_start
            if not 0 <= j < self.experts.num_experts - int(self.fused_shared):
                return True  # another rank's expert: skipped, as load_weight does
            return self.experts.load_expert_fp8(j, parts[2], w)
        if (self.fused_shared and len(parts) == 3 and parts[0] in ("shared_expert", "shared_experts")
                and parts[2] == "weight"):
            return self.experts.load_expert_fp8(e, parts[1], w)
        if (self.shared_expert is None or len(parts) != 3 or parts[0] not in ("shared_expert", "shared_experts")
                or parts[2] != "weight"):
            return False
        if parts[1] == "down_proj":
            if not self.shared_expert.down_proj.keep_fp8(w):
                return False
            self.pending["shared_expert.down_proj.weight"].clear()
            return True
        if parts[1] in ("gate_proj", "up_proj") and self.shared_expert.gate_up_proj.accepts_fp8(w.block):
            shard = parts[1].removesuffix("_proj")
            self.shared_expert.gate_up_proj.load_shard(shard, w)
            self.pending["shared_expert.gate_up_proj.weight"].discard(shard)
            return True
        return False

    def _load_piece(self, name: str, piece: str, target: torch.Tensor, tensor: torch.Tensor) -> bool:
        copy_checked(target, tensor, f"{name} ({piece})")
        self.pending[name].discard(piece)
        return True

    def _load_whole(self, name: str, param: torch.Tensor, tensor: torch.Tensor) -> bool:
        copy_checked(param, tensor, name)
        self.pending[name].clear()
        return True

    def loaded_param_names(self) -> set[str]:
        """Our parameter names (relative to the block) whose every piece load_weight has written. A model's
        load_weights adds these, prefixed, to the set the loader compares with named_parameters(), so a checkpoint
        missing one expert's up_proj fails the all-loaded check instead of serving uninitialised memory."""
        done = {name for name, left in self.pending.items() if not left}
        return done | {f"experts.{n}" for n in self.experts.loaded_param_names()}
