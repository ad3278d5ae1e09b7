"""Triton absorbed-MLA attention for fixed-width batches (oracle: attention/torch_mla_backend.py, fixed-width path).

With the key and value up-projections absorbed, multi-head latent attention is attention with ONE key/value head
shared by all H query heads: the key is the cached latent row [c ; k_rope] (C = kv_lora_rank plus R rope dims) and
the value is the row's first C dims, c. A decode step's cost is reading those rows, so the kernel reads each key's
row once per program and uses it for a block of BLOCK_H query heads, twice: as the key ([BLOCK_H, C + R] x
[C + R, BLOCK_N] scores) and as the value ([BLOCK_H, BLOCK_N] x [BLOCK_N, C]). Heads are what fills the tile's M
dimension here (the GQA grouping of kernels/triton_attention.py taken to its limit: one KV head for all).

Layout (the fixed-width metadata of attention/torch_backend.py, `_fixed_meta`): every request b has `width` = W
new tokens, query i (0 <= i < W) at token b * W + i; kv_slots [bs, max_kv] maps key position -> cache slot, and
query i of b sees the key positions < seq_lens[b] - W + i + 1 (padded requests: seq_lens == W, slots 0, so they
see only their first keys). DeepSeek sparse attention additionally ANDs a selection [bs, 1, W, max_kv] bool.

Grid (bs * W, cdiv(H, BLOCK_H)): one program per (query token, block of BLOCK_H heads). It loops over blocks of
BLOCK_N key positions up to its query's causal length, which it reads from seq_lens in device memory; the grid
depends on shapes only, so a launch is CUDA-graph capturable and replays with new seq_lens / kv_slots / selection
copied into the same tensors. Online (flash) softmax in base 2 (scores pre-multiplied by scale * log2 e), running
max / sum and the [BLOCK_H, C] accumulator in float32.

C + R is usually not a power of two (DeepSeek: 512 + 64). Rather than pad C + R to the next power of two (1024:
nearly twice the loads and products), the row is handled as two tiles, c [BLOCK_N, BLOCK_C] and k_rope
[BLOCK_N, BLOCK_R], each padded to its own power of two with masks; the score is the sum of the two dots and the
value tile is the already-loaded c.

Key splits (flash decoding). A decode batch has few programs (bs * W * H / BLOCK_H: 2 at batch 1 with 64 heads)
against a GPU of 132 SMs, and each would walk thousands of keys alone. So the grid has a third axis of NUM_SPLITS:
split s of a query takes the s-th of NUM_SPLITS equal runs (whole key blocks) of that query's own causal length,
read from seq_lens on the device (so the work per split follows the live length, not the padded max_kv, and the
grid still depends on shapes only). With more than one split each program writes its unnormalised float32
accumulator with its running max and sum to a workspace, and a second kernel (`_mla_combine_kernel`, one program
per (query token, head, block of latent dims), all splits at once) merges the splits by the usual rescaling:
m = max_s m_s, l = sum_s l_s 2^(m_s - m), o = sum_s acc_s 2^(m_s - m) / l. A split past its query's length keeps
m = -1e30, l = 0 and adds nothing. The host picks NUM_SPLITS from shapes only: enough programs for about two per
SM (one per SM for 64-head programs, which run one to an SM), at most one split per 4 key blocks of max_kv (per
key block up to 2048 keys); one split (no workspace, no second kernel) once the batch alone fills the GPU.

Block sizes (defaults; each is a launch option, swept on the H200 with scripts/gpu/bench_mla.py):
BLOCK_H from `default_block_h` (64 heads a program for 16-bit q once the launch has enough query rows, fewer heads
are masked; 16 or 32 in small launches), BLOCK_N = 64 keys (32 when the row is wider than 256 and the program
has fewer than 64 heads, to bound the c tile's registers; at 64 heads 64 keys measured faster), num_warps
4 (8 when BLOCK_C > 256 and the launch is not small or q is float32, where the [BLOCK_H, BLOCK_C] float32
accumulator and the c tile dominate), num_stages 2. `F32_DOT` computes the products in
float32: set for CPU tensors only, where the Triton interpreter's bfloat16 tl.dot is wrong (triton 3.9);
probabilities are still rounded to the value dtype first, as on the GPU.

FP8 latent cache (kernels/reference_latent_fp8.py): the rows are fp8 with a float32 scale per 128 latent values and
one for the rope part; the key tile's c and k_rope parts are multiplied by their groups' scales in float32 and
rounded to q's dtype: the dots see what a 16-bit cache of the dequantised rows holds (the value tile is
that dequantised c).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.launch import grid_pdl, pdl_kwargs, pdl_wait, target_programs
from specserve.kernels.triton_dot import dot
from specserve.kvcache.cache_spec import LATENT_SCALE_GROUP, latent_scale_groups

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: exp2(m_old - m_new) stays NaN-free


@triton.jit
def _mla_decode_kernel(q_ptr, rows_ptr, scales_ptr, kv_slots_ptr, kv_rows_ptr, seq_lens_ptr, sel_ptr, out_ptr,
                       ws_acc_ptr, ws_ml_ptr,
                       qk_scale, num_heads, max_kv, kv_lora_rank, rope_dim, rope_group,
                       stride_qt, stride_qh, stride_rs, stride_ss, stride_kvb, stride_kvn, stride_sl,
                       stride_sb, stride_sw, stride_sn, stride_ot, stride_oh,
                       W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_ROPE: tl.constexpr,
                       HAS_SEL: tl.constexpr, HAS_ROWS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
                       SUB_C: tl.constexpr,
                       F32_DOT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """FP8: rows are fp8 with float32 scales [slots, G] (stride_ss per slot): latent column j in group j // GROUP,
    the rope part in group rope_group (kernels/reference_latent_fp8.py); SUB_C = min(GROUP, BLOCK_C) columns a
    scale in the key tile."""
    t = tl.program_id(0)  # query token b * W + i
    hb = tl.program_id(1)  # head block
    split = tl.program_id(2)  # run of key blocks
    pdl_wait(PDL)  # launched with PDL (launch.grid_pdl): wait for the queries, the latent rows and the selection
    b = t // W
    i = t % W
    seq_len = tl.load(seq_lens_ptr + b * stride_sl).to(tl.int32)
    kv_len = tl.minimum(seq_len - W + i + 1, max_kv)  # this query's causal length (>= 1)
    run = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N  # keys per split, whole blocks
    n_lo = split * run
    n_hi = tl.minimum(n_lo + run, kv_len)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_ok = h < num_heads
    c = tl.arange(0, BLOCK_C)  # [BLOCK_C] latent dims
    c_ok = c < kv_lora_rank
    q_row = q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh  # [BLOCK_H, 1]
    q_c = tl.load(q_row + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
    if HAS_ROPE:
        r = tl.arange(0, BLOCK_R)  # [BLOCK_R] rope dims, after the C latent dims
        r_ok = r < rope_dim
        q_r = tl.load(q_row + kv_lora_rank + r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                      other=0.0)  # [BLOCK_H, BLOCK_R]

    m_i = tl.full([BLOCK_H], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    if HAS_ROWS:  # token rows: request b's keys are row kv_rows[b] of kv_slots (the page table itself)
        kv_row = tl.load(kv_rows_ptr + b).to(tl.int64)
    else:
        kv_row = b.to(tl.int64)
    slots_row = kv_slots_ptr + kv_row * stride_kvb
    for n0 in range(n_lo, n_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_ok = n < n_hi
        slot = tl.load(slots_row + n * stride_kvn, mask=key_ok, other=0).to(tl.int64)  # [BLOCK_N]
        row = rows_ptr + slot[:, None] * stride_rs  # [BLOCK_N, 1]
        # the latent rows' c part, loaded once: the key's first C dims for every head, then the value
        kc = tl.load(row + c[None, :], mask=key_ok[:, None] & c_ok[None, :], other=0.0)
        if FP8:  # dequantised in float32 by each column's group scale, then rounded as a 16-bit cache would hold it
            # one scale per SUB_C columns (a group, or the whole tile when it is narrower), broadcast over them:
            # a [BLOCK_N, BLOCK_C] float32 tile of per-column scales would not fit the pipeline's shared memory
            j = tl.arange(0, BLOCK_C // SUB_C)  # [CHUNKS]
            sc = tl.load(scales_ptr + slot[:, None] * stride_ss + ((j * SUB_C) // GROUP)[None, :],
                         mask=key_ok[:, None] & (j * SUB_C < kv_lora_rank)[None, :], other=1.0)  # [BLOCK_N, CHUNKS]
            kc = tl.reshape(tl.reshape(kc.to(tl.float32), [BLOCK_N, BLOCK_C // SUB_C, SUB_C]) * sc[:, :, None],
                            [BLOCK_N, BLOCK_C])
        kc = kc.to(q_c.dtype)
        s = dot(q_c, tl.trans(kc), F32_DOT, PRECISION)  # [BLOCK_H, BLOCK_N]
        if HAS_ROPE:
            kr = tl.load(row + kv_lora_rank + r[None, :], mask=key_ok[:, None] & r_ok[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_R]
            if FP8:  # the rope part: one scale per row
                kr = kr.to(tl.float32) * tl.load(scales_ptr + slot * stride_ss + rope_group, mask=key_ok,
                                                 other=1.0)[:, None]
            kr = kr.to(q_c.dtype)
            s += dot(q_r, tl.trans(kr), F32_DOT, PRECISION)
        visible = key_ok
        if HAS_SEL:
            sel = tl.load(sel_ptr + b.to(tl.int64) * stride_sb + i * stride_sw + n * stride_sn, mask=key_ok,
                          other=0)
            visible = visible & (sel != 0)
        s = tl.where(visible[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_H]
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]; 0 where hidden
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.to(q_c.dtype), kc, F32_DOT, PRECISION)  # [BLOCK_H, BLOCK_C]
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & c_ok[None, :])
    else:  # workspace [tokens, NUM_SPLITS, H, C] float32 and [tokens, NUM_SPLITS, 2, H] (max, sum)
        part = t.to(tl.int64) * NUM_SPLITS + split
        tl.store(ws_acc_ptr + (part * num_heads + h[:, None]) * kv_lora_rank + c[None, :], acc,
                 mask=h_ok[:, None] & c_ok[None, :])
        tl.store(ws_ml_ptr + part * 2 * num_heads + h, m_i, mask=h_ok)
        tl.store(ws_ml_ptr + part * 2 * num_heads + num_heads + h, l_i, mask=h_ok)


@triton.jit
def _mla_combine_kernel(ws_acc_ptr, ws_ml_ptr, out_ptr, num_heads, kv_lora_rank, num_splits, stride_ot, stride_oh,
                        BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """One program per (query token, head, BLOCK_C latent dims): all the token's splits at once, reduced in
    registers (no serial walk over the splits)."""
    t = tl.program_id(0)  # query token
    h = tl.program_id(1)  # head
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] this program's latent dims
    pdl_wait(PDL)
    sp = tl.arange(0, BLOCK_S)  # [BLOCK_S] splits
    s_ok = sp < num_splits
    part = t.to(tl.int64) * num_splits + sp  # [BLOCK_S]
    m_s = tl.load(ws_ml_ptr + part * 2 * num_heads + h, mask=s_ok, other=_NEG_BIG)
    l_s = tl.load(ws_ml_ptr + part * 2 * num_heads + num_heads + h, mask=s_ok, other=0.0)
    ok = s_ok[:, None] & (c < kv_lora_rank)[None, :]
    a_s = tl.load(ws_acc_ptr + (part[:, None] * num_heads + h) * kv_lora_rank + c[None, :], mask=ok,
                  other=0.0)  # [BLOCK_S, BLOCK_C]
    m = tl.max(m_s, axis=0)
    beta = tl.math.exp2(m_s - m)  # [BLOCK_S]; 0 for splits past the query's keys (m_s = -1e30)
    l_sum = tl.sum(l_s * beta, axis=0)
    o = tl.sum(a_s * beta[:, None], axis=0) / tl.where(l_sum > 0.0, l_sum, 1.0)  # [BLOCK_C]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + c, o.to(out_ptr.dtype.element_ty),
             mask=c < kv_lora_rank)


def few_rows(num_tokens: int, max_kv: int) -> bool:
    """A launch too small for 64-head programs: under 4 query tokens, or under 8 over at most 2048 keys (a DSA
    verify's 4 tokens over their top-k rows), where more, smaller programs win."""
    return num_tokens < 4 or (num_tokens < 8 and max_kv <= 2048)


def default_block_h(num_tokens: int, num_heads: int, max_kv: int, wide: bool) -> int:
    """Heads per program from shapes only. A launch of enough query rows: 64 heads in one program for 16-bit q with
    64 or more heads (each latent row read once for all of them, and M = 64 fills a warpgroup's tensor-core tile;
    float32 tiles of 64 x C would not fit), else 32. A small launch (few_rows): smaller blocks for more programs, 32
    heads over long contexts (the key splits already make enough programs), else 16 (tl.dot's smallest M).
    wide: q is float32."""
    if not few_rows(num_tokens, max_kv):
        return 64 if num_heads >= 64 and not wide else (32 if num_heads > 16 else 16)
    return 32 if num_heads > 16 and max_kv >= 16384 else 16


SHORT_KV = 2048  # up to this many keys (a DSA top-k's chosen rows) a split may be a single key block


def num_key_splits(num_programs: int, max_kv: int, block_n: int, target: int) -> int:
    """Key splits for a launch of `num_programs` (query token, head block) programs: as many as keep the launch
    within `target` programs (never a partly filled extra wave, which measured as slow as a whole one), at most one
    per 4 key blocks of max_kv (one per key block up to SHORT_KV keys: the sparse MLA over a top-k's chosen rows at
    batch 1 measured fastest with splits of one block), at least 1. Shapes only."""
    if num_programs >= target:
        return 1
    most = max(1, triton.cdiv(max_kv, (1 if max_kv <= SHORT_KV else 4) * block_n))
    return max(1, min(most, target // num_programs))


def split_target(device: torch.device, block_h: int) -> int:
    """Programs a launch's key splits aim for: about two per SM, one per SM for 64-head programs (a [64, C] float32
    accumulator each: one program to an SM, measured faster than two over a top-k's chosen rows). Under
    the interpreter 8 (4 for 64 heads): a few splits, so CPU tests run the split path too."""
    return target_programs(device, cpu=8) // (2 if block_h >= 64 else 1)


def mla_decode_triton(q: torch.Tensor, rows: torch.Tensor, kv_slots: torch.Tensor, seq_lens: torch.Tensor,
                      width: int, scale: float, kv_lora_rank: int, selection: torch.Tensor | None = None, *,
                      block_h: int | None = None, block_n: int | None = None, num_splits: int | None = None,
                      num_warps: int | None = None, num_stages: int = 2, out: torch.Tensor | None = None,
                      kv_rows: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA attention of a fixed-width batch.

    q [bs * width, H, C + R] (latent-absorbed nope part | rope part); rows [slots, C + R] the latent cache;
    kv_slots [bs, max_kv] int64; seq_lens [bs] int64 (device); selection None or [bs, 1, width, max_kv] bool
    -> out [bs * width, H, C] in q's dtype. Launch shape from host ints and tensor shapes only: capturable.
    kv_rows [bs] int64: request b's keys are kv_slots[kv_rows[b]] (kv_slots then any [rows, max_kv] table, e.g.
    the page table; a prefill runs as token rows: width 1, each token its own request with its causal length).
    block_h: heads per program (power of two >= 16; default 32 for more than 16 heads and 4 or more tokens, else
    16); block_n: keys per step (default 64 for rows of at most 256 padded dims or 64-head programs, else 32);
    num_splits: key splits per query (default from the launch size, `num_key_splits`);
    num_warps (default from C and the launch size), num_stages: Triton's launch options.
    scales [slots, G] float32: rows are an FP8 latent cache (float8_e4m3fn / float8_e5m2), each group of a row
    dequantised by its scale inside the key tile (kernels/reference_latent_fp8.py); None: a 16-bit or float32
    cache."""
    num_tokens, num_heads, dim = q.shape
    max_kv = kv_slots.shape[1]
    bs = kv_slots.shape[0] if kv_rows is None else kv_rows.shape[0]
    c, rope = kv_lora_rank, dim - kv_lora_rank
    assert 0 < c <= dim and rows.shape[1] == dim and num_tokens == bs * width and seq_lens.shape == (bs,)
    assert kv_rows is None or (kv_rows.dtype == torch.int64 and selection is None)
    assert q.stride(-1) == 1 and rows.stride(-1) == 1
    fp8 = scales is not None
    assert fp8 == (rows.element_size() == 1), "an fp8 latent cache and its group scales go together"
    groups = latent_scale_groups(dim, rope)
    if fp8:
        assert scales.shape == (rows.shape[0], groups) and scales.dtype == torch.float32 and scales.stride(1) == 1
    if out is None:
        out = torch.empty((num_tokens, num_heads, c), dtype=q.dtype, device=q.device)
    assert out.shape == (num_tokens, num_heads, c) and out.dtype == q.dtype and out.stride(-1) == 1
    if num_tokens == 0:
        return out
    if block_h is None:
        block_h = default_block_h(num_tokens, num_heads, max_kv, q.dtype == torch.float32)
    block_c = max(16, triton.next_power_of_2(c))
    block_r = max(16, triton.next_power_of_2(rope)) if rope > 0 else 16
    if block_n is None:  # 64 keys a step for narrow rows, and at 64-head programs (measured faster there)
        block_n = 64 if block_c + block_r <= 256 or block_h >= 64 else 32
    if selection is not None:
        assert selection.shape == (bs, 1, width, max_kv) and selection.dtype == torch.bool
        sel = selection.view(torch.uint8)  # same bytes; a plain byte pointer for the kernel
        sel_strides = (sel.stride(0), sel.stride(2), sel.stride(3))
    else:
        sel, sel_strides = kv_slots, (0, 0, 0)  # unused
    f32_dot = not q.is_cuda
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # float32: no TF32, like the torch oracle
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = num_key_splits(num_tokens * head_blocks, max_kv, block_n, split_target(q.device, block_h))
    if num_splits > 1:
        ws_acc = torch.empty((num_tokens, num_splits, num_heads, c), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((num_tokens, num_splits, 2, num_heads), dtype=torch.float32, device=q.device)
    else:
        ws_acc = ws_ml = out  # unused
    if num_warps is None:  # 16-bit q and a small launch: small head blocks, for which 4 warps suffice
        num_warps = 4 if block_c <= 256 or (few_rows(num_tokens, max_kv) and q.dtype != torch.float32) else 8
    pdl = grid_pdl(q.device, num_tokens * head_blocks * num_splits, num_tokens)
    _mla_decode_kernel[(num_tokens, head_blocks, num_splits)](
        q, rows, scales if fp8 else rows, kv_slots, kv_slots if kv_rows is None else kv_rows, seq_lens, sel, out,
        ws_acc, ws_ml,
        scale * _LOG2E, num_heads, max_kv, c, rope, groups - 1,
        q.stride(0), q.stride(1), rows.stride(0), scales.stride(0) if fp8 else 0, kv_slots.stride(0),
        kv_slots.stride(1), seq_lens.stride(0),
        *sel_strides, out.stride(0), out.stride(1),
        W=width, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_R=block_r, NUM_SPLITS=num_splits,
        HAS_ROPE=rope > 0, HAS_SEL=selection is not None, HAS_ROWS=kv_rows is not None, FP8=fp8,
        GROUP=LATENT_SCALE_GROUP, SUB_C=min(LATENT_SCALE_GROUP, block_c), F32_DOT=f32_dot,
        PRECISION=precision, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **pdl_kwargs(bool(pdl)),
    )
    if num_splits > 1:
        block_s = max(2, triton.next_power_of_2(num_splits))
        combine_c = max(16, min(block_c, 4096 // block_s))  # [splits, dims] tile of at most 4096 floats a program
        grid = (num_tokens, num_heads, triton.cdiv(c, combine_c))
        pdl = grid_pdl(q.device, grid[0] * grid[1] * grid[2], num_tokens)
        _mla_combine_kernel[grid](
            ws_acc, ws_ml, out, num_heads, c, num_splits, out.stride(0), out.stride(1),
            BLOCK_S=block_s, BLOCK_C=combine_c, PDL=pdl, num_warps=4, **pdl_kwargs(bool(pdl)))
    return out
