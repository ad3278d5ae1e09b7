"""Per-kernel GPU times of the latency-bound kernel chains at batch 1, from graph replays under the profiler: the
sampler's filtered sample (kernels/triton_sample.py) at two chunk sizes, and one DSA layer's indexer scores + top-k
+ sparse MLA (kernels/triton_indexer.py, triton_topk.py, triton_mla.py) at 32k keys, with dense MLA beside it.

    python3 scripts/gpu/profile_kernels.py [--iters 30] [--parts sampler dsa dsa-batches]

`dsa-batches`: the DSA step against dense MLA at 32k keys a request, batch 1, 8, 32, 64 (sparse against dense), keys
in random cache slots; `dsa-batches-contiguous` the same with each request's keys in consecutive slots;
`dsa-layouts` random / 64-token pages shuffled / contiguous slots, each with bf16 and fp8 index keys;
`sparse-mla-heads` the sparse MLA's launch options at 16 / 32 / 64 heads a program, batch 32 / 64;
`dsa-breakdown` the DSA step kernel by kernel over fp8 keys (keys_m) at batch 32 / 64; `dsa-batches-fp8`
random slots with bf16 keys, fp8 keys (q_fp8) and fp8 keys with the keys_m tile;
`scores-options` the scores kernel's launch options; `dsa-first-pass` the top-k's first pass fused or not;
`sparse-mla` the sparse MLA's launch options swept at batch 8 / 32 / 64. `scores-fp8` the scores kernel alone over
bf16 keys, fp8 keys, and fp8 keys with q rounded to fp8 in the kernel (q_fp8), batch 1-64. `decode-attn` the dense
decode attention at batch 1 over its key splits, key blocks and key-loop stages (8B's and 30B's heads, 513 and
4097 keys); `decode-attn-batches` its key blocks of 64 and 128 at batch 1-64, decode and verify widths.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections import defaultdict
from dataclasses import dataclass

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph
from specserve.kernels.triton_indexer import fuse_first_pass, index_scores_triton
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


GLM5 = dict(di=128, hi=32, h=64, c=512, r=64, topk=2048)  # indexer dim / heads, MLA heads / latent / rope, top-k
PAGE = 64  # tokens a page in the "paged" layout (the page size DSA deployments use)


@dataclass
class DsaLayer:
    """One GLM-5 layer's decode inputs at bs requests of kv keys each: index-key rows (bf16, or fp8 with a float32
    scale a slot), latent rows, each request's key slots, queries. layout: "random" (token slots shuffled: a pool
    fragmented slot by slot), "paged" (64-token pages shuffled: a paged pool after churn), "contiguous" (a fresh
    pool)."""
    rows: torch.Tensor
    scales: torch.Tensor | None
    lat: torch.Tensor
    kv_slots: torch.Tensor
    lens: torch.Tensor
    q: torch.Tensor
    wts: torch.Tensor
    qm: torch.Tensor

    @classmethod
    def build(cls, bs: int, kv: int, layout: str = "random", fp8: bool = False, seed: int | None = None) -> DsaLayer:
        g = torch.Generator(device=DEV).manual_seed(bs if seed is None else seed)
        n, di, hi, h, cr = bs * kv, GLM5["di"], GLM5["hi"], GLM5["h"], GLM5["c"] + GLM5["r"]
        rows = torch.randn((n + 16, di), device=DEV, dtype=torch.bfloat16, generator=g)
        scales = None
        if fp8:  # per-slot scale: the row's absmax over e4m3's largest value
            scales = rows.float().abs().amax(-1).clamp_min(1e-6) / 448.0
            rows = (rows.float() / scales[:, None]).to(torch.float8_e4m3fn)
        lat = torch.randn((n + 16, cr), device=DEV, dtype=torch.bfloat16, generator=g)
        if layout == "contiguous":
            order = torch.arange(n, device=DEV)
        elif layout == "paged":
            pages = torch.randperm(n // PAGE, device=DEV, generator=g)
            order = (pages[:, None] * PAGE + torch.arange(PAGE, device=DEV)).reshape(-1)
        else:
            order = torch.randperm(n, device=DEV, generator=g)
        return cls(rows, scales, lat, (order + 16).view(bs, kv), torch.full((bs,), kv, dtype=torch.int64, device=DEV),
                   torch.randn((bs, hi, di), device=DEV, dtype=torch.bfloat16, generator=g),
                   torch.randn((bs, hi), device=DEV, generator=g),
                   torch.randn((bs, h, cr), device=DEV, dtype=torch.bfloat16, generator=g))

    def sparse(self, fused: bool | None = None, keys_m: bool = False, fast_acc: bool = False):
        """The DSA step as attention/torch_mla_backend.py TritonIndexBackend runs it: the scores kernel (doing the
        top-k's first pass when `fused`; None: where fuse_first_pass says; over fp8 keys with q rounded to fp8,
        q_fp8; keys_m: the tile's dot as [keys, heads]; fast_acc: its fp8 sums in the tensor core), then the top-k,
        then the sparse MLA over the chosen rows."""
        bs, topk = self.lens.shape[0], GLM5["topk"]
        if fused is None:
            fused = fuse_first_pass(bs, self.kv_slots.shape[1], DEV)
        hist = topk_workspace(bs, DEV) if fused else None
        s = index_scores_triton(self.q, self.wts, self.rows, self.scales, self.kv_slots, self.lens, 1, hist=hist,
                                k=topk if fused else 0, q_fp8=self.scales is not None, keys_m=keys_m,
                                fast_acc=fast_acc)
        sel, cnt = index_topk_triton(s, self.lens, self.kv_slots, 1, topk, hist=hist)
        return mla_decode_triton(self.qm, self.lat, sel, cnt, 1, 0.07, GLM5["c"])

    def dense(self):
        return mla_decode_triton(self.qm, self.lat, self.kv_slots, self.lens, 1, 0.07, GLM5["c"])


def graph_us(fn, iters: int) -> float:
    graph, _, _ = capture_graph(fn, None)
    us = replay_us(graph, iters)
    del graph
    return us


def dsa(iters: int) -> None:
    layer = DsaLayer.build(1, 32768, seed=0)
    breakdown("DSA bs 1, 32k keys: scores + top-k + sparse MLA", layer.sparse, iters)
    breakdown("dense MLA bs 1, 32k keys", layer.dense, iters)
    # the sparse MLA's key splits over the 2048 chosen keys (num_key_splits picks 64: one key block a split)
    s = index_scores_triton(layer.q, layer.wts, layer.rows, None, layer.kv_slots, layer.lens, 1)
    sel, cnt = index_topk_triton(s, layer.lens, layer.kv_slots, 1, GLM5["topk"])
    c = GLM5["c"]
    want = mla_decode_triton(layer.qm, layer.lat, sel, cnt, 1, 0.07, c)
    for splits in (8, 16, 32, 64):
        fn = lambda n=splits: mla_decode_triton(layer.qm, layer.lat, sel, cnt, 1, 0.07, c, num_splits=n)  # noqa: E731
        torch.testing.assert_close(fn(), want, rtol=2e-2, atol=2e-2)
        print(f"sparse MLA over {GLM5['topk']} chosen keys, {splits:2d} splits: replay {graph_us(fn, iters):.1f} us")


def dsa_first_pass(iters: int) -> None:
    """The DSA step with the top-k's first pass in the scores kernel against in the top-k's own pass, batch 1-64."""
    print("\n=== one GLM-5 layer's DSA step over 32k keys a request: first pass fused / separate, replay us ===")
    for bs in (1, 8, 32, 64):
        layer = DsaLayer.build(bs, 32768)
        fused = graph_us(functools.partial(layer.sparse, True), iters)
        separate = graph_us(functools.partial(layer.sparse, False), iters)
        print(f"{bs:>4}: fused {fused:8.1f}  separate {separate:8.1f}")
        del layer
        torch.cuda.empty_cache()


def dsa_batches(iters: int, batch_sizes=(1, 8, 32, 64), layouts=("random",), key_types=("bf16",)) -> None:
    """Sparse against dense attention at 32k keys per request, at each batch size: one GLM-5 layer's
    DSA step (indexer scores + top-k + sparse MLA over the 2048 chosen rows) against dense MLA over all 32k keys,
    for each slot layout (DsaLayer) and index-key type (bf16; fp8 with a scale a slot, --indexer-cache-dtype, scored
    with q in fp8; fp8-m the same with the scores tile as [keys, heads], keys_m; fp8-f keys_m with fast_acc)."""
    print("\n=== one GLM-5 layer over 32k keys a request: DSA step vs dense MLA, graph replay us ===")
    print(f"{'layout':>10} {'keys':>4} {'bs':>4} | {'DSA step':>9} | {'dense MLA':>9} | {'dense / DSA':>11}")
    for layout in layouts:
        for bs in batch_sizes:
            dense_us = None
            for keys in key_types:
                layer = DsaLayer.build(bs, 32768, layout, fp8=keys != "bf16")
                if dense_us is None:  # the dense MLA reads no index keys: once a layout and batch
                    dense_us = graph_us(layer.dense, iters)
                sparse_us = graph_us(functools.partial(layer.sparse, keys_m=keys in ("fp8-m", "fp8-f"),
                                                       fast_acc=keys == "fp8-f"), iters)
                print(f"{layout:>10} {keys:>4} {bs:>4} | {sparse_us:9.1f} | {dense_us:9.1f} | "
                      f"{dense_us / sparse_us:10.2f}x")
                del layer
                torch.cuda.empty_cache()


def mla_keys_per_step(iters: int) -> None:
    """The absorbed-MLA kernel at 64-head launches with 32 against 64 keys a step, outputs checked equal; then one
    GLM-5 DSA step at batch 32 kernel by kernel."""
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
    breakdown("DSA bs 32, 32k keys: scores + top-k + sparse MLA", DsaLayer.build(32, 32768, seed=0).sparse, iters)


def dsa_breakdown(iters: int) -> None:
    """One GLM-5 DSA step over 32k keys a request kernel by kernel at batch 32 and 64, fp8 index keys with q_fp8 and
    the keys_m tile with fast_acc (what the DSA backend runs over fp8 keys)."""
    for bs in (32, 64):
        layer = DsaLayer.build(bs, 32768, fp8=True, seed=0)
        breakdown(f"DSA bs {bs}, 32k keys, fp8 keys, keys_m, fast_acc",
                  functools.partial(layer.sparse, keys_m=True, fast_acc=True), iters)
        del layer
        torch.cuda.empty_cache()


def scores_steps(iters: int) -> None:
    """The indexer's scores kernel (with the top-k's first pass) walking 1, 2, 4, 8 key blocks a program, GLM-5
    shapes over 32k keys a request, against the default (`key_steps`)."""
    print("\n=== indexer scores over 32k keys a request, replay us: steps 1 / 2 / 4 / 8 / default ===")
    for bs in (1, 8, 32, 64):
        x = DsaLayer.build(bs, 32768)
        hist = topk_workspace(bs, DEV)
        us = [graph_us(functools.partial(index_scores_triton, x.q, x.wts, x.rows, None, x.kv_slots, x.lens, 1,
                                         hist=hist, k=GLM5["topk"], steps=steps), iters)
              for steps in (1, 2, 4, 8, None)]
        print(f"{bs:>4}: " + " / ".join(f"{u:.1f}" for u in us))
        del x
        torch.cuda.empty_cache()


def scores_options(iters: int) -> None:
    """Where the indexer's scores kernel spends its time at batch 32 over 32k keys: its launch options one at a
    time against the default, the top-k's first pass left out, fp8 keys, contiguous slots."""
    print("\n=== indexer scores, 32 requests x 32k keys, replay us ===")
    for layout, fp8 in (("random", False), ("random", True)):
        x = DsaLayer.build(32, 32768, layout, fp8=fp8)
        hist = topk_workspace(32, DEV)
        base = functools.partial(index_scores_triton, x.q, x.wts, x.rows, x.scales, x.kv_slots, x.lens, 1)
        for name, kw in (("default", dict(hist=hist, k=GLM5["topk"])), ("no first pass", {}),
                         ("block_n 128", dict(hist=hist, k=GLM5["topk"], block_n=128)),
                         ("block_n 32", dict(hist=hist, k=GLM5["topk"], block_n=32)),
                         ("8 warps", dict(hist=hist, k=GLM5["topk"], num_warps=8)),
                         ("2 warps", dict(hist=hist, k=GLM5["topk"], num_warps=2)),
                         ("none, n 128", dict(block_n=128)), ("none, 2 warps", dict(num_warps=2)),
                         ("none, n 128 2 w", dict(block_n=128, num_warps=2)),
                         ("none, n 128 8 w", dict(block_n=128, num_warps=8))):
            us = graph_us(functools.partial(base, **kw), iters)
            print(f"{layout:>10} {'fp8' if fp8 else 'bf16'} {name:>14}: {us:7.1f}")
        del x
        torch.cuda.empty_cache()


