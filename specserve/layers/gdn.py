"""Gated delta net (GDN): the linear-attention layer of Qwen3-Next and Qwen3.5, over slot-indexed recurrent state.

    [qkv | z | b | a] = in_proj(h)                      one GEMM (checkpoints' split or fused projections)
    qkv = silu(causal_conv1d(qkv))                       depthwise, window carried in the layer's conv state
    q, k (Hk heads of Dk), v (Hv heads of Dv)            q, k L2-normalised in the kernel, q scaled by Dk^-0.5
    beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, beta)               state [Hv, Dk, Dv] carried in the layer's SSM state
    out = out_proj(rms_norm(o) * w * silu(z))            per value head (GatedRMSNorm)

The state lives in the recurrent pool (kvcache/state_pool.py), one row per request and N + 1 slots per row; the
forward batch's recurrent backend says which row and slot each request starts from and where states are written
(attention/state_backend.py). The conv window is stored [K - 1, conv_dim] so a token's read of it is contiguous.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.batch import CacheKind, ForwardBatch
from specserve.distributed.tp import TP1, TPGroup
from specserve.kernels import ops
from specserve.kvcache.cache_spec import RecurrentStateSpec
from specserve.layers.linear import Linear, MergedLinear, copy_checked
from specserve.layers.norm import GatedRMSNorm
from specserve.layers.parallel import MergedColumnParallelLinear, RowParallelLinear


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, cache_index: int, ssm_dtype: torch.dtype, tp: TPGroup = TP1):
        """tp: above one rank, each keeps num_k_heads / size key heads and the value heads that go with them (their
        projections, conv channels, gates and state); out_proj sums the ranks' outputs."""
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} must be a multiple of linear_num_key_heads="
                             f"{num_k_heads}")
        self.tp = tp
        self.full_k_dim, self.full_v_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim  # checkpoint sizes
        num_k_heads = tp.split(num_k_heads, "linear-attention key heads")
        num_v_heads = tp.split(num_v_heads, "linear-attention value heads")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.cache_index = cache_index
        self.ssm_dtype = ssm_dtype
        parts = {"q": self.key_dim, "k": self.key_dim, "v": self.value_dim, "z": self.value_dim, "b": num_v_heads,
                 "a": num_v_heads}  # [q | k | v] = the conv's channels
        if tp.size == 1:
            self.in_proj = MergedLinear(hidden_size, parts)
            self.in_proj.part_names = ["in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b",
                                       "in_proj_a"]  # Qwen3-Next's fused and Qwen3.5's split checkpoint names
            self.out_proj = Linear(self.value_dim, hidden_size)
        else:
            units = {"q": head_k_dim, "k": head_k_dim, "v": head_v_dim, "z": head_v_dim, "b": 1, "a": 1}
            self.in_proj = MergedColumnParallelLinear(hidden_size, {n: (rows * tp.size, units[n])
                                                                    for n, rows in parts.items()}, tp)
            self.out_proj = RowParallelLinear(self.full_v_dim, hidden_size, tp)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))  # [C, K] depthwise taps
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)

    def cache_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_shape=(self.conv_kernel - 1, self.conv_dim),
                                  ssm_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
                                  conv_dtype=self.conv_weight.dtype, ssm_dtype=self.ssm_dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """h [T, H] -> [T, H]; reads and writes this layer's state slots."""
        return self.forward_projected(self.in_proj(h), fb)

    def forward_projected(self, proj: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """forward from the input projection's output proj [T, C + Vd + 2 Hv] (this rank's heads)."""
        t = proj.shape[0]
        backend = fb.backend(CacheKind.RECURRENT)
        meta = backend.meta
        conv_state, ssm_state = backend.pool.layer(self.cache_index)  # [rows, S, K-1, C], [rows, S, Hv, Dk, Dv]
        qkv, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        where = (meta.state_rows, meta.start_slots, meta.starts, meta.lens)
        if meta.chunked:  # prefill: token-parallel conv, chunk-parallel delta rule (T bounds any request's tokens)
            x = ops.causal_conv_prefill(qkv, self.conv_weight, conv_state, *where, t)  # [T, C]
        else:  # decode / verify (a few tokens per request), or --linear-attn-prefill recurrent: token by token
            x = ops.causal_conv_states(qkv, self.conv_weight, conv_state, *where, meta.per_position)  # [T, C]
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        g, beta = ops.gdn_gating(a, b, self.A_log, self.dt_bias)  # [T, Hv] float32 log decay, update strength
        if meta.chunked:
            o = ops.gated_delta_rule_prefill(q, k, v, g, beta, ssm_state, *where)  # [T, Hv, Dv]
        else:
            o = ops.gated_delta_rule_states(q, k, v, g, beta, ssm_state, *where, meta.per_position)
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.view(t, self.value_dim))

    # ------------------------------------------------------------------ loading
    def load_tensor(self, rest: str, tensor: torch.Tensor) -> str | None:
        """One checkpoint tensor named below the layer (`linear_attn.` stripped) -> our parameter's name, or None.
        Qwen3.5 splits the input projection (in_proj_qkv / z / b / a); Qwen3-Next fuses it into in_proj_qkvz and
        in_proj_ba, interleaved per key-head group ([q, k, v, z] of each group; [b, a]), which is de-interleaved
        here into our [all q | all k | all v] order."""
        kd, vd = self.full_k_dim, self.full_v_dim
        hk = kd // self.head_k_dim  # the checkpoint's head counts (all ranks')
        r = (vd // self.head_v_dim) // hk
        if rest == "in_proj_qkv.weight":
            for name, part in zip("qkv", tensor.split([kd, kd, vd])):
                self.in_proj.load_shard(name, part)
            return "in_proj.weight"
        if rest in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
            self.in_proj.load_shard(rest.split(".")[0].removeprefix("in_proj_"), tensor)
            return "in_proj.weight"
        if rest == "in_proj_qkvz.weight":
            groups = tensor.view(hk, 2 * self.head_k_dim + 2 * r * self.head_v_dim, -1)
            q, k, v, z = groups.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim,
                                       r * self.head_v_dim], dim=1)
            flat = lambda x: x.reshape(-1, x.shape[-1])  # [groups * rows, H], group-major = head order
            for name, part in zip("qkvz", (q, k, v, z)):
                self.in_proj.load_shard(name, flat(part))
            return "in_proj.weight"
        if rest == "in_proj_ba.weight":
            b, a = tensor.view(hk, 2 * r, -1).split([r, r], dim=1)
            self.in_proj.load_shard("b", b.reshape(-1, b.shape[-1]))
            self.in_proj.load_shard("a", a.reshape(-1, a.shape[-1]))
            return "in_proj.weight"
        if rest == "conv1d.weight":  # [C, 1, K], channels [q | k | v] of all heads
            w = tensor.reshape(2 * kd + vd, -1)
            if self.tp.size > 1:
                w = torch.cat([self.tp.shard(part, 0, "conv channels") for part in w.split([kd, kd, vd])])
            copy_checked(self.conv_weight, w, "conv1d.weight")
            return "conv_weight"
        if rest == "out_proj.weight" and self.tp.size > 1:
            self.out_proj.load_full(tensor)
            return rest
        heads = {"dt_bias": self.dt_bias, "A_log": self.A_log}
        if rest in heads:
            copy_checked(heads[rest], self.tp.shard(tensor, 0, rest), rest)
            return rest
        params = {"norm.weight": self.norm.weight, "out_proj.weight": self.out_proj.weight}
        if rest in params:
            copy_checked(params[rest], tensor, rest)
            return rest
        return None

