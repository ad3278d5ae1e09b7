"""Does programmatic dependent launch (PDL) hide the gaps between decode kernels inside a CUDA graph on this GPU?

    python3 scripts/gpu/bench_pdl.py [--hidden 4096 576] [--layers 32] [--iters 50]

A chain of L dependent GEMVs (y_i = W_i x_i, x_{i+1} = y_i, distinct weights [H, H] in bfloat16, M = 1: the shape
of an o-projection) captured in one CUDA graph, four ways: plain launches; launched with PDL (`launch_pdl=True`)
where each kernel first lets its dependents launch (gdc_launch_dependents), then loads its first weight tile (the
weights are never written, so that read may overlap the previous kernel), and only then waits for the previous
kernel (gdc_wait) before it reads x; the same with the dependents let in only after the main loop (pdl-late:
waiting programs then never take SM slots from the kernel's own later waves); and, for scale, cuBLAS (F.linear).
Per GEMV microseconds (median of --iters replays after an L2 flush), the weight bandwidth against 4.2 TB/s, and
whether the PDL chains equal the plain one bit for bit. A decode step's profile shows a gap at each kernel boundary;
where PDL recovers most of it, the fused decode kernels (kernels/triton_gemv.py and their neighbours) should launch
this way. Prints "PDL not supported" and the error when this Triton cannot launch
with PDL.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_moe import PEAK_BW, l2_flush, time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
          LATE: tl.constexpr):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    k = tl.arange(0, BLOCK_K)
    rows = w_ptr + n.to(tl.int64)[:, None] * K
    if PDL and not LATE:
        tl.extra.cuda.gdc_launch_dependents()
    w0 = tl.load(rows + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel's y (this x) is complete and visible from here on
    acc = w0 * tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]  # [BLOCK_N, BLOCK_K]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=3):
        kk = k0 + k
        w = tl.load(rows + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
        acc += w * tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
    if PDL and LATE:
        tl.extra.cuda.gdc_launch_dependents()  # only now: waiting dependents never hold SMs this grid still needs
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n < N)


def chain(ws: list[torch.Tensor], x: torch.Tensor, mode: str, block_n: int, block_k: int) -> torch.Tensor:
    for w in ws:
        if mode == "cublas":
            x = F.linear(x[None], w)[0]
            continue
        y = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
        pdl = mode.startswith("pdl")
        kw = {"launch_pdl": True} if pdl else {}
        _gemv[(triton.cdiv(w.shape[0], block_n),)](x, w, y, w.shape[0], w.shape[1], BLOCK_N=block_n,
                                                    BLOCK_K=block_k, PDL=pdl, LATE=mode == "pdl-late", num_warps=4,
                                                    **kw)
        x = y
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 576])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--block-n", type=int, default=8)
    p.add_argument("--block-k", type=int, default=512)
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    a = p.parse_args()
    tee_stdout_to(a.output_file)
    dev = torch.device("cuda")
    flush = l2_flush()
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}: per-GEMV us in a graph of {a.layers}")
    for h in a.hidden:
        g = torch.Generator(device=dev).manual_seed(h)
        ws = [(torch.randn((h, h), generator=g, device=dev) * h ** -0.5).to(torch.bfloat16) for _ in range(a.layers)]
        x = torch.randn(h, generator=g, device=dev).to(torch.bfloat16)
        bk = min(a.block_k, triton.next_power_of_2(h))
        row, outs = [], {}
        for mode in ("plain", "pdl", "pdl-late", "cublas"):
            try:
                graph, out, _ = capture_graph(partial(chain, ws, x, mode, a.block_n, bk), None)
            except Exception as e:  # an older Triton without launch_pdl / gdc
                print(f"  H {h}: {mode}: PDL not supported ({type(e).__name__}: {e})"[:300])
                continue
            us = time_ms(graph.replay, a.iters, 5, flush) * 1e3 / a.layers
            outs[mode] = out.float()
            gbs = h * h * 2 / (us * 1e-6) / 1e9
            row.append(f"{mode} {us:7.2f} us ({gbs:6.0f} GB/s, {gbs * 1e9 / PEAK_BW:5.1%})")
        # the PDL chains run the plain chain's kernel in the same order: bit for bit equal, or the wait is broken
        same = {m: bool(torch.equal(v, outs["plain"])) for m, v in outs.items() if m.startswith("pdl")}
        print(f"  H {h:>5}: " + " | ".join(row) + f" | equal to plain {same}", flush=True)


if __name__ == "__main__":
    main()