def scores_fp8(iters: int) -> None:
    """The indexer's scores kernel alone (no first pass) over 32k keys a request: bf16 keys, fp8 keys converted to
    q's dtype (the default fp8 path), fp8 keys with q rounded to fp8 in the kernel (q_fp8: an fp8 x fp8 dot), at
    128- and 64-key tiles; q_fp8's scores checked against the converted path's at the scores' scale."""
    print("\n=== indexer scores alone, 32k keys a request, replay us ===")
    print("    bs | tile | bf16 keys | fp8 keys | fp8, q_fp8 | bf16 / q_fp8")
    for bs in (1, 8, 32, 64):
        x16, x8 = DsaLayer.build(bs, 32768), DsaLayer.build(bs, 32768, fp8=True)
        ref = index_scores_triton(x8.q, x8.wts, x8.rows, x8.scales, x8.kv_slots, x8.lens, 1)
        got = index_scores_triton(x8.q, x8.wts, x8.rows, x8.scales, x8.kv_slots, x8.lens, 1, q_fp8=True)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        for bn in (128, 64):
            us = [graph_us(functools.partial(index_scores_triton, x.q, x.wts, x.rows, x.scales, x.kv_slots, x.lens, 1,
                                             block_n=bn, q_fp8=q8), iters)
                  for x, q8 in ((x16, False), (x8, False), (x8, True))]
            print(f"  {bs:4d} | {bn:4d} | {us[0]:9.1f} | {us[1]:8.1f} | {us[2]:10.1f} | {us[0] / us[2]:6.2f}x"
                  f"   (q_fp8 max error {err:.1e} of the scores' scale)")
        del x16, x8, ref, got
        torch.cuda.empty_cache()


