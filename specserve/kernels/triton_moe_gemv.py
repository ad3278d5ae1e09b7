"""The MoE of one token as two GEMVs (reference: kernels/reference.py fused_moe; the grouped-GEMM path it can
replace at one token: kernels/triton_moe.py fused_moe's direct path).

At one token a decode step's MoE is memory-bound on the chosen experts' weights (Qwen3-30B-A3B: 8 of 128 experts,
50 MB of gate/up and 25 MB of down rows a layer). The grouped GEMM multiplies them through 16-row tensor-core tiles
(15 of them padding) and sums the top-k outputs in the down GEMM's last program of each column block (an arrival
counter: a dependent round trip at the end of the launch). Here, as the dense decode GEMVs of
kernels/triton_gemv.py do:

* `_gate_up_gemv_kernel`, grid (top_k * cdiv(I, BLOCK_N)): program p takes expert slot k = p // column blocks and
  BLOCK_N columns of I, reads those gate rows and up rows of w13[ids[k]] in BLOCK_K steps (elementwise products
  into [BLOCK_N, BLOCK_K] float32 tiles, reduced over K once after the loop) and writes silu(gate) * up into
  act [top_k, I];
* `_down_gemv_kernel`, grid (cdiv(H, BLOCK_N)): program p takes BLOCK_N columns of H for every expert slot in turn
  (one step of all of I an expert, the next expert's rows loaded while this one's are summed) and accumulates
  sum_k w[k] * (act[k] @ w2[ids[k]]^T) in registers: no per-expert output buffer, no counter, no sum launch.

Rounding follows the reference (and the grouped path): gate and up each rounded to x's dtype, silu(gate) rounded,
its product with up rounded; each expert's down output rounded to x's dtype, then weighted and summed in float32 in
k order and rounded once. Only the order of the float32 sums inside a product differs. Capturable: grids and
buffers from shapes only, expert ids read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, hidden, inter, stride_we, stride_wn,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(inter, BLOCK_N)
    slot = pid // col_blocks
    e = tl.load(ids_ptr + slot).to(tl.int64)
    n = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    n_ok = n < inter
    ks = tl.arange(0, BLOCK_K)
    gate_rows = w_ptr + e * stride_we + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_wn  # the up rows follow the gate rows
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + ks
        k_ok = k < hidden
        a = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_K]
        mask = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.load(gate_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * a
        acc_u += tl.load(up_rows + k[None, :], mask=mask, other=0.0).to(tl.float32) * a
    dt = act_ptr.dtype.element_ty
    gate = tl.sum(acc_g, 1).to(dt).to(tl.float32)  # [BLOCK_N]
    up = tl.sum(acc_u, 1).to(dt).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
    tl.store(act_ptr + slot * inter + n, act.to(dt), mask=n_ok)


@triton.jit
def _down_gemv_kernel(act_ptr, w_ptr, ids_ptr, wts_ptr, out_ptr, hidden, inter, stride_we, stride_wn,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of H
    n_ok = n < hidden
    k = tl.arange(0, BLOCK_K)  # BLOCK_K >= I: an expert's rows in one step
    k_ok = k < inter
    mask = n_ok[:, None] & k_ok[None, :]
    rows = n.to(tl.int64)[:, None] * stride_wn + k[None, :]  # [BLOCK_N, BLOCK_K] offsets within an expert
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for slot in tl.range(0, TOP_K, num_stages=NUM_STAGES):  # fixed order: the reference's k-order sum
        e = tl.load(ids_ptr + slot).to(tl.int64)
        w = tl.load(w_ptr + e * stride_we + rows, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(act_ptr + slot * inter + k, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.sum(w * a[None, :], 1).to(dt).to(tl.float32)  # this expert's output, rounded to x's dtype
        total += tl.load(wts_ptr + slot).to(tl.float32) * y
    tl.store(out_ptr + n, total.to(dt), mask=n_ok)


def moe_gemv_configs(top_k: int, hidden: int, inter: int) -> tuple[dict, dict]:
    """(gate/up, down) launch parameters from the shapes (scripts/gpu/bench_moe.py --gemv-sweep tries others: on
    Qwen3-30B-A3B's experts none beat the grouped path by more than ~3%, BENCHMARKS §35.5). Gate/up: 512-column K
    steps (1 kB of each bf16 row), 4 columns (8 weight rows) a program. Down: an expert's whole I a step (padded to
    a power of two), 2 columns a program."""
    gate_up = dict(BLOCK_N=4, BLOCK_K=min(512, triton.next_power_of_2(hidden)), num_warps=4, num_stages=3)
    down = dict(BLOCK_N=2, BLOCK_K=triton.next_power_of_2(inter), num_warps=4, num_stages=3)
    return gate_up, down


def fits(inter: int) -> bool:
    """Whether the down GEMV can take an expert's I in one step (a [BLOCK_N, next_pow2(I)] tile)."""
    return triton.next_power_of_2(inter) <= 4096


def moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, tiles: tuple[dict, dict] | None = None) -> torch.Tensor:
    """x [1, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [1, K] float32; topk_ids [1, K]
    int64 -> [1, H] in x's dtype, in two launches. tiles: (gate/up, down) launch parameters in place of
    moe_gemv_configs'. The caller checks the shapes (triton_moe.fused_moe) and `fits`."""
    hidden = x.shape[1]
    inter = w2.shape[2]
    top_k = topk_ids.shape[1]
    cfg_gu, cfg_down = moe_gemv_configs(top_k, hidden, inter) if tiles is None else tiles
    ids = topk_ids.reshape(-1)  # [K]
    act = torch.empty((top_k, inter), dtype=x.dtype, device=x.device)  # [K, I]
    out = torch.empty((1, hidden), dtype=x.dtype, device=x.device)  # [1, H]
    _gate_up_gemv_kernel[(top_k * triton.cdiv(inter, cfg_gu["BLOCK_N"]),)](
        x, w13, ids, act, hidden, inter, w13.stride(0), w13.stride(1), BLOCK_N=cfg_gu["BLOCK_N"],
        BLOCK_K=cfg_gu["BLOCK_K"], NUM_STAGES=cfg_gu["num_stages"], num_warps=cfg_gu["num_warps"],
        num_stages=cfg_gu["num_stages"])
    assert cfg_down["BLOCK_K"] >= inter, "the down GEMV takes an expert's I in one step"
    _down_gemv_kernel[(triton.cdiv(hidden, cfg_down["BLOCK_N"]),)](
        act, w2, ids, topk_weights.reshape(-1), out, hidden, inter, w2.stride(0), w2.stride(1), TOP_K=top_k,
        BLOCK_N=cfg_down["BLOCK_N"], BLOCK_K=cfg_down["BLOCK_K"], NUM_STAGES=cfg_down["num_stages"],
        num_warps=cfg_down["num_warps"], num_stages=cfg_down["num_stages"])
    return out
