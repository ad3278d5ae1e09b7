"""Single-row GEMV kernel designs side by side on decode weight shapes (bfloat16, M = 1): where the bandwidth of
specserve's GEMV (kernels/triton_gemv.py) goes against cuBLAS and a pure streaming read of the same bytes.

    cd scripts/gpu && python3 gemv_lab.py [--shapes 8b 30b] [--variants cublas ours read tma splitk persist] [--quick]
    python3 gemv_lab.py --overlap | --norm | --wide | --late     (one experiment each, below)

Each timing is a CUDA graph of L = 8 back-to-back calls on 8 distinct weights (as the layers of a model), the L2
flushed between replays, the median of --iters replays; per call us and TB/s of weight bytes. Designs:
  ours     kernels/triton_gemv.gemv with its tuned config (the product);
  cublas   F.linear;
  read     a streaming sum over the weight's bytes (several grids): the read ceiling;
  tma      each program BLOCK_N rows over all of K, weight tiles by TMA descriptor loads, pipelined;
  splitk   `ours`' tiles over K / S per program (grid N/BLOCK_N x S), partial sums to a workspace, the last program
           of a column block (an atomic counter, reset by it) sums the S partials in a fixed order: deterministic;
  persist  a grid of P programs per SM, each walking its row blocks x K steps as one flat pipelined loop (no
           pipeline drain between row blocks).
Every variant's output is checked against F.linear (atol 2e-2) before it is timed. Experiments:
  --overlap  a bulk / per-line L2 prefetch of a GEMV's weights before a spin standing for prep + attention;
  --norm     the fused norm GEMVs' statistics in K / BLOCK_K steps against one wide step (triton_gemv.norm_block);
  --wide     the fused GEMVs with K steps of half or all of K;
  --late     the fused norm GEMVs with the statistics prologue against LATE_RSTD (in the K loop, 1/rms after it).
Results: BENCHMARKS.md §33.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_moe import l2_flush, time_ms  # this folder: the scripts run as files

from specserve.graphs.capture import capture_graph
from specserve.kernels.triton_gemv import gemv, gemv_config, norm_gemv

DTYPE = torch.bfloat16
SHAPES = {  # (rows, K) of the decode projections (gate_up as a plain 2I-row GEMV)
    "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "30b": [(5120, 2048), (2048, 4096)],
}


@triton.jit
def _read_kernel(w_ptr, out_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    base = pid.to(tl.int64) * CHUNK
    for i in tl.range(0, CHUNK, BLOCK, num_stages=NUM_STAGES):
        idx = base + i + offs
        acc += tl.load(w_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_launch(w: torch.Tensor, out: torch.Tensor, programs: int, stages: int):
    """A pure streaming read of w with `programs` programs of 4096-element steps: a zero-argument launch."""
    n, block = w.numel(), 4096
    chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
    grid = (triton.cdiv(n, chunk),)

    def launch() -> None:  # returns nothing (Case.time_us checks what a call returns)
        _read_kernel[grid](w, out, n, CHUNK=chunk, BLOCK=block, NUM_STAGES=stages, num_warps=4, num_stages=stages)
    return launch


@triton.jit
def _tma_kernel(x_ptr, w_desc, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    row0 = pid * BLOCK_N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([row0, k0]).to(tl.float32)
        x = tl.load(x_ptr + k0 + ks).to(tl.float32)
        acc += w * x[None, :]
    rows = row0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, K_SPLIT, stride_w, SPLITS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_lo = s * K_SPLIT
    for k0 in tl.range(0, K_SPLIT, BLOCK_K, num_stages=NUM_STAGES):
        k = k_lo + k0 + ks
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k).to(tl.float32)
        acc += w * x[None, :]
    tl.store(ws_ptr + s * N + rows, tl.sum(acc, 1), mask=row_ok)
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if old == SPLITS - 1:
        total = tl.zeros([BLOCK_N], tl.float32)
        for i in tl.static_range(SPLITS):
            total += tl.load(ws_ptr + i * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=row_ok)
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _persist_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    mine = tl.cdiv(n_blocks - pid, nprog)
    ks = tl.arange(0, BLOCK_K)
    bn = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for it in tl.range(0, mine * k_steps, num_stages=NUM_STAGES):
        b = it // k_steps
        kk = it - b * k_steps
        rows = (pid + b * nprog) * BLOCK_N + bn
        row_ok = rows < N
        k = kk * BLOCK_K + ks
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + k[None, :], mask=row_ok[:, None],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k).to(tl.float32)
        acc += w * x[None, :]
        if kk == k_steps - 1:
            tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=row_ok)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)


@triton.jit
def _l2_prefetch_kernel(w_ptr, dummy_ptr, n_elems, CHUNK: tl.constexpr, LANES: tl.constexpr, HINT: tl.constexpr):
    """Bulk-prefetch w's elements into L2: lane i of program p issues one cp.async.bulk.prefetch.L2 of CHUNK
    elements (fire and forget: the program exits at once)."""
    pid = tl.program_id(0)
    lane = tl.arange(0, LANES)
    start = (pid * LANES + lane).to(tl.int64) * CHUNK
    ok = start < n_elems
    nbytes = (tl.minimum(n_elems - start, CHUNK) * 2).to(tl.int32)
    addr = w_ptr + start
    if HINT:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [addr, nbytes, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [addr, nbytes, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(dummy_ptr + lane, r, mask=r != 0)


@triton.jit
def _l2_line_prefetch_kernel(w_ptr, dummy_ptr, n_elems, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """prefetch.global.L2 of every 128-byte line of w: program p's lanes walk its CHUNK-element span 64 elements
    (one line) apart."""
    pid = tl.program_id(0)
    lane = tl.arange(0, LANES)
    base = pid.to(tl.int64) * CHUNK
    for i in range(0, CHUNK, LANES * 64):
        start = base + i + lane * 64
        ok = start < n_elems
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [w_ptr + start, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(dummy_ptr + lane, r, mask=r != 0)


def l2_line_prefetch(w: torch.Tensor, dummy: torch.Tensor, programs: int = 132, lanes: int = 256):
    n = w.numel()
    chunk = triton.cdiv(triton.cdiv(n, programs), lanes * 64) * lanes * 64
    _l2_line_prefetch_kernel[(triton.cdiv(n, chunk),)](w, dummy, n, CHUNK=chunk, LANES=lanes, num_warps=lanes // 32)


def l2_prefetch(w: torch.Tensor, dummy: torch.Tensor, programs: int = 32, lanes: int = 128, hint: bool = False):
    n = w.numel()
    chunk = triton.cdiv(triton.cdiv(n, programs * lanes), 64) * 64  # elements a lane (128-byte multiples)
    _l2_prefetch_kernel[(triton.cdiv(n, chunk * lanes),)](w, dummy, n, CHUNK=chunk, LANES=lanes, HINT=hint,
                                                           num_warps=lanes // 32)


class Case:
    def __init__(self, rows: int, k: int, layers: int, g: torch.Generator):
        self.rows, self.k = rows, k
        self.ws = [(torch.randn(rows, k, generator=g, device="cuda") * k ** -0.5).to(DTYPE) for _ in range(layers)]
        self.x = torch.randn(1, k, generator=g, device="cuda").to(DTYPE)
        self.want = [F.linear(self.x, w) for w in self.ws]
        self.nbytes = rows * k * 2

    def time_us(self, call, iters: int, flush, check: bool = True) -> float:
        """call(layer) -> y [1, rows] (or None for the read probe); checked, then timed as a graph of L calls."""
        for layer in (0, len(self.ws) - 1) if check else ():
            y = call(layer)
            if y is not None:
                torch.testing.assert_close(y.view(1, -1), self.want[layer], atol=2e-2, rtol=2e-2)
        graph, _, _ = capture_graph(lambda: [call(layer) for layer in range(len(self.ws))], None)
        us = time_ms(graph.replay, iters, 5, flush) * 1e3 / len(self.ws)
        del graph
        return us


def tbs(c: Case, us: float) -> str:
    return f"{us:8.2f} us {c.nbytes / us / 1e6:6.2f} TB/s"


def timed(c: Case, label: str, call, iters: int, flush) -> tuple[str, float]:
    """(label, us a call), or (label with the error, inf) for a config TMA or the compiler refuses."""
    try:
        return label, c.time_us(call, iters, flush)
    except Exception as e:
        return f"{label} failed: {str(e).splitlines()[0][:80]}", float("inf")


def run_ours(c: Case, iters, flush):
    cfg = gemv_config(1, c.rows, c.k, DTYPE)
    return [(f"tuned {cfg}", c.time_us(lambda i: gemv(c.x, c.ws[i]), iters, flush))]


def run_cublas(c: Case, iters, flush):
    return [("F.linear", c.time_us(lambda i: F.linear(c.x, c.ws[i]), iters, flush))]


def run_read(c: Case, iters, flush, quick):
    out = torch.empty(4096, device="cuda")
    res = []
    for programs, stages in itertools.product((264, 528, 1056), (2, 4)):
        launches = [read_launch(w, out, programs, stages) for w in c.ws]
        res.append((f"P{programs} B4096 s{stages}", c.time_us(lambda layer, ls=launches: ls[layer](), iters, flush)))
    return res


def run_tma(c: Case, iters, flush, quick):
    from triton.tools.tensor_descriptor import TensorDescriptor
    res = []
    grid_n = (8, 16, 32) if not quick else (16,)
    for bn, bk, stages, warps in itertools.product(grid_n, (128, 256), (3, 4, 6), (4,)):
        if c.k % bk:
            continue
        descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in c.ws]
        y = torch.empty(1, c.rows, dtype=DTYPE, device="cuda")

        def call(layer, bn=bn, bk=bk, stages=stages, warps=warps, descs=descs, y=y):
            _tma_kernel[(triton.cdiv(c.rows, bn),)](c.x, descs[layer], y, c.rows, c.k, BLOCK_N=bn, BLOCK_K=bk,
                                                   NUM_STAGES=stages, num_warps=warps, num_stages=stages)
            return y
        res.append(timed(c, f"N{bn} K{bk} s{stages} w{warps}", call, iters, flush))
    return res


def run_splitk(c: Case, iters, flush, quick):
    base = gemv_config(1, c.rows, c.k, DTYPE)
    res = []
    ws = torch.empty(8 * c.rows, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(triton.cdiv(c.rows, 2), dtype=torch.int32, device="cuda")
    for splits, bn, bk in itertools.product((2, 4, 8), (base["BLOCK_N"], 2 * base["BLOCK_N"]), (base["BLOCK_K"],)):
        if c.k % (splits * bk):
            continue
        y = torch.empty(1, c.rows, dtype=DTYPE, device="cuda")

        def call(layer, splits=splits, bn=bn, bk=bk, y=y):
            _splitk_kernel[(triton.cdiv(c.rows, bn), splits)](
                c.x, c.ws[layer], y, ws, cnt, c.rows, c.k, c.k // splits, c.ws[layer].stride(0), SPLITS=splits,
                BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=base["num_stages"], num_warps=base["num_warps"],
                num_stages=base["num_stages"])
            return y
        res.append(timed(c, f"S{splits} N{bn} K{bk}", call, iters, flush))
    return res


def run_persist(c: Case, iters, flush, quick):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = []
    y = torch.empty(1, c.rows, dtype=DTYPE, device="cuda")
    for per_sm, bn, bk, stages in itertools.product((2, 4), (8, 16), (256, 512), (3, 4)):
        if c.k % bk:
            continue
        programs = min(sms * per_sm, triton.cdiv(c.rows, bn))

        def call(layer, programs=programs, bn=bn, bk=bk, stages=stages):
            _persist_kernel[(programs,)](c.x, c.ws[layer], y, c.rows, c.k, c.ws[layer].stride(0), BLOCK_N=bn,
                                         BLOCK_K=bk, NUM_STAGES=stages, num_warps=4, num_stages=stages)
            return y
        res.append(timed(c, f"P{programs} N{bn} K{bk} s{stages}", call, iters, flush))
    return res


def overlap_row(c: Case, spin_us: float, dummy: torch.Tensor, iters: int, flush) -> str:
    cycles = int(spin_us * 1.98e3)
    line = f"({c.rows}, {c.k}) {c.nbytes / 1e6:5.1f} MB, spin {spin_us} us:"
    spin = c.time_us(lambda i: torch.cuda._sleep(cycles), iters, flush)
    base = c.time_us(lambda i: (torch.cuda._sleep(cycles), gemv(c.x, c.ws[i]))[1], iters, flush)
    line += f" spin {spin:5.2f} | spin+gemv {base:5.2f}"
    side = torch.cuda.Stream()
    kinds = {"bulk": lambda w: l2_prefetch(w, dummy, 132, 128, False),
             "line": lambda w: l2_line_prefetch(w, dummy, 132, 256)}
    for kind, pf in kinds.items():
        def serial(i, pf=pf):
            pf(c.ws[i])
            torch.cuda._sleep(cycles)
            return gemv(c.x, c.ws[i])

        def fork(i, pf=pf):
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                pf(c.ws[i])
            torch.cuda._sleep(cycles)
            cur.wait_stream(side)
            return gemv(c.x, c.ws[i])
        try:
            alone = c.time_us(lambda i, pf=pf: pf(c.ws[i]), iters, flush)
            us_s = c.time_us(serial, iters, flush)
            us_f = c.time_us(fork, iters, flush)
            line += f" | {kind}: alone {alone:5.2f} serial {us_s:5.2f} fork {us_f:5.2f}"
        except Exception as e:
            line += f" | {kind} failed {str(e).splitlines()[0][:80]}"
    return line


def warm_row(c: Case, dummy: torch.Tensor, iters: int, flush) -> str:
    warm = c.time_us(lambda i: gemv(c.x, c.ws[0]), iters, None, check=False)
    warm_read = c.time_us(lambda i: l2_line_prefetch(c.ws[0], dummy, 132, 256), iters, None)
    cold = c.time_us(lambda i: gemv(c.x, c.ws[i]), iters, flush)
    return (f"({c.rows}, {c.k}): gemv from L2 (one weight, no flush) {warm:5.2f} us, from HBM {cold:5.2f}; "
            f"line prefetch of a resident weight {warm_read:5.2f}")


def overlap(args, g, flush) -> None:
    """Does a bulk L2 prefetch of a GEMV's weights, issued before a latency-bound stretch (a spin of S us standing
    for q/k prep + attention), make the GEMV after it faster? Per layer us of: spin alone, spin + GEMV, then
    prefetch + spin + GEMV at 32 / 132 programs (h: with an L2 evict_last hint); in brackets less the spin."""
    props = torch.cuda.get_device_properties(0)
    print(f"\nL2 {props.L2_cache_size / 2 ** 20:.0f} MiB, {props.multi_processor_count} SMs", flush=True)
    dummy = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for rows, k in [(4096, 4096), (6144, 4096), (2048, 4096), (5120, 2048), (4096, 14336)]:
        c = Case(rows, k, args.layers, g)
        print(warm_row(c, dummy, args.iters, flush), flush=True)
        for spin_us in (3, 12):
            print(overlap_row(c, spin_us, dummy, args.iters, flush), flush=True)
        del c
        torch.cuda.empty_cache()


NORM_CASES = [("8b qkv", 6144, 4096, True, False), ("8b o", 4096, 4096, False, False),
              ("8b gate_up", 28672, 4096, True, True), ("8b down", 4096, 14336, False, False),
              ("30b qkv", 5120, 2048, True, False), ("30b o", 2048, 4096, False, False)]


class FusedCase(Case):
    """A Case for the product's fused GEMVs: norm_gemv (with a residual, SiLU-mul for gate_up) or gemv."""

    def __init__(self, name, rows, k, norm, silu, layers, g):
        super().__init__(rows, k, layers, g)
        self.name, self.norm, self.silu = name, norm, silu
        self.res = (torch.randn(1, k, generator=g, device="cuda") * 4).to(DTYPE)
        self.nws = [(1 + 0.1 * torch.randn(k, generator=g, device="cuda")).to(DTYPE) for _ in self.ws]

    def call(self, conf):
        if self.norm:
            return lambda i: norm_gemv(self.x, self.res, self.nws[i], 1e-5, 0.0, self.ws[i], silu_mul=self.silu,
                                       config=conf)[0]
        return lambda i: gemv(self.x, self.ws[i], config=conf)