def scores_keys_m(iters: int) -> None:
    """The scores kernel's tile dot as [heads, keys] (default) against [keys, heads] (keys_m), 32k keys a request,
    bf16 keys, fp8 keys converted, fp8 keys with q_fp8; 128- and 256-key tiles; outputs checked equal in scale."""
    print("\n=== indexer scores alone, 32k keys a request, replay us: default / keys_m ===")
    print("    bs | tile |   bf16 keys   |   fp8 keys    |  fp8, q_fp8")
    for bs in (1, 8, 32, 64):
        x16, x8 = DsaLayer.build(bs, 32768), DsaLayer.build(bs, 32768, fp8=True)
        cells = []
        for bn in (128, 256):
            row = []
            for x, q8 in ((x16, False), (x8, False), (x8, True)):
                base = functools.partial(index_scores_triton, x.q, x.wts, x.rows, x.scales, x.kv_slots, x.lens, 1,
                                         block_n=bn, q_fp8=q8)
                want = base()
                got = base(keys_m=True)
                seen = torch.isfinite(want)
                err = ((got[seen] - want[seen]).abs().max() / want[seen].abs().max()).item()
                assert err < 1e-2, err
                row.append((graph_us(base, iters), graph_us(functools.partial(base, keys_m=True), iters)))
            cells.append(f"  {bs:4d} | {bn:4d} | " + " | ".join(f"{a:6.1f} / {b:5.1f}" for a, b in row))
        print("\n".join(cells))
        del x16, x8
        torch.cuda.empty_cache()


