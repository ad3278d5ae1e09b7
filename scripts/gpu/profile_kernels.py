"""Per-kernel GPU times of the latency-bound kernel chains at batch 1, from graph replays under the profiler: the
sampler's filtered sample (kernels/triton_sample.py) at two chunk sizes, and one DSA layer's indexer scores + top-k
+ sparse MLA (kernels/triton_indexer.py, triton_topk.py, triton_mla.py) at 32k keys, with dense MLA beside it.

    python3 scripts/gpu/profile_kernels.py [--iters 30] [--parts sampler dsa dsa-batches]

`dsa-batches`: the DSA step against dense MLA at 32k keys a request, batch 1, 8, 32, 64 (issue 14's ratio), keys
in random cache slots; `dsa-batches-contiguous` the same with each request's keys in consecutive slots.
"""

from __future__ import annotations

import argparse
import functools
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.graphs.capture import capture_graph
from specserve.kernels.triton_indexer import index_scores_triton
from specserve.kernels.triton_mla import mla_decode_triton
from specserve.kernels.triton_sample import sample_triton
from specserve.kernels.triton_topk import index_topk_triton, topk_workspace

DEV = torch.device("cuda")


def replay_us(graph, iters: int) -> float:
    """Mean wall time of a graph replay, back to back, after 5 warm-up replays."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def breakdown(label: str, fn, iters: int) -> None:
    graph, _, _ = capture_graph(fn, None)
    wall = replay_us(graph, iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start:
            total[e.name] += (e.time_range.end - e.time_range.start) / iters
            count[e.name] += 1
    busy = sum(total.values())
    print(f"\n=== {label}: replay {wall:.1f} us, kernels busy {busy:.1f} us, "
          f"{sum(count.values()) // iters} launches ===")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"{us:8.1f} us  x{count[name] // iters:<3} {name[:80]}")


def _sample_fn(x: torch.Tensor, temp: float, k: int, p: float, chunk: int):
    f = lambda v: torch.full((1,), v, dtype=torch.float32, device=DEV)  # noqa: E731
    args = (x, f(temp), torch.full((1,), k, dtype=torch.int64, device=DEV), f(p), f(0.0),
            torch.zeros(1, dtype=torch.bool, device=DEV), torch.tensor([11], device=DEV),
            torch.tensor([100], device=DEV), True)
    return lambda: sample_triton(*args, chunk=chunk)


def sampler(iters: int) -> None:
    for vocab in (49152, 151936):
        x = (torch.randn((1, vocab), device=DEV) * 4).to(torch.bfloat16).float()
        for name, temp, k, p in (("top-k 200", 0.8, 200, 1.0), ("top-p 0.95", 0.7, vocab, 0.95)):
            for chunk in (1024, 4096):
                breakdown(f"sample V {vocab} {name} chunk {chunk}", _sample_fn(x, temp, k, p, chunk), iters)


def dsa(iters: int) -> None:
    kv, di, hi, h, c, r, topk = 32768, 128, 32, 64, 512, 64, 2048
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = torch.randn((kv + 16, di), device=DEV, dtype=torch.bfloat16, generator=g)
    lat = torch.randn((kv + 16, c + r), device=DEV, dtype=torch.bfloat16, generator=g)
    kv_slots = (torch.randperm(kv, device=DEV, generator=g) + 16).view(1, kv)
    lens = torch.full((1,), kv, dtype=torch.int64, device=DEV)
    q = torch.randn((1, hi, di), device=DEV, dtype=torch.bfloat16, generator=g)
    wts = torch.randn((1, hi), device=DEV, generator=g)
    qm = torch.randn((1, h, c + r), device=DEV, dtype=torch.bfloat16, generator=g)

    def sparse():  # as attention/torch_mla_backend.py TritonIndexBackend: the scores kernel does the first pass
        hist = topk_workspace(1, DEV)
        s = index_scores_triton(q, wts, rows, None, kv_slots, lens, 1, hist=hist, k=topk)
        sel, cnt = index_topk_triton(s, lens, kv_slots, 1, topk, hist=hist)
        return mla_decode_triton(qm, lat, sel, cnt, 1, 0.07, c)

    breakdown("DSA bs 1, 32k keys: scores + top-k + sparse MLA", sparse, iters)
    breakdown("dense MLA bs 1, 32k keys", lambda: mla_decode_triton(qm, lat, kv_slots, lens, 1, 0.07, c), iters)
    # the sparse MLA's key splits over the 2048 chosen keys (num_key_splits picks 64: one key block a split)
    s = index_scores_triton(q, wts, rows, None, kv_slots, lens, 1)
    sel, cnt = index_topk_triton(s, lens, kv_slots, 1, topk)
    want = mla_decode_triton(qm, lat, sel, cnt, 1, 0.07, c)
    for splits in (8, 16, 32, 64):
        fn = lambda n=splits: mla_decode_triton(qm, lat, sel, cnt, 1, 0.07, c, num_splits=n)  # noqa: E731
        torch.testing.assert_close(fn(), want, rtol=2e-2, atol=2e-2)
        graph, _, _ = capture_graph(fn, None)
        print(f"sparse MLA over {topk} chosen keys, {splits:2d} splits: replay {replay_us(graph, iters):.1f} us")


def dsa_batches(iters: int, batch_sizes=(1, 8, 32, 64), contiguous: bool = False) -> None:
    """Issue 14's sparse against dense attention at 32k keys per request, at each batch size: one GLM-5 layer's
    DSA step (indexer scores + top-k + sparse MLA over the 2048 chosen rows) against dense MLA over all 32k keys.
    contiguous: each request's keys in consecutive cache slots (a fresh pool's layout) instead of random ones (a
    pool fragmented by churn)."""
    kv, di, hi, h, c, r, topk = 32768, 128, 32, 64, 512, 64, 2048
    layout = "contiguous" if contiguous else "random"
    print(f"\n=== one GLM-5 layer over 32k keys a request ({layout} slots): DSA step vs dense MLA, graph replay us ===")
    print(f"{'bs':>4} | {'DSA step':>9} | {'dense MLA':>9} | {'dense / DSA':>11}")
    for bs in batch_sizes:
        g = torch.Generator(device=DEV).manual_seed(bs)
        slots = bs * kv + 16
        rows = torch.randn((slots, di), device=DEV, dtype=torch.bfloat16, generator=g)
        lat = torch.randn((slots, c + r), device=DEV, dtype=torch.bfloat16, generator=g)
        order = torch.arange(bs * kv, device=DEV) if contiguous else torch.randperm(bs * kv, device=DEV, generator=g)
        kv_slots = (order + 16).view(bs, kv)
        lens = torch.full((bs,), kv, dtype=torch.int64, device=DEV)
        q = torch.randn((bs, hi, di), device=DEV, dtype=torch.bfloat16, generator=g)
        wts = torch.randn((bs, hi), device=DEV, generator=g)
        qm = torch.randn((bs, h, c + r), device=DEV, dtype=torch.bfloat16, generator=g)

        def sparse(q=q, wts=wts, rows=rows, kv_slots=kv_slots, lens=lens, qm=qm, lat=lat, bs=bs):
            hist = topk_workspace(bs, DEV)
            s = index_scores_triton(q, wts, rows, None, kv_slots, lens, 1, hist=hist, k=topk)
            sel, cnt = index_topk_triton(s, lens, kv_slots, 1, topk, hist=hist)
            return mla_decode_triton(qm, lat, sel, cnt, 1, 0.07, c)

        def dense(qm=qm, lat=lat, kv_slots=kv_slots, lens=lens):
            return mla_decode_triton(qm, lat, kv_slots, lens, 1, 0.07, c)

        us = []
        for fn in (sparse, dense):
            graph, _, _ = capture_graph(fn, None)
            us.append(replay_us(graph, iters))
            del graph
        print(f"{bs:>4} | {us[0]:9.1f} | {us[1]:9.1f} | {us[1] / us[0]:10.2f}x")
        del rows, lat, kv_slots
        torch.cuda.empty_cache()


def mla_keys_per_step(iters: int) -> None:
    """The absorbed-MLA kernel at 64-head launches with 32 against 64 keys a step (BENCHMARKS §25.3 left it
    half-measured), outputs checked equal; then one GLM-5 DSA step at batch 32 kernel by kernel."""
    h, c, r = 64, 512, 64
    print("\n=== MLA decode, GLM-5 shapes: default keys a step vs 64, graph replay us ===")
    for bs, w, kv in ((8, 1, 32768), (32, 1, 32768), (8, 4, 32768), (64, 4, 4096), (32, 1, 2048), (64, 4, 2048),
                      (256, 1, 2048)):
        g = torch.Generator(device=DEV).manual_seed(bs * w)
        lat = torch.randn((bs * kv + 16, c + r), device=DEV, dtype=torch.bfloat16, generator=g)
        kv_slots = (torch.randperm(bs * kv, device=DEV, generator=g) + 16).view(bs, kv)
        lens = torch.full((bs,), kv, dtype=torch.int64, device=DEV)
        qm = torch.randn((bs * w, h, c + r), device=DEV, dtype=torch.bfloat16, generator=g)
        us = []
        for bn in (None, 64):
            fn = functools.partial(mla_decode_triton, qm, lat, kv_slots, lens, w, 0.07, c, block_n=bn)
            if bn is not None:
                torch.testing.assert_close(fn(), mla_decode_triton(qm, lat, kv_slots, lens, w, 0.07, c),
                                           rtol=2e-2, atol=2e-2)
            graph, _, _ = capture_graph(fn, None)
            us.append(replay_us(graph, iters))
            del graph
        print(f"{bs:>4} x {w} over {kv:>5} keys: default {us[0]:8.1f}  n64 {us[1]:8.1f}  ({us[0] / us[1]:.2f}x)")
        del lat, kv_slots
        torch.cuda.empty_cache()
    kv, di, hi, topk, bs = 32768, 128, 32, 2048, 32
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = torch.randn((bs * kv + 16, di), device=DEV, dtype=torch.bfloat16, generator=g)
    lat = torch.randn((bs * kv + 16, c + r), device=DEV, dtype=torch.bfloat16, generator=g)
    kv_slots = (torch.randperm(bs * kv, device=DEV, generator=g) + 16).view(bs, kv)
    lens = torch.full((bs,), kv, dtype=torch.int64, device=DEV)
    q = torch.randn((bs, hi, di), device=DEV, dtype=torch.bfloat16, generator=g)
    wts = torch.randn((bs, hi), device=DEV, generator=g)
    qm = torch.randn((bs, h, c + r), device=DEV, dtype=torch.bfloat16, generator=g)

    def sparse():
        hist = topk_workspace(bs, DEV)
        s = index_scores_triton(q, wts, rows, None, kv_slots, lens, 1, hist=hist, k=topk)
        sel, cnt = index_topk_triton(s, lens, kv_slots, 1, topk, hist=hist)
        return mla_decode_triton(qm, lat, sel, cnt, 1, 0.07, c)

    breakdown(f"DSA bs {bs}, 32k keys: scores + top-k + sparse MLA", sparse, iters)


def scores_steps(iters: int) -> None:
    """The indexer's scores kernel (with the top-k's first pass) walking 1, 2, 4, 8 key blocks a program, GLM-5
    shapes over 32k keys a request, against the default (`key_steps`)."""
    kv, di, hi, topk = 32768, 128, 32, 2048
    print("\n=== indexer scores over 32k keys a request, replay us: steps 1 / 2 / 4 / 8 / default ===")
    for bs in (1, 8, 32, 64):
        g = torch.Generator(device=DEV).manual_seed(bs)
        rows = torch.randn((bs * kv + 16, di), device=DEV, dtype=torch.bfloat16, generator=g)
        kv_slots = (torch.randperm(bs * kv, device=DEV, generator=g) + 16).view(bs, kv)
        lens = torch.full((bs,), kv, dtype=torch.int64, device=DEV)
        q = torch.randn((bs, hi, di), device=DEV, dtype=torch.bfloat16, generator=g)
        wts = torch.randn((bs, hi), device=DEV, generator=g)
        hist = topk_workspace(bs, DEV)
        us = []
        for steps in (1, 2, 4, 8, None):
            fn = functools.partial(index_scores_triton, q, wts, rows, None, kv_slots, lens, 1, hist=hist, k=topk,
                                   steps=steps)
            graph, _, _ = capture_graph(fn, None)
            us.append(replay_us(graph, iters))
            del graph
        print(f"{bs:>4}: " + " / ".join(f"{u:.1f}" for u in us))
        del rows, kv_slots
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--parts", nargs="*", default=["sampler", "dsa"])
    a = p.parse_args()
    for part in a.parts:
        if part == "dsa-batches-contiguous":
            dsa_batches(a.iters, contiguous=True)
            continue
        {"sampler": sampler, "dsa": dsa, "dsa-batches": dsa_batches, "mla-n64": mla_keys_per_step,
         "scores-steps": scores_steps}[part](a.iters)


if __name__ == "__main__":
    main()