def norm_rows(args, g, flush) -> None:
    """The fused GEMVs with the RMSNorm statistics summed K / BLOCK_K steps (NORM_BLOCK = BLOCK_K, as before
    triton_gemv.norm_block) against the default one wide step, twice each, at the tuned configs: per call us, L
    distinct weights, L2 flushed. (BENCHMARKS §33.3 also has variants measured on working trees and dropped:
    weights preloaded before the prologue, the normed activation through a shared scratch.)"""
    for case in NORM_CASES:
        c = FusedCase(*case, args.layers, g)
        cfg = dict(gemv_config(1, c.rows, c.k, DTYPE, c.silu), PDL=0)
        line = f"{c.name:>10} ({c.rows}, {c.k}) {cfg_label(cfg)}:"
        outs = []
        for norm_block in (cfg["BLOCK_K"], None, cfg["BLOCK_K"], None):
            conf = dict(cfg, NORM_BLOCK=norm_block) if norm_block else cfg
            outs.append(c.call(conf)(0))
            us = c.time_us(c.call(conf), args.iters, flush, check=False)
            line += f"  norm block {norm_block or 'default'}: {us:6.2f} us ({c.nbytes / us / 1e6:4.2f} TB/s)"
        assert all(torch.equal(o, outs[0]) for o in outs), c.name
        print(line, flush=True)
        del c
        torch.cuda.empty_cache()