def scores_fp8_sweep(iters: int) -> None:
    """The scores kernel's launch options at batch 32 / 64 over 32k keys: bf16 keys and fp8 keys with q_fp8, key
    tiles x blocks a program x warps; outputs checked against each dtype's default. Prints the fastest few of each."""
    for bs in (32, 64):
        for fp8 in (False, True):
            x = DsaLayer.build(bs, 32768, fp8=fp8)
            want = index_scores_triton(x.q, x.wts, x.rows, x.scales, x.kv_slots, x.lens, 1, q_fp8=fp8)
            base = graph_us(functools.partial(index_scores_triton, x.q, x.wts, x.rows, x.scales, x.kv_slots, x.lens,
                                              1, q_fp8=fp8), iters)
            rows = []
            for km, bn, steps, warps in itertools.product((False, True), (64, 128, 256), (2, 4, 8, 16), (2, 4, 8)):
                fn = functools.partial(index_scores_triton, x.q, x.wts, x.rows, x.scales, x.kv_slots, x.lens, 1,
                                       q_fp8=fp8, block_n=bn, steps=steps, num_warps=warps, keys_m=km)
                try:
                    torch.testing.assert_close(fn(), want, rtol=1e-3, atol=1e-3)
                    rows.append((graph_us(fn, iters), f"{'keys_m ' if km else ''}tile {bn:3d} steps {steps:2d} "
                                                      f"warps {warps}"))
                except triton.runtime.errors.OutOfResources:
                    continue
            rows.sort()
            print(f"\n=== scores, batch {bs}, {'fp8 keys, q_fp8' if fp8 else 'bf16 keys'}: default {base:.1f} us; "
                  f"fastest of {len(rows)} ===")
            for us, name in rows[:5]:
                print(f"  {us:8.1f}  {base / us:5.2f}x  {name}")
            del x, want
            torch.cuda.empty_cache()


