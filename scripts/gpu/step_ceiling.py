"""A whole decode step at batch 1 as pure reads only: what a step of one launch per op cannot beat however fast its
kernels are, and the same bytes read by one launch (the headroom of a persistent step kernel).

    cd scripts/gpu && python3 step_ceiling.py [30b 8b] [--iters 20]

One launch a weight read of the step, in the step's order (each layer's qkv, o, the chosen experts' gate/up and down,
then the LM head), each over a buffer of its own (so nothing is in L2) and at its best read grid (gemv_lab.py's pure
read, the fastest of 8 grids on 8 distinct buffers of that size); one graph, L2 flushed between replays; against
measured copy bandwidth. What is left of a bandwidth target is the budget for the step's latency-bound kernels
(attention, router, norms). Results: BENCHMARKS.md §36.8.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_moe import l2_flush, time_ms  # this folder: the scripts run as files
from gemv_lab import DTYPE, read_launch

from specserve.graphs.capture import capture_graph

# A decode step's weight reads at batch 1 (elements, bf16): layers x [per layer], then the LM head. Qwen3-30B-A3B: qkv
# (32 + 2 * 4 heads of 128) x 2048, o 2048 x 4096, 8 chosen experts' gate/up 8 x 1536 x 2048 and down 8 x 2048 x 768.
STEP_READS = {
    "30b": (48, [5120 * 2048, 2048 * 4096, 8 * 1536 * 2048, 8 * 2048 * 768], 151936 * 2048),
    "8b": (32, [6144 * 4096, 4096 * 4096, 28672 * 4096, 4096 * 14336], 128256 * 4096),
}


def step_ceiling(names: list[str], iters: int, flush) -> None:
    from specserve.bench.phases import copy_bandwidth

    dev = torch.device("cuda")
    copy_gbps = copy_bandwidth(dev)
    out = torch.empty(4096, device=dev)
    print(f"measured copy bandwidth {copy_gbps:.0f} GB/s")
    for name in names:
        layers, per_layer, head = STEP_READS[name]
        best = {}  # elements -> (programs, stages) of the fastest read of that size (8 distinct buffers a graph)
        for n in sorted(set(per_layer + [head])):
            ws = [torch.empty(n, dtype=DTYPE, device=dev).normal_() for _ in range(8 if n < 1 << 28 else 2)]
            times = {}
            for programs, stages in itertools.product((132, 264, 528, 1056), (2, 4)):
                calls = [read_launch(w, out, programs, stages) for w in ws]
                graph, _, _ = capture_graph(lambda calls=calls: [c() for c in calls], None)
                times[programs, stages] = time_ms(graph.replay, iters, 5, flush) * 1e3 / len(ws)
                del graph
            best[n] = min(times, key=times.get)
            us = times[best[n]]
            print(f"  {name} read of {n * 2 / 1e6:7.1f} MB: {us:8.2f} us ({n * 2 / us / 1e6:5.2f} TB/s) at "
                  f"P{best[n][0]} s{best[n][1]}", flush=True)
            del ws
        bufs = [[torch.empty(n, dtype=DTYPE, device=dev) for n in per_layer] for _ in range(layers)]
        head_w = torch.empty(head, dtype=DTYPE, device=dev)
        step = [read_launch(w, out, *best[w.numel()]) for layer in bufs for w in layer]
        step.append(read_launch(head_w, out, *best[head]))
        graph, _, _ = capture_graph(lambda step=step: [c() for c in step], None)
        ms = time_ms(graph.replay, iters, 5, flush)
        nbytes = 2 * (layers * sum(per_layer) + head)
        frac = nbytes / (ms * 1e-3) / 1e9 / copy_gbps
        print(f"{name}: a step as {len(step)} pure reads, {nbytes / 1e9:.2f} GB: {ms:.3f} ms = {frac:.1%} of copy "
              f"bandwidth; at 70% the step may take {nbytes / 0.7 / copy_gbps / 1e6:.3f} ms, which leaves "
              f"{(nbytes / 0.7 / copy_gbps / 1e6 - ms) * 1e3 / layers:.2f} us a layer for everything that is not a "
              f"weight read", flush=True)
        del graph, bufs, head_w
        # the same bytes as one launch: what a kernel streaming the whole step without launches between could reach
        whole = torch.empty(nbytes // 2, dtype=DTYPE, device=dev)
        one = [read_launch(whole, out, programs, stages) for programs, stages in ((528, 4), (1056, 4), (2112, 4))]
        ms_one = min(time_ms(lambda c=c: c(), iters, 5, flush) for c in one)
        print(f"{name}: the same {nbytes / 1e9:.2f} GB as one read launch: {ms_one:.3f} ms = "
              f"{nbytes / (ms_one * 1e-3) / 1e9 / copy_gbps:.1%} of copy bandwidth", flush=True)
        del whole
        torch.cuda.empty_cache()




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shapes", nargs="*", choices=sorted(STEP_READS), help="default: all")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    step_ceiling(args.shapes or sorted(STEP_READS), args.iters, l2_flush())


if __name__ == "__main__":
    main()