LATE_CASES = [NORM_CASES[0], NORM_CASES[2], NORM_CASES[4], ("qwen3-8b gate_up", 24576, 4096, True, True),
              ("smollm2 qkv", 960, 576, True, False), ("smollm2 gate_up", 3072, 576, True, True)]


def late_rows(args, g, flush) -> None:
    """The fused norm GEMVs with the statistics prologue (the default) against LATE_RSTD (squares summed in the K
    loop, 1/rms after it; triton_gemv's module doc), alternating twice, at the tuned configs, PDL as the product
    launches them; per call us (L distinct weights, L2 flushed) and the outputs' largest difference over their
    largest magnitude (a bf16 rounding step is 2^-8 of a value)."""
    for case in LATE_CASES:
        c = FusedCase(*case, args.layers, g)
        cfg = gemv_config(1, c.rows, c.k, DTYPE, c.silu)
        line = f"{c.name:>17} ({c.rows}, {c.k}) {cfg_label(cfg)}:"
        outs = {}
        for late in (0, 1, 1, 0):
            conf = dict(cfg, LATE_RSTD=late)
            outs[late] = c.call(conf)(0)
            us = c.time_us(c.call(conf), args.iters, flush, check=False)
            line += f"  {'late' if late else 'prologue'} {us:6.2f} us"
        diff = (outs[1].float() - outs[0].float()).abs().max() / outs[0].float().abs().max()
        assert diff < 2 ** -5, f"{c.name}: LATE_RSTD differs by {diff:.2e}"
        print(f"{line}  max diff {diff:.1e}", flush=True)
        del c
        torch.cuda.empty_cache()