def sparse_mla_sweep(iters: int, block_hs=(None,), stages_list=(2, 3), batch_sizes=(8, 32, 64), top: int = 6) -> None:
    """The sparse MLA over each query's 2048 chosen rows (the DSA step's last kernel and its split combine), launch
    options swept at batch 8 / 32 / 64: key splits x warps x stages x keys a step (x heads a program, block_hs: None
    the default's); outputs checked against the default's. Prints the fastest few of each heads a program and the
    default."""
    c = GLM5["c"]
    for bs, bh in itertools.product(batch_sizes, block_hs):
        x = DsaLayer.build(bs, 32768)
        s = index_scores_triton(x.q, x.wts, x.rows, None, x.kv_slots, x.lens, 1)
        sel, cnt = index_topk_triton(s, x.lens, x.kv_slots, 1, GLM5["topk"])
        want = mla_decode_triton(x.qm, x.lat, sel, cnt, 1, 0.07, c)
        base = graph_us(lambda x=x, sel=sel, cnt=cnt: mla_decode_triton(x.qm, x.lat, sel, cnt, 1, 0.07, c), iters)
        rows = []
        for splits, warps, stages, bn in itertools.product((1, 2, 4, 8, 16), (4, 8), stages_list, (32, 64)):
            fn = functools.partial(mla_decode_triton, x.qm, x.lat, sel, cnt, 1, 0.07, c, num_splits=splits,
                                   num_warps=warps, num_stages=stages, block_n=bn, block_h=bh)
            try:
                torch.testing.assert_close(fn(), want, rtol=2e-2, atol=2e-2)
                rows.append((graph_us(fn, iters), f"splits {splits:2d} warps {warps} stages {stages} block_n {bn}"))
            except triton.runtime.errors.OutOfResources:
                continue
        rows.sort()
        print(f"\n=== sparse MLA over 2048 chosen rows, batch {bs}, heads a program {bh or 'default'}: default "
              f"{base:.1f} us; fastest of {len(rows)} ===")
        for us, name in rows[:top]:
            print(f"  {us:8.1f}  {base / us:5.2f}x  {name}")
        del x, s, sel, cnt
        torch.cuda.empty_cache()


