"""Micro-benchmark of fp32 CPU linear layers at small row counts (the speculative verify step's 2-6 rows).

    OMP_NUM_THREADS=2 python3 scripts/cpu/bench_linear.py [--ms 1,2,4] [--shapes qkv,lm_head] [--reps 5]
        [--output-file PATH]

For each SmolLM2-135M linear shape and row count M it times every candidate y = x @ W^T + b and prints the time,
the ratio to F.linear at M=1 (the plain decode step's cost) and the ratio to F.linear at the same M. The weights are
rotated through enough copies to overflow the L3 cache, as in the model, whose 30 layers' weights are ~0.5 GB, so
each call reads its weight from DRAM; the minimum over `--reps` repeats is reported (the machine is shared).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specserve.bench.tee import tee_stdout_to

# name: (in, out) of SmolLM2-135M's linears (hidden 576, intermediate 1536, 9 q heads / 3 kv heads of 64).
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "eh_proj": (1152, 576),
    "lm_head": (576, 49152),
}
MS = [1, 2, 3, 4, 5, 6, 8, 16, 64, 512]
COLD_BYTES = 256 << 20  # total weight bytes cycled through: 8x the 32 MiB L3


def methods(m: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (fn(x, prepared) -> y, prepare(w) -> prepared weight state), for row count m."""
    out = {
        "F.linear": (lambda x, p: F.linear(x, p), lambda w: w),
        "W@x^T": (lambda x, p: (p @ x.T).T.contiguous(), lambda w: w),
        # oneDNN inner product on the plain [out, in] weight (no extra memory).
        "onednn": (lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), lambda w: w),
        # oneDNN with its blocked weight layout, packed for this M (inductor's bf16/ACL path).
        "onednn_pk": (lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                      lambda w: torch.ops.mkldnn._reorder_linear_weight(w, m)),
        # MKL cblas_sgemm_pack for this exact M (inductor's fp32 path); another M falls back to the plain weight.
        "mkl_pack": (lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None, m),
                     lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, m), w)),
    }
    if m <= 8:  # one matrix-vector product per row: reads W m times (from L3 after the first)
        out["mv_loop"] = (lambda x, p: torch.stack([torch.mv(p, r) for r in x]), lambda w: w)
    return out


def time_once(fn: Callable, preps: list, xs: list[torch.Tensor], iters: int) -> float:
    """Mean seconds per call over `iters` calls, each on the next weight copy."""
    t0 = time.perf_counter()
    for i in range(iters):
        fn(xs[i % len(xs)], preps[i % len(preps)])
    return (time.perf_counter() - t0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--min-s", type=float, default=0.02, help="seconds per timed repeat")
    ap.add_argument("--methods", default="", help="comma list to restrict the candidates")
    ap.add_argument("--hot", action="store_true", help="one weight copy (cache-resident for the small shapes)")
    ap.add_argument("--output-file", default=None, help="also write the printed table to this file (text)")
    args = ap.parse_args()
    tee_stdout_to(args.output_file)
    ms = [int(m) for m in args.ms.split(",")]
    only = set(args.methods.split(",")) - {""}
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{'hot' if args.hot else 'cold (weights rotated past L3)'}")
    print(f"{'shape':<8} {'M':>4} {'method':<9} {'us':>9} {'/F1':>6} {'/F@M':>6}  maxerr")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        copies = 1 if args.hot else max(2, COLD_BYTES // (k * n * 4))
        ws = [torch.randn(n, k) / k ** 0.5 for _ in range(copies)]  # [out, in]
        base1 = None
        for m in ms:
            xs = [torch.randn(m, k) for _ in range(4)]
            ref = F.linear(xs[0], ws[0])
            cands = {meth: (fn, [prepare(w) for w in ws]) for meth, (fn, prepare) in methods(m).items()
                     if not only or meth in only or meth == "F.linear"}
            errs, iters = {}, {}
            for meth, (fn, preps) in cands.items():
                errs[meth] = (fn(xs[0], preps[0]) - ref).abs().max().item()
                per = time_once(fn, preps, xs, len(preps))  # warm-up, also sizes the timed loops
                iters[meth] = max(len(preps), int(args.min_s / max(per, 1e-7)))
            # Repeats interleave the methods, so a burst of load from another process hits all of them alike.
            best = dict.fromkeys(cands, float("inf"))
            for _ in range(args.reps):
                for meth, (fn, preps) in cands.items():
                    best[meth] = min(best[meth], time_once(fn, preps, xs, iters[meth]))
            results = {meth: (best[meth], errs[meth]) for meth in cands}
            del cands
            base = results["F.linear"][0]
            if m == 1 or base1 is None:
                base1 = base if m == 1 else base1
            for meth, (t, err) in results.items():
                r1 = f"{t / base1:6.2f}" if base1 else "     -"
                print(f"{name:<8} {m:>4} {meth:<9} {t * 1e6:9.1f} {r1} {t / base:6.2f}  {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
