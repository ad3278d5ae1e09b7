"""MLA / DSA kernel times on GLM-5 shapes (64 heads, latent rows of 512 + 64, indexer 32 heads x 128, top 2048),
one layer, bf16, timed as CUDA-graph replays (the kernels without the host launch):

- absorbed MLA over dense contexts: the Triton kernel (heads per program 16 / 32; key splits automatic, and 1)
  against the torch reference backend's SDPA over the gathered rows, with the bytes floor (each request's latent
  rows read once) at the measured copy bandwidth;
- sparse MLA over per-query lists of 2048 rows (every query token its own row), the kernel only;
- the indexer: the Triton scores over every key plus the stable top-k (topk_slots), against the torch reference's
  einsum scores;
- `sweep` (only when asked): the absorbed-MLA kernel's launch options (heads per program, keys per step, warps,
  pipeline stages) searched per shape, dense and sparse, against the defaults; ends with a dict literal of the best
  options per shape for a policy.
Times are printed in us per call; "floor" rows are the bytes floor's time, so kernel / floor near 1 is at the copy
bandwidth. Needs a CUDA GPU.

    python3 scripts/gpu/bench_mla.py [sparse] [mla] [indexer] [sweep] [--budget SECONDS] [--output-file PATH]
                                                                  (default: the first three; sweep budget 240 s)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_gdn import bench_graph, copy_bw

from specserve.attention.torch_mla_backend import topk_slots
from specserve.bench.tee import tee_stdout_to
from specserve.kernels.triton_indexer import index_scores_triton
from specserve.kernels.triton_mla import mla_decode_triton
from specserve.kernels.triton_topk import index_topk_triton

H, C, R, HI, DI, TOPK = 64, 512, 64, 32, 128, 2048
DEV = torch.device("cuda")
BF = torch.bfloat16


def dense_inputs(bs: int, w: int, kv: int):
    g = torch.Generator(device=DEV).manual_seed(bs + kv)
    rows = torch.randn((bs * kv + 16, C + R), device=DEV, dtype=BF, generator=g)
    kv_slots = (torch.randperm(bs * kv, device=DEV, generator=g) + 16).view(bs, kv)
    lens = torch.full((bs,), kv, dtype=torch.int64, device=DEV)
    q = torch.randn((bs * w, H, C + R), device=DEV, dtype=BF, generator=g)
    return q, rows, kv_slots, lens


def torch_dense(q, rows, kv_slots, w):
    """The torch reference backend's fixed-width path (attention/torch_mla_backend.py), causal mask of width w."""
    bs, kv = kv_slots.shape
    keys = rows.index_select(0, kv_slots.reshape(-1)).view(bs, 1, kv, -1)
    pos = torch.arange(kv, device=DEV)
    mask = (pos[None, :] < kv - w + torch.arange(w, device=DEV)[:, None] + 1)[None, None]  # [1, 1, w, kv]
    qq = q.view(bs, w, H, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(qq, keys, keys[..., :C], attn_mask=mask, scale=0.07, enable_gqa=True)


def kernel_variants(q, rows, kv_slots, lens, w) -> dict[str, float]:
    """ms of the Triton kernel: 16 heads per program with automatic and with no key splits, 32 with automatic."""
    t = {}
    for name, bh, sp in (("h16", 16, None), ("h16_1", 16, 1), ("h32", 32, None)):
        try:
            t[name] = bench_graph(lambda bh=bh, sp=sp: mla_decode_triton(q, rows, kv_slots, lens, w, 0.07, C,
                                                                         block_h=bh, num_splits=sp))
        except Exception as e:  # a tile that does not fit: report, keep going
            print(f"  ({name} failed: {type(e).__name__}: {str(e)[:80]})")
            t[name] = float("nan")
    return t


def mla_row(bs: int, w: int, kv: int, bw: float) -> None:
    q, rows, kv_slots, lens = dense_inputs(bs, w, kv)
    t = kernel_variants(q, rows, kv_slots, lens, w)
    try:
        t["torch"] = bench_graph(lambda: torch_dense(q, rows, kv_slots, w), reps=5)
    except torch.OutOfMemoryError:
        t["torch"] = float("nan")
    floor = bs * kv * (C + R) * 2 / bw * 1e3
    best = min(v for v in (t["h16"], t["h16_1"], t["h32"]) if v == v)
    print(f"{bs:>3} {w:>2} {kv:>6} | {t['h16']:9.4f} {t['h16_1']:9.4f} {t['h32']:9.4f} | "
          f"{t['torch']:8.4f} | {floor:7.4f} | {best / floor:10.2f}")


def mla_rows(bw: float) -> None:
    print(f"\n--- absorbed MLA, dense contexts (ms per layer; floor = latent rows once at {bw / 1e9:.0f} GB/s) ---")
    print(f"{'bs':>3} {'w':>2} {'kv':>6} | {'h16 auto':>9} {'h16 1sp':>9} {'h32 auto':>9} | {'torch':>8} | "
          f"{'floor':>7} | {'best/floor':>10}")
    for kv in (4096, 32768):
        for bs in (1, 8, 32, 64):
            for w in (1, 4):
                mla_row(bs, w, kv, bw)
                torch.cuda.empty_cache()


def sparse_rows(bw: float) -> None:
    print(f"\n--- sparse MLA: each query token over its own {TOPK} rows (ms per layer) ---")
    print(f"{'tokens':>6} | {'h16 auto':>9} {'h16 1sp':>9} {'h32 auto':>9} | {'floor':>7}")
    slots = 32768 * 4
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = torch.randn((slots, C + R), device=DEV, dtype=BF, generator=g)
    for tokens in (1, 4, 8, 32, 128, 256):
        sel = torch.randint(1, slots, (tokens, TOPK), device=DEV, generator=g)
        counts = torch.full((tokens,), TOPK, dtype=torch.int64, device=DEV)
        q = torch.randn((tokens, H, C + R), device=DEV, dtype=BF, generator=g)
        t = kernel_variants(q, rows, sel, counts, 1)
        floor = tokens * TOPK * (C + R) * 2 / bw * 1e3
        print(f"{tokens:>6} | {t['h16']:9.4f} {t['h16_1']:9.4f} {t['h32']:9.4f} | {floor:7.4f}")


def indexer_row(bs: int, w: int, kv: int, bw: float, live: int | None = None) -> None:
    """live: the requests' length when shorter than the graph's key width kv."""
    g = torch.Generator(device=DEV).manual_seed(bs)
    rows = torch.randn((bs * kv + 16, DI), device=DEV, dtype=BF, generator=g)
    kv_slots = (torch.randperm(bs * kv, device=DEV, generator=g) + 16).view(bs, kv)
    lens = torch.full((bs,), live or kv, dtype=torch.int64, device=DEV)
    q = torch.randn((bs * w, HI, DI), device=DEV, dtype=BF, generator=g)
    wts = torch.randn((bs * w, HI), device=DEV, generator=g)
    q_len = (live or kv) - w + 1 + torch.arange(w, device=DEV)  # [w] each query's causal length
    valid = (torch.arange(kv, device=DEV)[None, :] < q_len[:, None]).expand(bs, w, kv)

    def scores():
        return index_scores_triton(q, wts, rows, None, kv_slots, lens, w)

    def with_topk():
        return index_topk_triton(scores(), lens, kv_slots, w, TOPK)

    def with_torch_topk():
        return topk_slots(scores(), valid, kv_slots, TOPK)

    def torch_scores():
        keys = rows.index_select(0, kv_slots.reshape(-1)).view(bs, kv, DI).float()
        s = torch.einsum("bwhd,bkd->bwhk", q.view(bs, w, HI, DI).float(), keys).relu()
        return torch.einsum("bwh,bwhk->bwk", wts.view(bs, w, HI), s)

    a, b, b2 = bench_graph(scores), bench_graph(with_topk, reps=5), bench_graph(with_torch_topk, reps=5)
    try:
        c = bench_graph(torch_scores, reps=5)
    except torch.OutOfMemoryError:
        c = float("nan")
    floor = bs * kv * DI * 2 / bw * 1e3
    label = f"{kv}" if live is None else f"{live}/{kv}"
    print(f"{bs:>3} {w:>2} {label:>11} | {a:8.4f} {b:8.4f} {b2:8.4f} | {c:8.4f} | {floor:7.4f}")


def indexer_rows(bw: float) -> None:
    print("\n--- DSA indexer (ms per layer): Triton scores; + Triton top-k (kernels/triton_topk.py); + torch top-k "
          "(topk_slots); torch einsum scores ---")
    print(f"{'bs':>3} {'w':>2} {'kv':>11} | {'scores':>8} {'+tri k':>8} {'+torch k':>8} | {'torch':>8} | "
          f"{'floor':>7}")
    for kv in (2048, 4096, 32768, 131072):
        for bs in (1, 8, 32):
            for w in (1, 4):
                if bs * kv <= 32 * 32768:
                    indexer_row(bs, w, kv, bw)
                torch.cuda.empty_cache()
    for bs in (1, 8):  # a graph captured for 32k keys serving 1k-token requests
        indexer_row(bs, 4, 32768, bw, live=1024)


# --- sweep: the kernel's launch options, per shape ---

SWEEP_DENSE = ((1, 1, 4096), (1, 1, 32768), (8, 1, 32768), (1, 4, 4096), (8, 4, 4096), (64, 4, 4096),
               (32, 1, 32768), (8, 4, 32768))  # (bs, w, keys)
SWEEP_SPARSE = (1, 4, 32, 256)  # query tokens, each over its own TOPK rows


def acc_fits(block_h: int, num_warps: int) -> bool:
    """The float32 [heads, C] accumulator at most 64 x 256 per 4 warps (128 registers a thread); larger spills."""
    return block_h * C <= 64 * 256 * num_warps // 4


def label(k: dict) -> str:
    return f"h{k['block_h']} n{k['block_n']} w{k['num_warps']} s{k['num_stages']}"


def tile_configs(w: int) -> list[dict]:
    """Stage 1: every heads-per-program at 32 keys a step and 2 stages, with 4 and 8 warps where the accumulator
    fits; 64 heads (one Hopper warpgroup MMA) first."""
    return [dict(block_h=bh, block_n=32, num_warps=nw, num_stages=2) for bh in (64, 32, 16) for nw in (8, 4)
            if acc_fits(bh, nw)]


def neighbours(k: dict) -> list[dict]:
    """Stage 2: a stage-1 winner with the other keys per step and stages."""
    return [dict(k, block_n=bn, num_stages=ns) for bn in (32, 64) for ns in (1, 2)]


def sweep_shape(name: str, q, rows, kv_slots, lens, w: int, floor: float, deadline: float) -> tuple[float, dict]:
    """Times the defaults and the configs of both stages until `deadline` (time.perf_counter()); each config's
    output is checked against the defaults' first. -> (best us, best options; {} for the defaults)."""
    call = lambda **k: mla_decode_triton(q, rows, kv_slots, lens, w, 0.07, C, **k)
    want = call().float()
    default = bench_graph(call, reps=10) * 1e3
    timed: dict[str, float] = {}
    known: dict[str, dict] = {}  # label -> options, of every config tried
    failed, wrong, left = [], [], 0
    for stage in (1, 2):
        if stage == 1:
            configs = tile_configs(w)
        else:  # the two fastest tiles of stage 1, varied
            configs = [n for key in sorted(timed, key=timed.get)[:2] for n in neighbours(known[key])]
        for k in configs:
            key = label(k)
            if key in known:
                continue
            if time.perf_counter() > deadline:
                left += 1
                continue
            known[key] = k
            try:
                got = call(**k).float()
                if not torch.allclose(got, want, atol=2e-2 * want.abs().max().item(), rtol=0):
                    wrong.append(key)
                    continue
                timed[key] = bench_graph(lambda k=k: call(**k), reps=10) * 1e3
            except Exception as e:  # out of shared memory / registers, or a compile error: report, keep going
                failed.append(f"{key} ({type(e).__name__}: {str(e)[:60]})")
    best_key = min(timed, key=timed.get) if timed else None
    best = timed[best_key] if best_key else float("nan")
    speedup = default / best if best_key else float("nan")
    print(f"{name:>22} | {default:9.1f} {best:9.1f} {speedup:7.2f}x | {floor:7.1f} | {len(timed):>3} timed "
          f"{left:>3} left | {best_key}")
    for f in failed:
        print(f"{'':>24}failed: {f}")
    for f in wrong:
        print(f"{'':>24}WRONG OUTPUT: {f}")
    if best_key is None or best >= default:
        return default, {}
    return best, known[best_key]


def sweep(bw: float, budget: float) -> None:
    print(f"\n--- absorbed-MLA launch options (us per layer; {budget:.0f} s budget shared by the shapes; floor = rows "
          f"once at {bw / 1e9:.0f} GB/s; best config: heads / value dims / query tokens a program, keys a step, "
          "warps, stages) ---")
    print(f"{'shape':>22} | {'default':>9} {'best':>9} {'speedup':>8} | {'floor':>7} | {'configs':>16} | best config")
    shapes = len(SWEEP_DENSE) + len(SWEEP_SPARSE)
    start = time.perf_counter()
    policy = {}
    for n, (bs, w, kv) in enumerate(SWEEP_DENSE):
        q, rows, kv_slots, lens = dense_inputs(bs, w, kv)
        floor = bs * kv * (C + R) * 2 / bw * 1e6
        us, k = sweep_shape(f"dense bs{bs} w{w} kv{kv}", q, rows, kv_slots, lens, w, floor,
                            start + budget * (n + 1) / shapes)
        policy[("dense", bs, w, kv)] = (k, us)
        del q, rows, kv_slots, lens
        torch.cuda.empty_cache()
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = torch.randn((32768 * 4, C + R), device=DEV, dtype=BF, generator=g)
    for n, tokens in enumerate(SWEEP_SPARSE, start=len(SWEEP_DENSE)):
        sel = torch.randint(1, rows.shape[0], (tokens, TOPK), device=DEV, generator=g)
        counts = torch.full((tokens,), TOPK, dtype=torch.int64, device=DEV)
        q = torch.randn((tokens, H, C + R), device=DEV, dtype=BF, generator=g)
        floor = tokens * TOPK * (C + R) * 2 / bw * 1e6
        us, k = sweep_shape(f"sparse {tokens} x {TOPK}", q, rows, sel, counts, 1, floor,
                            start + budget * (n + 1) / shapes)
        policy[("sparse", tokens, 1, TOPK)] = (k, us)
    print(f"\nsweep took {time.perf_counter() - start:.0f} s. Best options per shape ((kind, bs or tokens, w, keys); "
          "{} = the defaults):\nMLA_LAUNCH = {")
    for key, (k, us) in policy.items():
        opts = ", ".join(f"{a}={b}" for a, b in k.items())
        print(f"    {key!r}: dict({opts}),  # {us:.1f} us")
    print("}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", help="what to time, of sparse mla indexer sweep (default: the first three)")
    p.add_argument("--budget", type=float, default=240.0, help="seconds the sweep may take")
    p.add_argument("--output-file", default=None, help="also write the printed tables to this file (text)")
    args = p.parse_args()
    if set(args.parts) - {"sparse", "mla", "indexer", "sweep"}:
        p.error(f"unknown parts {args.parts}: choose from sparse mla indexer sweep")
    tee_stdout_to(args.output_file)
    budget = args.budget
    parts = args.parts or ["sparse", "mla", "indexer"]
    bw = copy_bw()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s")
    for name, fn in (("sparse", sparse_rows), ("mla", mla_rows), ("indexer", indexer_rows)):
        if name in parts:
            fn(bw)
    if "sweep" in parts:
        sweep(bw, budget)


if __name__ == "__main__":
    main()