def decode_attention(iters: int, layers: int = 8) -> None:
    """The decode attention at batch 1 (kernels/triton_attention.py fixed_width_attention, in-kernel split merge):
    Llama-3.1-8B's heads (32 q, 8 KV) and Qwen3-30B-A3B's (32 q, 4 KV), D 128, at 513 and 4097 keys in random cache
    slots, over the key splits and key blocks a launch could take; us a call from a graph of `layers` calls on
    distinct layers' caches, the L2 flushed between replays (bench_moe.time_ms). The backend's choice
    (TritonAttentionBackend.num_kv_splits) is 8 splits for a 2048-token graph, 32 for long contexts; block 64."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_moe import l2_flush, time_ms

    flush = l2_flush()
    g = torch.Generator(device=DEV).manual_seed(0)
    for name, hq, hkv in (("8B", 32, 8), ("30B", 32, 4)):
        for keys in (513, 4097):
            print(_decode_attention_row(name, hq, hkv, keys, layers, iters, flush, g, time_ms), flush=True)


def _decode_attention_row(name, hq, hkv, keys, layers, iters, flush, g, time_ms) -> str:
    from specserve.kernels.triton_attention import fixed_width_attention

    slots = 8192
    caches = [(torch.randn(slots, hkv, 128, generator=g, device=DEV).bfloat16(),
               torch.randn(slots, hkv, 128, generator=g, device=DEV).bfloat16()) for _ in range(layers)]
    table = torch.randperm(slots, generator=g, device=DEV)[None, :keys].contiguous()  # [1, keys]
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    lens = torch.full((1,), keys, dtype=torch.int64, device=DEV)
    q = torch.randn(1, hq, 128, generator=g, device=DEV).bfloat16()
    want = fixed_width_attention(q, *caches[0], table, rows, lens, 1, 1, 128 ** -0.5)
    line = f"{name} bs 1, {keys} keys (us, splits/key block/stages):"
    grid = [(sp, bn, 2) for sp, bn in itertools.product((1, 2, 4, 8, 16, 32), (32, 64, 128))]
    grid += [(sp, 64, st) for sp, st in itertools.product((8, 32), (1, 3))]  # the key loop's pipelining depth
    for splits, block_n, stages in grid:
        def call(splits=splits, block_n=block_n, stages=stages):
            return [fixed_width_attention(q, kc, vc, table, rows, lens, 1, splits, 128 ** -0.5, block_n=block_n,
                                          num_stages=stages) for kc, vc in caches]
        torch.testing.assert_close(call()[0], want, atol=2e-2, rtol=2e-2)
        graph, _, _ = capture_graph(call, None)
        line += f" {splits}/{block_n}/{stages} {time_ms(graph.replay, iters, 5, flush) * 1e3 / layers:.2f}"
        del graph
    return line


def decode_attention_batches(iters: int, layers: int = 8) -> None:
    """Key blocks of 64 against 128 for the fixed-width attention at batch 1-64, decode (width 1) and verify (width
    4), 8B's and 30B's heads, 513 and 4097 keys a request in random cache slots, at the key splits the backend
    takes (triton_backend.kv_splits with 132 SMs) for a graph of 2048 and of 8192 tokens; us a call from
    a graph of `layers` calls on distinct layers' caches, the L2 flushed between replays."""
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_moe import l2_flush, time_ms

    from specserve.attention.triton_backend import kv_splits

    flush = l2_flush()
    g = torch.Generator(device=DEV).manual_seed(0)
    slots = 65536
    for name, hq, hkv in (("8B", 32, 8), ("30B", 32, 4)):
        caches = [(torch.randn(slots, hkv, 128, generator=g, device=DEV).bfloat16(),
                   torch.randn(slots, hkv, 128, generator=g, device=DEV).bfloat16()) for _ in range(layers)]
        for bs, width, keys in itertools.product((1, 8, 32, 64), (1, 4), (513, 4097)):
            table = torch.stack([torch.randperm(slots, generator=g, device=DEV)[:keys] for _ in range(bs)])
            rows = torch.arange(bs, dtype=torch.int64, device=DEV)
            lens = torch.full((bs,), keys, dtype=torch.int64, device=DEV)
            q = torch.randn(bs * width, hq, 128, generator=g, device=DEV).bfloat16()
            line = f"{name} bs {bs} width {width} {keys} keys (us, graph tokens/splits/key block):"
            for graph_tokens in (2048, 8192):
                splits = kv_splits(bs, hkv, graph_tokens, 132)
                outs = []
                for block_n in (64, 128):
                    call = functools.partial(_attend_layers, q, caches, table, rows, lens, width, splits, block_n)
                    outs.append(call()[0])
                    graph, _, _ = capture_graph(call, None)
                    us = time_ms(graph.replay, iters, 5, flush) * 1e3 / layers
                    line += f" {graph_tokens}/{splits}/{block_n} {us:.2f}"
                    del graph
                torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
            print(line, flush=True)
        del caches


