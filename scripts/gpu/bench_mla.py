"""MLA / DSA kernel times on GLM-5 shapes (64 heads, latent rows of 512 + 64, indexer 32 heads x 128, top 2048),
one layer, bf16, timed as CUDA-graph replays (the kernels without the host launch):

- absorbed MLA over dense contexts: the Triton kernel (heads per program 16 / 32; key splits automatic, and 1)
  against the torch reference backend's SDPA over the gathered rows, with the bytes floor (each request's latent
  rows read once) at the measured copy bandwidth;
- sparse MLA over per-query lists of 2048 rows (every query token its own row), the kernel only;
- the indexer: the Triton scores over every key plus the stable top-k (topk_slots), against the torch reference's
  einsum scores.

    python3 scripts/gpu/bench_mla.py [sparse] [mla] [indexer]     (default: all three)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from bench_gdn import bench_graph, copy_bw

from specserve.attention.torch_mla_backend import topk_slots
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


def main() -> None:
    parts = sys.argv[1:] or ["sparse", "mla", "indexer"]
    bw = copy_bw()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s")
    for name, fn in (("sparse", sparse_rows), ("mla", mla_rows), ("indexer", indexer_rows)):
        if name in parts:
            fn(bw)


if __name__ == "__main__":
    main()
