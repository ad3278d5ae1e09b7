"""The q/k prep in the epilogue of the qkv projection's row GEMV (kernels/triton_gemv.py norm_gemv_rope_store;
the prep it replaces: kernels/triton_qk_prep.py). A launch with the epilogue lays its programs out by
`_rope_columns`: the first rot_programs programs own rotation pairs (BLOCK_N / 2 dims of a q or k head and their
partners half a head on), which each rotates in registers (`_rope_store_epilogue`); the rest own V columns. With
per-head q/k norms a head's norm needs all its dims, so its programs write their outputs and sums of squares and
the last of them to arrive (an arrival counter per head) norms and rotates the head (`_norm_rope_head`). Rounding as
the prep kernel's (its `_normed` and `_rotated`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.counters import arrival_counters
from specserve.kernels.rope_store import NORM_MAX_HEADS, RopeStore
from specserve.kernels.triton_qk_prep import _normed, _rotated


@triton.jit
def _rope_columns(pid, rot_programs, half, BLOCK_N: tl.constexpr):
    """The output columns [BLOCK_N] of program pid of a ROPE launch. Programs below rot_programs: P = BLOCK_N / 2
    dims j0 .. j0 + P of a q or k head (q heads first, then k heads, each 2 half wide) then their rotation partners
    j0 + half .. (half / P programs a head); the rest: contiguous V columns (rot_programs * BLOCK_N is where V
    starts)."""
    P: tl.constexpr = BLOCK_N // 2
    i = tl.arange(0, BLOCK_N)
    per_head = half // P
    head = pid // per_head
    rot = head * 2 * half + (i // P) * half + (pid % per_head) * P + i % P
    return tl.where(pid < rot_programs, rot, pid * BLOCK_N + i)


@triton.jit
def _rope_store_epilogue(y, m, pid, cols, y_ptr, stride_y, pos_ptr, loc_ptr, cs_ptr, kc_ptr, vc_ptr, rot_programs,
                         q_heads, half, stride_cs, stride_kcs, stride_kch, stride_vcs, stride_vch, part_ptr,
                         BLOCK_N: tl.constexpr, QK_NORM: tl.constexpr):
    """Row m's outputs y [BLOCK_N] (float32 of x.dtype values) at `cols` (_rope_columns), as the q/k prep kernel
    (kernels/triton_qk_prep.py, rotary on all of D = 2 half) leaves them without q/k norms: a rotation program
    rotates its P pairs (neox: x1 cos - x2 sin, x2 cos + x1 sin in float32, each rounded to x's dtype) at position
    pos[m] and writes them back into y (q and k in place); a k head's are also stored into the K cache at slot loc[m]
    ([S, Hkv, D], strides stride_kcs / stride_kch); a V program writes y and stores it into the V cache.
    QK_NORM: a rotation program cannot norm its head alone, so it writes y as it is and its sum of squares (float32)
    into part_ptr [M, q + k heads, programs a head]; the head's last program rotates it (_norm_rope_head)."""
    P: tl.constexpr = BLOCK_N // 2
    dt = y_ptr.dtype.element_ty
    slot = tl.load(loc_ptr + m).to(tl.int64)
    head_dim = 2 * half
    if QK_NORM and pid < rot_programs:
        tl.store(y_ptr + m * stride_y + cols, y.to(dt))
        tl.store(part_ptr + m * rot_programs + pid, tl.sum(y * y, 0))  # [M, heads, per_head] flat: m, then pid
    elif pid < rot_programs:
        pos = tl.load(pos_ptr + m).to(tl.int64)
        per_head = half // P
        head = pid // per_head
        band = (pid % per_head) * P + tl.arange(0, P)  # [P] frequency bands
        c = tl.load(cs_ptr + pos * stride_cs + band)
        s = tl.load(cs_ptr + pos * stride_cs + half + band)
        x1, x2 = tl.split(tl.permute(tl.reshape(y, [2, P]), [1, 0]))  # [P] each: the dims, their partners
        o1, o2 = _rotated(x1, x2, c, s, dt, True)
        out = tl.reshape(tl.permute(tl.join(o1, o2), [1, 0]), [BLOCK_N])  # in `cols` order again
        tl.store(y_ptr + m * stride_y + cols, out)
        if head >= q_heads:
            dims = cols - head * head_dim
            tl.store(kc_ptr + slot * stride_kcs + (head - q_heads) * stride_kch + dims,
                     out.to(kc_ptr.dtype.element_ty))
    else:
        tl.store(y_ptr + m * stride_y + cols, y.to(dt))
        v_col = cols - rot_programs * BLOCK_N
        tl.store(vc_ptr + slot * stride_vcs + (v_col // head_dim) * stride_vch + v_col % head_dim,
                 y.to(dt).to(vc_ptr.dtype.element_ty))


@triton.jit
def _norm_rope_head(pid, y_ptr, stride_y, pos_ptr, loc_ptr, cs_ptr, kc_ptr, part_ptr, count_ptr, qn_ptr, kn_ptr,
                    qk_eps, rot_programs, q_heads, half, stride_cs, stride_kcs, stride_kch,
                    M: tl.constexpr, BLOCK_N: tl.constexpr, QK_W_OFFSET: tl.constexpr, HALF_PAD: tl.constexpr,
                    PARTS_PAD: tl.constexpr):
    """QK_NORM's finish: the last of a q or k head's programs to arrive (counter per head, acq_rel) reads the
    head's y [D] of every row back (through L2) and the programs' sums of squares (in program order: deterministic),
    RMS-norms it with triton_qk_prep._normed (x's dtype, plain or zero-centred weight), rotates it, writes it back
    into y and, for a k head, into the K cache; then resets its counter for the next launch."""
    P: tl.constexpr = BLOCK_N // 2
    per_head = half // P
    head = pid // per_head
    # The barrier orders every thread's stores of y and the sums before the one-thread atomic, whose release makes
    # them visible at GPU scope to the program that acquires the last count.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + head, 1, sem="acq_rel")
    if arrived == per_head - 1:
        dt = y_ptr.dtype.element_ty
        i = tl.arange(0, HALF_PAD)  # [HALF_PAD] the head's first half of dims; + half: their partners
        i_ok = i < half
        j = tl.arange(0, PARTS_PAD)  # [PARTS_PAD] the head's programs
        is_k = head >= q_heads
        w_ptr = tl.where(is_k, kn_ptr, qn_ptr)  # this head's norm weight [D]
        for m in tl.static_range(M):
            row = y_ptr + m * stride_y + head * 2 * half
            x1 = tl.load(row + i, mask=i_ok, other=0.0, cache_modifier=".cg").to(tl.float32)[None, :]
            x2 = tl.load(row + half + i, mask=i_ok, other=0.0, cache_modifier=".cg").to(tl.float32)[None, :]
            parts = tl.load(part_ptr + m * rot_programs + head * per_head + j, mask=j < per_head, other=0.0,
                            cache_modifier=".cg")
            r = tl.rsqrt(tl.sum(parts, 0) / (2 * half) + qk_eps)
            # [1, HALF_PAD] tiles, normed and rounded as the prep kernel's (x's dtype: RopeStore.fits)
            x1 = tl.reshape(_normed(x1, r, w_ptr, i, i_ok, y_ptr, QK_W_OFFSET, True), [HALF_PAD])
            x2 = tl.reshape(_normed(x2, r, w_ptr + half, i, i_ok, y_ptr, QK_W_OFFSET, True), [HALF_PAD])
            pos = tl.load(pos_ptr + m).to(tl.int64)
            c = tl.load(cs_ptr + pos * stride_cs + i, mask=i_ok, other=0.0)
            s = tl.load(cs_ptr + pos * stride_cs + half + i, mask=i_ok, other=0.0)
            o1, o2 = _rotated(x1, x2, c, s, dt, True)
            tl.store(row + i, o1, mask=i_ok)
            tl.store(row + half + i, o2, mask=i_ok)
            if is_k:
                slot = tl.load(loc_ptr + m).to(tl.int64)
                k_row = kc_ptr + slot * stride_kcs + (head - q_heads) * stride_kch
                tl.store(k_row + i, o1.to(kc_ptr.dtype.element_ty), mask=i_ok)
                tl.store(k_row + half + i, o2.to(kc_ptr.dtype.element_ty), mask=i_ok)
        tl.store(count_ptr + head, 0)  # the next launch (or graph replay) counts from 0 again


def _rope_args(rope: RopeStore | None, y: torch.Tensor, m: int, block_n: int) -> tuple:
    """_gemv_kernel's ROPE arguments (pos, loc, cos_sin, k_cache, v_cache pointers; rot_programs, q_heads, half and
    the strides; with q/k norms the programs' sums of squares [M, rot_programs] float32, the arrival counters, the
    norm weights and eps); placeholders without an epilogue or without norms."""
    if rope is None:
        return (y, y, y, y, y, 0, 0, 1, 0, 0, 0, 0, 0, y, y, y, y, 0.0)
    rot_programs = (rope.num_q_heads + rope.num_kv_heads) * rope.head_dim // block_n
    kc, vc = rope.k_cache, rope.v_cache
    norm: tuple = (y, y, y, y, 0.0)
    if rope.has_norm:
        parts = torch.empty(m * rot_programs, dtype=torch.float32, device=y.device)  # [M, rot_programs]
        norm = (parts, _counters(y.device), rope.q_norm_w, rope.k_norm_w, float(rope.eps))
    return (rope.positions, rope.loc, rope.cos_sin_cache, kc, vc, rot_programs, rope.num_q_heads,
            rope.head_dim // 2, rope.cos_sin_cache.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            *norm)


def _rope_flags(rope: RopeStore | None, block_n: int) -> dict:
    """_gemv_kernel's QK_NORM constexprs."""
    if rope is None or not rope.has_norm:
        return dict(QK_NORM=False, QK_W_OFFSET=0.0, HALF_PAD=1, PARTS_PAD=1)
    half = rope.head_dim // 2
    return dict(QK_NORM=True, QK_W_OFFSET=float(rope.weight_offset), HALF_PAD=triton.next_power_of_2(half),
                PARTS_PAD=triton.next_power_of_2(half // (block_n // 2)))


def _counters(device: torch.device) -> torch.Tensor:
    """One arrival counter per q or k head of a launch with q/k norms (kernels/counters.py)."""
    return arrival_counters("gemv q/k norm", device, NORM_MAX_HEADS)