def _attend_layers(q, caches, table, rows, lens, width, splits, block_n):
    from specserve.kernels.triton_attention import fixed_width_attention

    return [fixed_width_attention(q, kc, vc, table, rows, lens, width, splits, 128 ** -0.5, block_n=block_n)
            for kc, vc in caches]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--parts", nargs="*", default=["sampler", "dsa"])
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    a = p.parse_args()
    tee_stdout_to(a.output_file)
    parts = {"sampler": sampler, "dsa": dsa, "dsa-batches": dsa_batches, "mla-n64": mla_keys_per_step,
             "scores-steps": scores_steps, "scores-options": scores_options, "dsa-first-pass": dsa_first_pass,
             "sparse-mla": sparse_mla_sweep,
             "sparse-mla-heads": functools.partial(sparse_mla_sweep, block_hs=(16, 32, 64), stages_list=(2,),
                                                   batch_sizes=(32, 64), top=3),
             "scores-fp8": scores_fp8, "scores-fp8-sweep": scores_fp8_sweep,
             "scores-keys-m": scores_keys_m, "dsa-breakdown": dsa_breakdown,
             "dsa-batches-fp8": functools.partial(dsa_batches, key_types=("bf16", "fp8", "fp8-m", "fp8-f")),
             "dsa-batches-contiguous": functools.partial(dsa_batches, layouts=("contiguous",)),
             "dsa-layouts": functools.partial(dsa_batches, layouts=("random", "paged", "contiguous"),
                                              key_types=("bf16", "fp8")),
             "decode-attn": decode_attention, "decode-attn-batches": decode_attention_batches}
    for part in a.parts:
        parts[part](a.iters)


if __name__ == "__main__":
    main()
