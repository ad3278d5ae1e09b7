"""The fused-MoE Triton kernel (specserve/kernels/triton_moe.py) against a per-expert torch loop, at Qwen3-30B-A3B's
MoE shapes (H 2048, I 768 per expert, E 128, top-8, bfloat16; random weights and a seeded random routing).

    python3 scripts/gpu/bench_moe.py [--tokens 1 8 64 512] [--iters 200]
    python3 scripts/gpu/bench_moe.py --sweep [--tokens 1 4] [--iters 50]
    python3 scripts/gpu/bench_moe.py --fp8 [--block 128 128] [--tokens 1 8 64 512]
    python3 scripts/gpu/bench_moe.py --fp8 --per-channel [--tokens 1 8 64 512]  # compressed-tensors FP8-dynamic
    python3 scripts/gpu/bench_moe.py --fp8 --hidden 7168 --inter 2048 --experts 256  # DeepSeek-V3 / GLM-like
    python3 scripts/gpu/bench_moe.py --fp8 --sweep [--tokens 1 8 64 512] [--iters 50]

`--fp8`: the same weights quantized to float8_e4m3fn with a float32 scale per --block (bn x bk, 128 x 128 as FP8
checkpoints), x quantized once before the gate/up GEMM, the act in its epilogue (W8A8); at each T the FP8 fused
MoE against the bf16 one, both graphed, L2 flushed; FP8 checked against its reference (kernels/reference_moe_fp8.py)
and its error against the bf16 reference printed. The bandwidth column counts the chosen experts' FP8 weights and
scales. `--fp8 --per-channel`: the weights quantized with one scale per row instead (llm-compressor's FP8-dynamic
experts; the kernels' per-channel path: x per token, the act per pair), same table.

`--sweep`: at each T, the gate/up and the down GEMM's launch configs (BLOCK_N x BLOCK_K x (warps, stages)) tried one
kernel at a time (the other at its default), graphed, L2 flushed; prints the fastest few and the default's time.
At T = 1 the table's run also times the direct path against the aligned one, side by side.
`--fp8 --sweep`: the same for the FP8 GEMMs' tiles (kernels/tuned_h200.py MOE_FP8_TILES, untuned): configs whose
shared memory would not fit an sm_90 program are left out before compiling; then the fastest gate/up and down
together, printed as a MOE_FP8_TILES entry for the T's rows per block (50 iterations unless --iters; for T 1 8 64 512
about 130 kernels to compile, estimated at 2-3 minutes in all, not yet timed on a GPU; T 64 reuses T 8's kernels).

Both are checked against kernels/reference.py once before timing. Times are CUDA-event medians over --iters calls,
each after an L2 flush (the 60 MB L2 would otherwise hold most of a decode step's 75 MB of expert weights). The flush
reads a 256 MB buffer rather than writing one: an L2 full of dirty lines makes the next kernel pay for their
write-back (it cost the decode step's GEMMs about a quarter of their bandwidth here). The kernel is timed eagerly
and as a CUDA-graph replay. For small T the bandwidth column counts the bytes of the chosen
experts' weights (unique experts x 3*H*I*2) over the graphed time, as a fraction of 4.2 TB/s.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph
from specserve.kernels import reference as ref
from specserve.kernels.reference_moe_fp8 import fused_moe_fp8_ref, quantize_blocks, quantize_channels
from specserve.kernels.triton_moe import _gemm_configs, fused_moe
from specserve.kernels.triton_moe_blocks import DIRECT_BLOCK_M, moe_block_m
from specserve.kernels.triton_moe_fp8 import fp8_configs

PEAK_BW = 4.2e12  # bytes/s: the H200 copy bandwidth measured here


def torch_loop(x, w13, w2, topk_weights, topk_ids):
    """Per-expert loop: for each expert with tokens, gather its rows and do the two matmuls (host-driven: one sync
    for the counts)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [T*K]
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    inter = w2.shape[2]
    out = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sel = order[start:start + c]  # [c] pairs routed to e
        start += c
        tok = sel // k
        gu = x[tok] @ w13[e].T  # [c, 2I]
        y = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].T  # [c, H]
        out.index_add_(0, tok, y.float() * topk_weights.reshape(-1)[sel, None])
    return out.to(x.dtype)


