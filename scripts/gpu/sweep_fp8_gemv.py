"""Launch configs of the FP8 decode GEMV (specserve/kernels/triton_fp8.py fp8_gemv_with / gemv_config) swept at
Llama-3.1-8B's projections and Qwen3-30B-A3B's attention projections, 1..16 rows, (128, 128) block scales and
per-channel scales:

    python3 scripts/gpu/sweep_fp8_gemv.py [--shapes ...] [--rows 1 4 8 16] [--layouts block channel] [--iters 15]
        [--top 3] [--output-file PATH]

Per case (shape, rows, layout): every candidate (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) timed as a
CUDA-graph replay after an L2 flush (scripts/gpu/bench_moe.py's helpers, as bench_fp8_gemm.py times), the median of
--iters; prints the fastest --top and gemv_config's choice (its time, rank and GB/s over the weight bytes and
scales). Candidates: `candidates` (about 25 a case). SPLIT_K is a runtime argument, so one compiled kernel serves
every split and shape: about 160 compiles in all (most of the run; the default sweep is meant to take under 4
minutes on an H100; the Triton cache makes a second run faster). The chosen config's output is checked against
the best one's (same quantised inputs: float32 summation order only). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
from bench_moe import graphed, l2_flush, rel_err, time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.kernels import reference_fp8 as rf
from specserve.kernels import triton_fp8 as tf
from specserve.kernels.launch import sm_count

# name: (N, K). Qwen3-30B-A3B: hidden 2048, 32 query heads and 4 KV heads of 128
SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096), "8b_down": (4096, 14336),
          "30b_qkv": (5120, 2048), "30b_o": (2048, 4096)}
LAYOUTS = {"block": (128, 128), "channel": None}
DTYPE = torch.bfloat16


def candidates(m: int, n: int, k: int, block, sms: int) -> list[tf.GemvConfig]:
    """The configs tried at one case, gemv_config's first. BLOCK_N: 16/32/64 (2..4 rows on CUDA cores: 16/32, a
    [BLOCK_N, 128] float32 accumulator a row, 64 would spill); BLOCK_K 256/512/1024 at (4 warps, 2 stages), and at
    512 also (8, 2) and (4, 3); SPLIT_K gemv_split's choice for the tile and twice it, and 1 where that choice is
    at most 2."""
    chosen = tf.gemv_config(m, n, k, block, sms)
    out = [chosen]
    for block_n in (16, 32) if 1 < m <= 4 else (16, 32, 64):
        for block_k in (256, 512, 1024):
            base = tf.gemv_split(n, k, block_n, block_k, sms)
            splits = sorted({base, min(2 * base, triton.cdiv(k, block_k))} | ({1} if base <= 2 else set()))
            for warps, stages in [(4, 2)] + ([(8, 2), (4, 3)] if block_k == 512 else []):
                for split in splits:
                    cfg = tf.GemvConfig(block_n, block_k, split, warps, stages)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _label(cfg: tf.GemvConfig) -> str:
    return f"N{cfg.block_n} K{cfg.block_k} S{cfg.split_k} w{cfg.num_warps} s{cfg.num_stages}"


def sweep_case(name: str, m: int, layout: str, weights, args, flush, sms: int) -> None:
    wq, sw, block = weights
    n, k = wq.shape
    x = torch.randn(m, k, device=wq.device).to(DTYPE)
    byte_count = n * k + 4 * sw.numel()
    times = {}
    for cfg in candidates(m, n, k, block, sms):
        replay, _ = graphed(lambda cfg=cfg: tf.fp8_gemv_with(x, wq, sw, block, None, cfg))
        times[cfg] = time_ms(replay, args.iters, 3, flush)
    ranked = sorted(times, key=times.get)
    chosen = tf.gemv_config(m, n, k, block, sms)
    best = ranked[0]
    err = rel_err(tf.fp8_gemv_with(x, wq, sw, block, None, chosen), tf.fp8_gemv_with(x, wq, sw, block, None, best))
    cells = "  ".join(f"{_label(c)} {times[c] * 1e3:6.1f} us" for c in ranked[:args.top])
    print(f"{name:11} M={m:<2} {layout:7} best: {cells}")
    print(f"{'':11} {'':4} {'':7} chosen: {_label(chosen)} {times[chosen] * 1e3:6.1f} us "
          f"{byte_count / times[chosen] / 1e6:5.0f} GB/s (best {byte_count / times[best] / 1e6:5.0f}), rank "
          f"{ranked.index(chosen) + 1}/{len(ranked)}, chosen vs best {err:.1e}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--output-file", default=None, help="also write everything printed to this file")
    args = p.parse_args()
    tee_stdout_to(args.output_file)
    dev = torch.device("cuda")
    sms = sm_count(dev)
    print(f"{torch.cuda.get_device_name(dev)} ({sms} SMs); fp8 gemv configs; L2 flushed; CUDA graphs; "
          f"median of {args.iters}")
    flush = l2_flush(False, dev)
    start = time.perf_counter()
    for name in args.shapes:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev) * k ** -0.5).to(DTYPE)
        for layout in args.layouts:
            block = LAYOUTS[layout]
            wq, sw = rf.quantize_weight_channels(w) if block is None else rf.quantize_weight_blocks(w, block)
            for m in args.rows:
                sweep_case(name, m, layout, (wq, sw, block), args, flush, sms)
        del w
    print(f"done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
