"""The MoE softmax router at decode sizes: F.linear (cuBLAS) + softmax_topk_triton against router_topk_triton (the
router GEMV and the top-k in one launch, specserve/kernels/triton_router.py), bfloat16, as CUDA-graph replays.

    python3 scripts/gpu/bench_router.py [--tokens 1 2 4 8 16] [--iters 200] [--warm] [--sweep]

Shapes: Qwen3-30B-A3B (E 128, H 2048, top-8) and Qwen3-Next (E 512 + 1 shared-expert gate row, H 2048, top-10).
Each graph holds --calls back-to-back router calls, each on its own weight (as the layers of a model), and the
per-call time is a replay's CUDA-event time over --calls; the median of --iters replays. Between replays a 256 MB
read flushes the L2 (in a decode step the experts' weights stream through it between two routers), unless --warm.
Before timing, both paths are checked against the reference on inputs whose logits are exact in float32 (so every
order of accumulation agrees): the fused kernel must match exactly; the cuBLAS path's agreement is reported. The
last columns time the post-attention RMSNorm before the router as its own launch (add_rms_norm, then the fused
router) against the norm inside the router's launch (norm_router_topk_triton; --decode-gemv's MoE fusion).
--sweep also times the fused kernel at other launch configurations (BLOCK_E, T_BLOCK).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_moe import l2_flush, time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph
from specserve.kernels import reference as ref
from specserve.kernels.triton_norm import add_rms_norm
from specserve.kernels.triton_router import (
    norm_router_topk_triton,
    router_config,
    router_topk_triton,
    softmax_topk_triton,
)

SHAPES = [("qwen3-30b-a3b", 128, 2048, 8, False), ("qwen3-next", 512, 2048, 10, True)]


def exact_inputs(tokens: int, cols: int, hidden: int, calls: int, g: torch.Generator):
    """x [T, H] and `calls` weights [cols, H] of multiples of 1/8 in [-1/2, 1/2] (bfloat16): float32 partial sums
    are exact, so every accumulation order gives the same logits."""
    dev = torch.device("cuda")
    x = (torch.randint(-4, 5, (tokens, hidden), generator=g, device=dev) / 8).to(torch.bfloat16)
    ws = [(torch.randint(-4, 5, (cols, hidden), generator=g, device=dev) / 8).to(torch.bfloat16)
          for _ in range(calls)]
    return x, ws


def baseline(x, w, top_k, shared):
    return softmax_topk_triton(F.linear(x, w), top_k, True, shared)


def fused(x, w, top_k, shared, config=None):  # config: router_config's result
    return router_topk_triton(x, w, top_k, True, shared, config=config)


def graph_us(route, x, ws, iters: int, flush: torch.Tensor | None) -> float:
    """Median per-call microseconds of a graph of len(ws) back-to-back calls route(x, w)."""
    graph, _, _ = capture_graph(lambda: [route(x, w) for w in ws], None)
    return time_ms(graph.replay, iters, 10, flush) * 1e3 / len(ws)


def check(x, ws, top_k, shared, config=None) -> str:
    """Assert the fused kernel matches the reference on every weight; report whether the cuBLAS path does."""
    differ = 0
    for w in ws:
        logits = F.linear(x.float(), w.float()).to(torch.bfloat16).float()  # exact float32 sums, rounded once
        want_w, want_ids = ref.softmax_topk(logits, top_k, True, shared)
        got_w, got_ids = fused(x, w, top_k, shared, config)
        assert torch.equal(got_ids, want_ids), "fused router ids differ from the reference"
        torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-5)
        base_w, base_ids = baseline(x, w, top_k, shared)
        differ += int((base_ids != got_ids).sum())
    return "same" if differ == 0 else f"{differ} differ"


SWEEP = [(be, tb) for be in (1, 2, 4, 8) for tb in (1, 2, 4)]  # (BLOCK_E, T_BLOCK)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--calls", type=int, default=20, help="router calls (distinct weights) per graph")
    p.add_argument("--warm", action="store_true", help="no L2 flush between replays")
    p.add_argument("--sweep", action="store_true", help="also time other fused launch configurations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    args = p.parse_args()
    tee_stdout_to(args.output_file)

    g = torch.Generator(device="cuda").manual_seed(args.seed)
    flush = l2_flush(args.warm)
    print(f"{torch.cuda.get_device_name()}: bfloat16, CUDA-graph replays of {args.calls} calls, median of "
          f"{args.iters} (L2 {'warm' if flush is None else 'flushed'}); per call in us")
    for shape in SHAPES:
        bench_shape(*shape, args, g, flush)


def bench_shape(name: str, experts: int, hidden: int, top_k: int, shared: bool, args, g, flush) -> None:
    cols = experts + int(shared)
    print(f"\n{name}: E {experts}{' + 1 shared gate' if shared else ''}, H {hidden}, top-{top_k}, "
          f"{cols * hidden * 2 / 2**20:.2f} MB of weights")
    print(f"{'T':>3} {'linear+topk':>12} {'fused':>8} {'ratio':>6} {'ids':>10} | {'norm+fused':>10} "
          f"{'norm inside':>11} {'ratio':>6}  config")
    for t in args.tokens:
        x, ws = exact_inputs(t, cols, hidden, args.calls, g)
        ids = check(x, ws, top_k, shared)
        base = graph_us(lambda x, w: baseline(x, w, top_k, shared), x, ws, args.iters, flush)
        one = graph_us(lambda x, w: fused(x, w, top_k, shared), x, ws, args.iters, flush)
        # the post-attention norm before the router: add_rms_norm + the fused router, against the norm inside it
        res = (x.float() * 0.5).to(x.dtype)
        nw = torch.ones(hidden, dtype=x.dtype, device=x.device)
        sep = graph_us(lambda x, w, res=res, nw=nw: fused(add_rms_norm(x, res, nw, 1e-6)[0], w, top_k, shared), x,
                       ws, args.iters, flush)
        inside = graph_us(lambda x, w, res=res, nw=nw: norm_router_topk_triton(x, res, nw, 1e-6, 0.0, w, top_k, True,
                                                                               shared), x, ws, args.iters, flush)
        cfg = router_config(t, cols, hidden, experts)
        print(f"{t:3d} {base:12.2f} {one:8.2f} {base / one:5.2f}x {ids:>10} | {sep:10.2f} {inside:11.2f} "
              f"{sep / inside:5.2f}x  " + " ".join(f"{k}={v}" for k, v in cfg.items()))
        if args.sweep:
            for be, tb in SWEEP:
                if tb > t:
                    continue
                c = router_config(t, cols, hidden, experts, block_e=be, t_block=tb)
                check(x, ws[:2], top_k, shared, c)
                us = graph_us(lambda x, w, c=c: fused(x, w, top_k, shared, c), x, ws, args.iters, flush)
                print(f"{'':3} {'':12} {us:8.2f} {base / us:5.2f}x {'':>10}  "
                      + " ".join(f"{k}={v}" for k, v in c.items()))

if __name__ == "__main__":
    main()