def wide_rows(args, g, flush) -> None:
    """The fused GEMVs with wide K steps (the whole K, or half of it, a step): the RMSNorm's activation computed
    once or twice a program instead of every 256-1024 columns. Tuned config first, then the best 4 of the grid."""
    for case in [NORM_CASES[i] for i in (0, 2, 1, 4)]:
        print(wide_row(FusedCase(*case, args.layers, g), args.iters, flush), flush=True)
        torch.cuda.empty_cache()


def wide_row(c: FusedCase, iters: int, flush) -> str:
    tuned = dict(gemv_config(1, c.rows, c.k, DTYPE, c.silu), PDL=0)
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, PDL=0)
            for bn, bk, w, st in itertools.product((1, 2, 4, 8), (c.k // 2, c.k), (4, 8), (1, 2))]
    want = None
    out = []
    for conf in [tuned] + grid:
        try:
            got = c.call(conf)(0)
            if want is None:
                want = got
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            out.append((c.time_us(c.call(conf), iters, flush, check=False), cfg_label(conf)))
        except Exception as e:
            print(f"  {c.name} {cfg_label(conf)} failed: {str(e).splitlines()[0][:80]}", flush=True)
    first = out[0]
    best = sorted(out[1:])[:4]
    return (f"{c.name:>10} ({c.rows}, {c.k}): tuned {first[0]:6.2f} us ({first[1]}); wide: "
            + "; ".join(f"{us:6.2f} ({lab})" for us, lab in best))


def cfg_label(cfg) -> str:
    return f"N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8b", "30b"])
    ap.add_argument("--variants", nargs="+", default=["cublas", "ours", "read", "tma", "splitk", "persist"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--overlap", action="store_true", help="only the L2 prefetch experiment")
    ap.add_argument("--norm", action="store_true", help="only the fused GEMVs' norm statistics step widths")
    ap.add_argument("--wide", action="store_true", help="only the fused GEMVs with wide K steps")
    ap.add_argument("--late", action="store_true", help="only the fused norm GEMVs with and without LATE_RSTD")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    flush = l2_flush()
    if args.overlap:
        overlap(args, g, flush)
        return
    if args.norm:
        norm_rows(args, g, flush)
        return
    if args.wide:
        wide_rows(args, g, flush)
        return
    if args.late:
        late_rows(args, g, flush)
        return
    runners = dict(cublas=lambda c: run_cublas(c, args.iters, flush), ours=lambda c: run_ours(c, args.iters, flush),
                   read=lambda c: run_read(c, args.iters, flush, args.quick),
                   tma=lambda c: run_tma(c, args.iters, flush, args.quick),
                   splitk=lambda c: run_splitk(c, args.iters, flush, args.quick),
                   persist=lambda c: run_persist(c, args.iters, flush, args.quick))
    for name in args.shapes:
        for rows, k in SHAPES[name]:
            c = Case(rows, k, args.layers, g)
            print(f"\n{name} ({rows}, {k}): {c.nbytes / 1e6:.1f} MB a call", flush=True)
            for v in args.variants:
                t0 = time.time()
                try:
                    res = runners[v](c)
                except Exception as e:
                    print(f"  {v:8s} failed: {str(e).splitlines()[0][:120]}", flush=True)
                    continue
                res.sort(key=lambda r: r[1])
                for label, us in res[:3]:
                    print(f"  {v:8s} {tbs(c, us)}  {label}", flush=True)
                print(f"  {v:8s} ({len(res)} configs, {time.time() - t0:.0f} s)", flush=True)
            del c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
