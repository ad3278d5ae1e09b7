"""FP8 (W8A8 e4m3) linear layers (specserve/kernels/triton_fp8.py fp8_linear) against bfloat16 F.linear (cuBLAS) and
torch._scaled_mm with row-wise scales (cuBLAS's fp8 GEMM, per-token x per-channel: the peer of the per-channel path),
at Llama-3.1-8B's projections:

    python3 scripts/gpu/bench_fp8_gemm.py [--shapes qkv o gate_up down] [--rows 1 8 32 256 4096] [--iters 50]
        [--warm] [--eager] [--check] [--output-file PATH]

Per (projection, M): bf16 F.linear; fp8_linear with (128, 128) block scales (DeepSeek-style checkpoints) and with
per-channel scales (online quantisation), each including its activation quantisation (in the GEMV at M <= 16, a
separate kernel above); _scaled_mm including the same per-token quantiser (quantize_act_tokens_triton), "n/a" where
cuBLAS refuses the shape. Each call is a CUDA-graph replay (--eager: plain calls), the median of --iters CUDA-event
timings; between timings a 256 MB read evicts the L2 (unless --warm), so the weights stream from HBM as in a decode
step. GB/s counts the weight bytes (and their scales) read once; the ratio is bf16's time over fp8's (above 1: fp8
faster). --check first compares each fp8 path with the torch reference (reference_fp8.fp8_linear_ref, same rule:
max error over the output's max, expected ~1e-3 from the fp8 MMA's narrower in-step accumulator and bf16 output)
and fp8_gemv with quantise + fp8_gemm, and prints the results. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_moe import graphed, l2_flush, rel_err, time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.kernels import reference_fp8 as rf
from specserve.kernels import triton_fp8 as tf

# name: (N, K) of Llama-3.1-8B's projections
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCK = (128, 128)
DTYPE = torch.bfloat16


def _scaled_mm_fn(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor):
    """torch._scaled_mm row-wise (per-token x scales [M, 1], per-channel w scales [1, N]) behind our per-token
    quantiser, or None where it does not run at this shape."""
    def run():
        xq, sx = tf.quantize_act_tokens_triton(x)
        return torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :], out_dtype=DTYPE)
    try:
        run()
        torch.cuda.synchronize()
    except (RuntimeError, ValueError) as exc:
        return None, str(exc).splitlines()[0][:60]
    return run, None


def _calls(x: torch.Tensor, w: torch.Tensor, w8: dict) -> dict:
    """The timed calls at one x [M, K]: bf16 F.linear and fp8_linear over each fp8 weight."""
    return {"bf16": lambda: F.linear(x, w), "fp8 blk128": lambda: tf.fp8_linear(x, *w8["block"]),
            "fp8 chan": lambda: tf.fp8_linear(x, *w8["channel"])}


def _timed(fn, args, flush) -> float:
    call = fn if args.eager else graphed(fn)[0]
    return time_ms(call, args.iters, 5, flush)


def _check(name: str, m: int, x, w8) -> None:
    for label, (wq, sw, block) in w8.items():
        got = tf.fp8_linear(x, wq, sw, block)
        want = rf.fp8_linear_ref(x, wq, sw, block)
        line = f"check {name} M={m} {label}: fp8_linear vs reference {rel_err(got, want):.2e}"
        if m <= tf.GEMV_MAX_ROWS:
            xq, sx = tf.quantize_act_tokens_triton(x) if block is None else tf.quantize_act_groups_triton(x, block[1])
            two_step = tf.fp8_gemm(xq, sx, wq, sw, block, None, torch.float32)
            line += f", gemv vs quantise + gemm {rel_err(tf.fp8_gemv(x.float(), wq, sw, block), two_step):.2e}"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 256, 4096])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warm", action="store_true", help="keep the L2 warm between timings (no flush)")
    p.add_argument("--eager", action="store_true", help="time plain calls, not CUDA-graph replays")
    p.add_argument("--check", action="store_true", help="compare outputs with the torch reference first")
    p.add_argument("--output-file", default=None, help="also write everything printed to this file")
    args = p.parse_args()
    tee_stdout_to(args.output_file)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; bf16 vs fp8 (e4m3) weights; "
          f"{'warm L2' if args.warm else 'L2 flushed'}; {'eager' if args.eager else 'CUDA graphs'}")
    flush = l2_flush(args.warm, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    cols = ("bf16", "fp8 blk128", "fp8 chan", "scaled_mm")
    print(f"{'proj':8} {'M':>5} " + " ".join(f"{c + ' ms':>14} {'GB/s':>6}" for c in cols)
          + f" {'blk/bf16':>8} {'chan/bf16':>9}")
    for name in args.shapes:
        n, k = SHAPES[name]
        w = (torch.randn(n, k, generator=g, device=dev) * k ** -0.5).to(DTYPE)
        w8 = {"block": (*rf.quantize_weight_blocks(w, BLOCK), BLOCK),
              "channel": (*rf.quantize_weight_channels(w), None)}
        bytes_ = {"bf16": 2 * n * k, "fp8 blk128": n * k + 4 * w8["block"][1].numel(), "fp8 chan": n * k + 4 * n,
                  "scaled_mm": n * k + 4 * n}
        for m in args.rows:
            x = torch.randn(m, k, generator=g, device=dev).to(DTYPE)
            if args.check:
                _check(name, m, x, w8)
            fns = _calls(x, w, w8)
            peer, why = _scaled_mm_fn(x, *w8["channel"][:2])
            if peer is not None:
                fns["scaled_mm"] = peer
            ms = {c: _timed(fn, args, flush) for c, fn in fns.items()}
            cells = []
            for c in cols:
                if c in ms:
                    cells.append(f"{ms[c]:>14.4f} {bytes_[c] / ms[c] / 1e6:>6.0f}")
                else:
                    cells.append(f"{'n/a':>14} {'':>6}")
            print(f"{name:8} {m:>5} " + " ".join(cells)
                  + f" {ms['bf16'] / ms['fp8 blk128']:>8.2f} {ms['bf16'] / ms['fp8 chan']:>9.2f}")
            if why:
                print(f"  scaled_mm n/a at M={m}: {why}")


if __name__ == "__main__":
    main()
