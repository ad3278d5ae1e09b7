"""Triton softmax router (reference: kernels/reference.py softmax_topk): one program per token does the softmax
over its E expert logits, the top-k by k rounds of argmax (equal weights: the lower expert id first), and the
renormalisation, where torch needs a softmax, a top-k, a sum and a division (four launches per MoE layer). With a
gated shared expert fused into the routed ones (layers/moe.py) it also writes the shared expert's slot: id E, weight
sigmoid(the gate logit in column E)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
                         RENORM: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, SHARED: tl.constexpr):
    OUT_K: tl.constexpr = TOP_K + SHARED  # output row width
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    ok = e < num_experts
    x = tl.load(logits_ptr + t * stride_t + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)  # [E_PAD] softmax; padding lanes 0
    p = tl.where(ok, p, -1.0)  # never chosen
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, E_PAD), 0)  # the lowest expert id among equal weights
        tl.store(ids_ptr + t * OUT_K + j, idx.to(tl.int64))
        tl.store(w_ptr + t * OUT_K + j, best)
        total += best
        p = tl.where(e == idx, -1.0, p)
    if RENORM:
        k = tl.arange(0, K_PAD)  # TOP_K need not be a power of two (Qwen3-Next: 10)
        w = tl.load(w_ptr + t * OUT_K + k, mask=k < TOP_K, other=0.0)
        tl.store(w_ptr + t * OUT_K + k, w / total, mask=k < TOP_K)
    if SHARED:
        gate = tl.load(logits_ptr + t * stride_t + num_experts).to(tl.float32)
        tl.store(ids_ptr + t * OUT_K + TOP_K, num_experts.to(tl.int64))
        tl.store(w_ptr + t * OUT_K + TOP_K, 1.0 / (1.0 + tl.exp(-gate)))


def softmax_topk_triton(logits: torch.Tensor, top_k: int, renormalize: bool,
                        shared_gate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] float32, ids [T, K] int64); top_k a power of two is not required. With
    shared_gate, logits [T, E + 1] -> [T, K + 1] (reference.softmax_topk)."""
    t, cols = logits.shape
    num_experts = cols - 1 if shared_gate else cols
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out_k = top_k + int(shared_gate)
    w = torch.empty((t, out_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, out_k), dtype=torch.int64, device=logits.device)
    if t:
        _softmax_topk_kernel[(t,)](logits, w, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                   RENORM=renormalize, E_PAD=triton.next_power_of_2(num_experts),
                                   K_PAD=triton.next_power_of_2(top_k), SHARED=shared_gate, num_warps=4)
    return w, ids