def l2_flush(off: bool = False, device: str | torch.device = "cuda") -> torch.Tensor | None:
    """A 256 MB buffer whose read between timed replays evicts the L2 (time_ms's `flush`); None when `off`."""
    return None if off else torch.zeros(64 << 20, dtype=torch.float32, device=device)


def time_ms(fn, iters: int, warmup: int, flush: torch.Tensor | None) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.sum()  # read-only: leaves clean lines in L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """fn captured once in a CUDA graph, as the engine's runners capture (graphs/capture.py); returns (replay,
    output)."""
    graph, out, _ = capture_graph(fn, None)
    return graph.replay, out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def moe_inputs(t: int, w13: torch.Tensor, w2: torch.Tensor, k: int, g: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """((x [T, H], w13, w2, topk_weights [T, K] float32, topk_ids [T, K]), the reference's output): T tokens routed
    top-k (distinct experts, renormalised) by random logits."""
    dev, e, h = w13.device, w13.shape[0], w13.shape[2]
    x = torch.randn((t, h), generator=g, device=dev).to(w13.dtype)  # [T, H]
    topk_weights, topk_ids = torch.topk(torch.softmax(torch.randn((t, e), generator=g, device=dev), -1), k, dim=-1)
    topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).float()
    moe_args = (x, w13, w2, topk_weights, topk_ids)
    return moe_args, ref.fused_moe(*moe_args)


def sweep_one_kernel(run, want, configs: list[dict], default: tuple[dict, dict], which: int, base: float, args,
                     flush, label: str) -> list[tuple[float, dict, str]]:
    """Times run(tiles) (fused_moe with those tiles, graphed) with kernel `which` (0 gate/up, 1 down) at each of
    configs and the other at its default, each output checked against the reference `want`; prints the fastest few
    against `base` (ms) and returns the rows (ms, config, error name), fastest first."""
    rows = []
    for cfg in configs:
        tiles = (cfg, default[1]) if which == 0 else (default[0], cfg)
        try:
            got = run(tiles)
            replay, _ = graphed(lambda tiles=tiles: run(tiles))
        except Exception as exc:  # noqa: BLE001 - a config past a resource limit: skipped
            rows.append((float("inf"), cfg, type(exc).__name__))
            continue
        err = rel_err(got, want)
        assert err < 3e-2, f"{cfg} differs from the reference: {err:.3g}"
        rows.append((time_ms(replay, args.iters, args.warmup, flush), cfg, ""))
    rows.sort(key=lambda r: r[0])
    print(f"  {'gate/up' if which == 0 else 'down'}: fastest of {len(rows)} ({label} us)")
    for ms, cfg, _ in rows[:6]:
        print(f"    {ms * 1e3:7.1f}  {base / ms:5.2f}x  {cfg}")
    return rows


def bench_tokens(t: int, w13: torch.Tensor, w2: torch.Tensor, g: torch.Generator, args, flush) -> None:
    """One row of the table: T tokens routed top-k by random logits."""
    h, i, k = w13.shape[2], w2.shape[2], args.top_k
    moe_args, want = moe_inputs(t, w13, w2, k, g)
    topk_ids = moe_args[4]
    err_loop = rel_err(torch_loop(*moe_args), want)
    err_fused = rel_err(fused_moe(*moe_args), want)
    assert err_fused < 3e-2, f"fused kernel differs from the reference at T={t}: {err_fused:.3g}"

    loop_ms = time_ms(lambda: torch_loop(*moe_args), args.iters, args.warmup, flush)
    fused_ms = time_ms(lambda: fused_moe(*moe_args), args.iters, args.warmup, flush)
    replay, graph_out = graphed(lambda: fused_moe(*moe_args))
    graph_ms = time_ms(replay, args.iters, args.warmup, flush)
    assert torch.equal(graph_out, fused_moe(*moe_args)), "graph replay differs from the eager kernel"
    used = topk_ids.unique().numel()
    bw = ""
    if t <= 8:  # decode sizes: the kernel should stream the chosen experts' weights at near peak bandwidth
        gbs = used * 3 * h * i * w13.element_size() / (graph_ms * 1e-3) / 1e9
        bw = f"{gbs:7.0f} {gbs * 1e9 / PEAK_BW:7.1%}"
    print(f"{t:5d} {used:7d} {loop_ms:9.3f} {fused_ms:9.3f} {graph_ms:9.3f} {loop_ms / fused_ms:7.1f}x "
          f"{loop_ms / graph_ms:7.1f}x {bw:>15} {err_loop:9.2e} {err_fused:9.2e}")
    if t == 1:  # the direct path (the default at one token) against the aligned one, both graphed, side by side
        replay_a, out_a = graphed(lambda: fused_moe(*moe_args, direct=False))
        aligned_ms = time_ms(replay_a, args.iters, args.warmup, flush)
        direct_ms = time_ms(replay, args.iters, args.warmup, flush)
        assert torch.equal(out_a, graph_out), "the direct path differs from the aligned one"
        print(f"      one token, graphed: direct {direct_ms:.4f} ms, aligned {aligned_ms:.4f} ms "
              f"({aligned_ms / direct_ms:.2f}x)")


def quantize_experts(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales [E, N/bn, K/bk]; block None: [E, N], one a row), one
    expert at a time (the float32 temporaries of all experts at once would not fit at DeepSeek-V3's shapes)."""
    pairs = [quantize_channels(w[e]) if block is None else quantize_blocks(w[e], block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def bench_fp8_tokens(t: int, w13: torch.Tensor, w2: torch.Tensor, fp8_weights: tuple, block: tuple[int, int] | None,
                     g: torch.Generator, args, flush) -> None:
    """One row of the --fp8 table: T tokens routed top-k by random logits, bf16 and FP8 fused MoE, both graphed."""
    h, i, k = w13.shape[2], w2.shape[2], args.top_k
    q13, s13, q2, s2 = fp8_weights
    moe_args, want_bf16 = moe_inputs(t, w13, w2, k, g)
    x, _, _, topk_weights, topk_ids = moe_args
    fp8_args = (x, q13, q2, topk_weights, topk_ids)
    fp8_kw = dict(w13_scale=s13, w2_scale=s2, block=block)
    got = fused_moe(*fp8_args, **fp8_kw)
    err_ref = rel_err(got, fused_moe_fp8_ref(x, q13, s13, q2, s2, block, topk_weights, topk_ids))
    assert err_ref < 3e-2, f"FP8 kernel differs from the FP8 reference at T={t}: {err_ref:.3g}"
    err_bf16 = rel_err(got, want_bf16)
    replay_bf16, _ = graphed(lambda: fused_moe(*moe_args))
    replay_fp8, graph_out = graphed(lambda: fused_moe(*fp8_args, **fp8_kw))
    bf16_ms = time_ms(replay_bf16, args.iters, args.warmup, flush)
    fp8_ms = time_ms(replay_fp8, args.iters, args.warmup, flush)
    assert torch.equal(graph_out, got), "FP8 graph replay differs from the eager kernel"
    used = topk_ids.unique().numel()
    bw = ""
    if t <= 8:  # decode sizes: bandwidth-bound, the chosen experts' FP8 weights and scales
        nbytes = used * (3 * h * i + (s13[0].numel() + s2[0].numel()) * 4)
        gbs = nbytes / (fp8_ms * 1e-3) / 1e9
        bw = f"{gbs:7.0f} {gbs * 1e9 / PEAK_BW:7.1%}"
    print(f"{t:5d} {used:7d} {bf16_ms:9.3f} {fp8_ms:9.3f} {bf16_ms / fp8_ms:7.2f}x {bw:>15} {err_ref:9.2e} "
          f"{err_bf16:9.2e}")


def bench_fp8(w13: torch.Tensor, w2: torch.Tensor, g: torch.Generator, args, flush) -> None:
    block = None if args.per_channel else tuple(args.block)
    q13, s13 = quantize_experts(w13, block)
    q2, s2 = quantize_experts(w2, block)
    layout = "per-channel weight scales" if block is None else f"weight blocks {block[0]} x {block[1]}"
    print(f"FP8 W8A8, {layout}: bf16 and FP8 fused MoE, graphed")
    print(f"{'T':>5} {'experts':>7} {'bf16 ms':>9} {'fp8 ms':>9} {'speedup':>8} {'GB/s':>7} {'of peak':>7} "
          f"{'err ref':>9} {'err bf16':>9}")
    for t in args.tokens:
        bench_fp8_tokens(t, w13, w2, (q13, s13, q2, s2), block, g, args, flush)


def sweep_fp8(w13: torch.Tensor, w2: torch.Tensor, g: torch.Generator, args, flush) -> None:
    block = tuple(args.block)
    q13, s13 = quantize_experts(w13, block)
    q2, s2 = quantize_experts(w2, block)
    print(f"FP8 W8A8 tiles sweep, weight blocks {block[0]} x {block[1]}")
    start = time.perf_counter()
    for t in args.tokens:
        sweep_fp8_tokens(t, w13, w2, (q13, s13, q2, s2), block, g, args, flush)
        print(f"  ({time.perf_counter() - start:.0f} s so far)")


SWEEP_N = (16, 32, 64, 128)
SWEEP_K = (64, 128, 256)
SWEEP_WARPS_STAGES = ((4, 3), (4, 4), (8, 4))


def sweep_tokens(t: int, w13: torch.Tensor, w2: torch.Tensor, g: torch.Generator, args, flush) -> None:
    """The launch configs of both GEMMs at T tokens (direct path at T = 1, else aligned), each kernel's configs with
    the other kernel at its default; outputs checked against the reference."""
    e, k = w13.shape[0], args.top_k
    moe_args, want = moe_inputs(t, w13, w2, k, g)
    block_m = 16 if t == 1 else moe_block_m(t * k, e)
    default = _gemm_configs(block_m)
    replay, _ = graphed(lambda: fused_moe(*moe_args))
    base = time_ms(replay, args.iters, args.warmup, flush)
    print(f"\nT {t} (block_m {block_m}): default {base * 1e3:.1f} us  gate/up {default[0]}  down {default[1]}")
    configs = [dict(BLOCK_N=n, BLOCK_K=kk, num_warps=warps, num_stages=stages)
               for n, kk, (warps, stages) in itertools.product(SWEEP_N, SWEEP_K, SWEEP_WARPS_STAGES)]
    for which in (0, 1):
        sweep_one_kernel(lambda tiles: fused_moe(*moe_args, tiles=tiles), want, configs, default, which, base, args,
                         flush, "whole fused_moe")


# The FP8 sweep's space (bk = 128: BLOCK_K and the gate/up BLOCK_N multiples of it, as the FP8 kernels require)
FP8_SWEEP_GATE_UP_N = (128, 256)
FP8_SWEEP_DOWN_N = (32, 64, 128, 256)
FP8_SWEEP_K = (128, 256)
FP8_SWEEP_WARPS_STAGES = ((4, 3), (4, 4), (8, 3), (8, 4))
SM90_SHARED = 227 * 1024  # bytes of shared memory a program may take on sm_90


def fp8_stage_bytes(block_m: int, cfg: dict, gate_up: bool) -> int:
    """Shared memory of the pipeline's buffers (num_stages - 1 of them, as Triton's pipeliner allocates): the e4m3
    activation tile and the weight tile(s) a K step (gate/up: the gate's and the up's)."""
    per_stage = block_m * cfg["BLOCK_K"] + (2 if gate_up else 1) * cfg["BLOCK_K"] * cfg["BLOCK_N"]
    return per_stage * max(1, cfg["num_stages"] - 1)


def fp8_sweep_configs(block_m: int, bk: int, gate_up: bool) -> list[dict]:
    """The configs to time for one FP8 GEMM: the sweep space at multiples of bk, less those whose pipeline buffers
    (plus a margin for the epilogue's layout conversions) would not fit (not compiled at all: compiling dominates
    the sweep's time)."""
    widths = FP8_SWEEP_GATE_UP_N if gate_up else FP8_SWEEP_DOWN_N
    configs = []
    for n, kk, (warps, stages) in itertools.product(widths, FP8_SWEEP_K, FP8_SWEEP_WARPS_STAGES):
        cfg = dict(BLOCK_N=max(n, bk) if gate_up else n, BLOCK_K=max(kk, bk), num_warps=warps, num_stages=stages)
        if cfg not in configs and fp8_stage_bytes(block_m, cfg, gate_up) + 16 * 1024 <= SM90_SHARED:
            configs.append(cfg)
    return configs


def sweep_fp8_tokens(t: int, w13: torch.Tensor, w2: torch.Tensor, fp8_weights: tuple, block: tuple[int, int],
                     g: torch.Generator, args, flush) -> None:
    """The FP8 GEMMs' tiles at T tokens (direct path at T = 1, else aligned): each kernel's configs with the other
    at its default (the table's), then the fastest of each together; outputs checked against the FP8 reference."""
    e, h, i, k = w13.shape[0], w13.shape[2], w2.shape[2], args.top_k
    q13, s13, q2, s2 = fp8_weights
    moe_args, _ = moe_inputs(t, w13, w2, k, g)
    x, _, _, topk_weights, topk_ids = moe_args
    want = fused_moe_fp8_ref(x, q13, s13, q2, s2, block, topk_weights, topk_ids)

    def run(tiles):
        return fused_moe(x, q13, q2, topk_weights, topk_ids, tiles=tiles, w13_scale=s13, w2_scale=s2, block=block)

    block_m = DIRECT_BLOCK_M if t == 1 else moe_block_m(t * k, e)
    default = fp8_configs(block_m, block[1], i, h, None)
    replay, _ = graphed(lambda: run(None))
    base = time_ms(replay, args.iters, args.warmup, flush)
    print(f"\nT {t} (block_m {block_m}): default {base * 1e3:.1f} us  gate/up {default[0]}  down {default[1]}")
    best = []
    for which in (0, 1):
        rows = sweep_one_kernel(run, want, fp8_sweep_configs(block_m, block[1], which == 0), default, which, base,
                                args, flush, "whole fused_moe")
        best.append(rows[0][1] if rows and rows[0][0] < float("inf") else default[which])
    tiles = tuple(best)
    replay, got = graphed(lambda: run(tiles))
    both = time_ms(replay, args.iters, args.warmup, flush)  # replays: `got` holds the output after
    assert rel_err(got, want) < 3e-2, f"{tiles} differs from the reference"
    print(f"  both fastest: {both * 1e3:.1f} us ({base / both:.2f}x the default); MOE_FP8_TILES entry:")
    print(f"    {block_m}: (dict({', '.join(f'{a}={b}' for a, b in tiles[0].items())}),\n"
          f"         dict({', '.join(f'{a}={b}' for a, b in tiles[1].items())})),")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=None, help="timed calls a median (default 200; --fp8 --sweep 50)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flush", action="store_true", help="keep the L2 warm between timed calls")
    p.add_argument("--sweep", action="store_true", help="sweep both GEMMs' launch configs at each T (with --fp8: "
                   "the FP8 GEMMs')")
    p.add_argument("--fp8", action="store_true", help="time the FP8 (W8A8, block-scaled) fused MoE against bf16")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("BN", "BK"),
                   help="--fp8: the weights' scale block (rows, columns)")
    p.add_argument("--per-channel", action="store_true", help="--fp8: one weight scale per row instead of blocks "
                   "(the table only: the --sweep space is the block path's)")
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    args = p.parse_args()
    if args.per_channel and (args.sweep or not args.fp8):
        p.error("--per-channel goes with --fp8 (the table; --sweep tries the block path's tiles)")
    if args.iters is None:
        args.iters = 50 if args.fp8 and args.sweep else 200
    tee_stdout_to(args.output_file)

    dev, dtype = torch.device("cuda"), torch.bfloat16
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    g = torch.Generator(device=dev).manual_seed(args.seed)
    w13 = (torch.randn((e, 2 * i, h), generator=g, device=dev) / h ** 0.5).to(dtype)  # [E, 2I, H]
    w2 = (torch.randn((e, h, i), generator=g, device=dev) / i ** 0.5).to(dtype)  # [E, H, I]
    flush = l2_flush(args.no_flush, dev)
    print(f"{torch.cuda.get_device_name()}: H {h}, I {i}, E {e}, top-{k}, {dtype}; median of {args.iters} "
          f"(L2 {'warm' if flush is None else 'flushed'})")
    if args.fp8 and args.sweep:
        sweep_fp8(w13, w2, g, args, flush)
        return
    if args.sweep:
        for t in args.tokens:
            sweep_tokens(t, w13, w2, g, args, flush)
        return
    if args.fp8:
        bench_fp8(w13, w2, g, args, flush)
        return
    print(f"{'T':>5} {'experts':>7} {'loop ms':>9} {'fused ms':>9} {'graph ms':>9} {'speedup':>8} "
          f"{'graph x':>8} {'GB/s':>7} {'of peak':>7} {'err loop':>9} {'err fused':>9}")
    for t in args.tokens:
        bench_tokens(t, w13, w2, g, args, flush)


if __name__ == "__main__":
    main()
