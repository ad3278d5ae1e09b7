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
from specserve.kernels import ops
from specserve.kvcache.cache_spec import RecurrentStateSpec
from specserve.layers.linear import Linear, MergedLinear, copy_checked
from specserve.layers.norm import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, cache_index: int, ssm_dtype: torch.dtype):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} must be a multiple of linear_num_key_heads="
                             f"{num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.cache_index = cache_index
        self.ssm_dtype = ssm_dtype
        self.in_proj = MergedLinear(hidden_size, {"qkv": self.conv_dim, "z": self.value_dim, "b": num_v_heads,
                                                  "a": num_v_heads})
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))  # [C, K] depthwise taps
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size)

    def cache_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(conv_shape=(self.conv_kernel - 1, self.conv_dim),
                                  ssm_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
                                  conv_dtype=self.conv_weight.dtype, ssm_dtype=self.ssm_dtype)

    def forward(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """h [T, H] -> [T, H]; reads and writes this layer's state slots."""
        t = h.shape[0]
        backend = fb.backend(CacheKind.RECURRENT)
        meta = backend.meta
        conv_state, ssm_state = backend.pool.layer(self.cache_index)  # [rows, S, K-1, C], [rows, S, Hv, Dk, Dv]
        proj = self.in_proj(h)  # [T, C + Vd + 2 Hv]
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
        if rest in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
            self.in_proj.load_shard(rest.split(".")[0].removeprefix("in_proj_"), tensor)
            return "in_proj.weight"
        if rest == "in_proj_qkvz.weight":
            r = self.num_v_heads // self.num_k_heads
            groups = tensor.view(self.num_k_heads, 2 * self.head_k_dim + 2 * r * self.head_v_dim, -1)
            q, k, v, z = groups.split([self.head_k_dim, self.head_k_dim, r * self.head_v_dim,
                                       r * self.head_v_dim], dim=1)
            flat = lambda x: x.reshape(-1, x.shape[-1])  # [groups * rows, H], group-major = head order
            self.in_proj.load_shard("qkv", torch.cat([flat(q), flat(k), flat(v)]))
            self.in_proj.load_shard("z", flat(z))
            return "in_proj.weight"
        if rest == "in_proj_ba.weight":
            r = self.num_v_heads // self.num_k_heads
            b, a = tensor.view(self.num_k_heads, 2 * r, -1).split([r, r], dim=1)
            self.in_proj.load_shard("b", b.reshape(-1, b.shape[-1]))
            self.in_proj.load_shard("a", a.reshape(-1, a.shape[-1]))
            return "in_proj.weight"
        if rest == "conv1d.weight":  # [C, 1, K]
            copy_checked(self.conv_weight, tensor.reshape(self.conv_dim, -1), "conv1d.weight")
            return "conv_weight"
        params = {"dt_bias": self.dt_bias, "A_log": self.A_log, "norm.weight": self.norm.weight,
                  "out_proj.weight": self.out_proj.weight}
        if rest in params:
            copy_checked(params[rest], tensor, rest)
            return rest
        return None

