"""Decode-row projections, unfused (norm + cuBLAS + SiLU-and-mul) against the fused Triton GEMVs, bfloat16.

Today's path (Triton add+RMSNorm, cuBLAS F.linear, Triton SiLU-and-mul) against specserve/kernels/triton_gemv.py
(norm_gemv, gemv), as CUDA-graph replays:

    python3 scripts/gpu/bench_gemv.py [--shapes llama-3.1-8b smollm2-135m qwen3-30b-a3b qwen3-8b] [--iters 50] [--sweep]
        [--rows 1 2 3 4 5] [--output-file PATH]

Per layer: qkv = add_rms_norm + F.linear (fused: norm_gemv), o = F.linear (gemv), gate_up = add_rms_norm + F.linear
+ silu_and_mul (norm_gemv with silu_mul), down = F.linear (gemv); Qwen3-30B-A3B: the attention projections only (its
MLP is MoE). Each graph holds L back-to-back calls on L distinct weights (--layers, default 8 for 8B and Qwen3, 30
for SmolLM2, as the layers of a model) and a replay's CUDA-event time over L is the per-call time, the median of
--iters replays. Between replays a 256 MB read flushes the L2 (unless --warm), so each replay streams its weights
from HBM as a decode step does. The "layer" row chains a layer's projections (the o output is the second norm's
input, the SiLU-and-mul output the down projection's): it includes the gaps between kernels. Bandwidth counts the
weight bytes only, against 4.2 TB/s. Before timing, the fused outputs are checked against the unfused ones
(assert_close, atol 2e-2; h, the new residual, must be equal per projection).

--sweep also times, per projection (weight rows, K) at each M of --rows, a pruned grid of launch configurations:
BLOCK_N in 2..32 x BLOCK_K in 128..1024 at 4 warps / 2 stages, then num_warps 1..8 at the best tile, then
num_stages 1..4 at the best of those (about 25 configurations per projection, 10 projections for the three shape
sets); it prints the best per (rows, K) as a dict to paste into kernels/tuned_h200.py GEMV_TUNED (M = 1) or, at
M > 1, for the GEMV with its M rows unrolled, into GEMV_TUNED_ROWS. Triton's compilation (about a second a
configuration) dominates its time; --shapes limits it. With more than one M in --rows it also prints, per weight
shape whose M > 1 calls ran the row-unrolled GEMV, the most rows up to which that beat the unfused path at every
M measured (tuned_h200.FASTER_ROWS), and the shapes the fused kernels beat the unfused path on (tuned_h200.FASTER).
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_moe import PEAK_BW, l2_flush, time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph
from specserve.kernels.triton_act import silu_and_mul
from specserve.kernels.triton_gemv import gemv, gemv_config, norm_gemv
from specserve.kernels.triton_norm import add_rms_norm

# name: (hidden, qkv rows, attention output width (o's K), intermediate or None (MoE: attention only), layers)
SHAPES = {
    "llama-3.1-8b": (4096, 4096 + 2 * 1024, 4096, 14336, 8),
    "smollm2-135m": (576, 9 * 64 + 2 * 3 * 64, 576, 1536, 30),
    "qwen3-30b-a3b": (2048, (32 + 2 * 4) * 128, 32 * 128, None, 8),
    "qwen3-8b": (4096, (32 + 2 * 8) * 128, 32 * 128, 12288, 8),
}
EPS = 1e-5
DTYPE = torch.bfloat16
DEV = torch.device("cuda")
SWEEP_N = (2, 4, 8, 16, 32)
SWEEP_K = (128, 256, 512, 1024)
SWEEP_WARPS = (1, 2, 4, 8)
SWEEP_STAGES = (1, 2, 3, 4)


class Proj:
    """One projection kind over L distinct weights: `unfused(l)` and `fused(l, config)` run layer l's call."""

    def __init__(self, name: str, rows: int, k: int, norm: bool, silu: bool, m: int, layers: int, g):
        self.name, self.rows, self.k, self.norm, self.silu = name, rows, k, norm, silu
        dev = DEV  # (a module global: CPU smoke runs of this file's logic set it)
        self.ws = [(torch.randn(rows, k, generator=g, device=dev) * k ** -0.5).to(DTYPE) for _ in range(layers)]
        self.x = torch.randn(m, k, generator=g, device=dev).to(DTYPE)  # [M, K]
        self.res = (torch.randn(m, k, generator=g, device=dev) * 4).to(DTYPE) if norm else None
        self.nws = [(1 + 0.1 * torch.randn(k, generator=g, device=dev)).to(DTYPE) for _ in range(layers)] if norm \
            else None

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.k * self.ws[0].element_size()

    def unfused(self, layer: int):
        w = self.ws[layer]
        if not self.norm:
            return F.linear(self.x, w), None
        a, h = add_rms_norm(self.x, self.res, self.nws[layer], EPS)
        y = F.linear(a, w)
        return (silu_and_mul(y) if self.silu else y), h

    def fused(self, layer: int, config=None):
        if not self.norm:
            return gemv(self.x, self.ws[layer], config=config), None
        return norm_gemv(self.x, self.res, self.nws[layer], EPS, 0.0, self.ws[layer], silu_mul=self.silu,
                         config=config)

    def check(self, config=None, layers=(0,)) -> None:
        for layer in layers:
            (y, h), (want_y, want_h) = self.fused(layer, config), self.unfused(layer)
            torch.testing.assert_close(y, want_y, atol=2e-2, rtol=2e-2, msg=lambda s: f"{self.name}: {s}")
            assert h is None or torch.equal(h, want_h), f"{self.name}: h differs from x + residual"

    def graph_us(self, fn, iters: int, flush) -> float:
        """Median per-call microseconds of a graph of L back-to-back calls fn(l)."""
        graph, _, _ = capture_graph(lambda: [fn(layer) for layer in range(len(self.ws))], None)
        us = time_ms(graph.replay, iters, 10, flush) * 1e3 / len(self.ws)
        del graph
        return us

    def config(self, m: int) -> dict[str, int]:
        return gemv_config(m, self.rows, self.k, DTYPE, self.silu)


def projections(hidden: int, qkv: int, q_width: int, inter: int | None, m: int, layers: int, g) -> list[Proj]:
    out = [Proj("qkv", qkv, hidden, True, False, m, layers, g), Proj("o", hidden, q_width, False, False, m, layers, g)]
    if inter is not None:
        out += [Proj("gate_up", 2 * inter, hidden, True, True, m, layers, g),
                Proj("down", hidden, inter, False, False, m, layers, g)]
    return out


def layer_fns(projs: list[Proj], m: int, pdl: bool = True):
    """(unfused(l), fused(l)): one layer's projections chained (the o output is the second norm's x, the SiLU-and-mul
    output the down projection's input; qkv's output stands for the attention's input and is dropped). pdl False:
    the fused kernels with programmatic dependent launch off (their configs' PDL=0)."""
    qkv, o = projs[0], projs[1]
    mlp = projs[2:]
    cfg = {p.name: None if pdl else dict(p.config(m), PDL=0) for p in projs}

    def unfused(layer: int):
        a, h = add_rms_norm(qkv.x, qkv.res, qkv.nws[layer], EPS)
        F.linear(a, qkv.ws[layer])
        out = F.linear(o.x, o.ws[layer])
        if mlp:
            gate_up, down = mlp
            a, h = add_rms_norm(out, h, gate_up.nws[layer], EPS)
            out = F.linear(silu_and_mul(F.linear(a, gate_up.ws[layer])), down.ws[layer])
        return out, h

    def fused(layer: int):
        _, h = norm_gemv(qkv.x, qkv.res, qkv.nws[layer], EPS, 0.0, qkv.ws[layer], config=cfg["qkv"])
        out = gemv(o.x, o.ws[layer], config=cfg["o"])
        if mlp:
            gate_up, down = mlp
            act, h = norm_gemv(out, h, gate_up.nws[layer], EPS, 0.0, gate_up.ws[layer], silu_mul=True,
                               config=cfg["gate_up"])
            out = gemv(act, down.ws[layer], config=cfg["down"])
        return out, h

    return unfused, fused


def bw_cols(us: float, nbytes: int) -> str:
    gbs = nbytes / (us * 1e-6) / 1e9
    return f"{us:9.2f} {gbs:7.0f} {gbs * 1e9 / PEAK_BW:6.0%}"


def cfg_str(cfg: dict[str, int]) -> str:
    return f"N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"


def bench_shape(name: str, args, g, flush, tuned: dict, faster: set, tuned_rows: dict, wins: dict) -> None:
    hidden, qkv, q_width, inter, default_layers = SHAPES[name]
    layers = args.layers or default_layers
    for m in args.rows:
        projs = projections(hidden, qkv, q_width, inter, m, layers, g)
        mb = sum(p.weight_bytes for p in projs) / 2 ** 20
        print(f"\n{name}: M {m}, hidden {hidden}, {layers} distinct weights per projection in a graph, "
              f"{mb:.1f} MB of weights per layer")
        print(f"{'proj':>8} {'rows':>6} {'K':>6} {'MB':>6} | {'unfused us':>9} {'GB/s':>7} {'peak':>6} | "
              f"{'fused us':>9} {'GB/s':>7} {'peak':>6} | {'ratio':>6}  config")
        unfused_us = {}
        for p in projs:
            p.check(layers=(0, layers - 1))
            base = unfused_us[p.name] = p.graph_us(p.unfused, args.iters, flush)
            one = p.graph_us(p.fused, args.iters, flush)
            print(f"{p.name:>8} {p.rows:6d} {p.k:6d} {p.weight_bytes / 2 ** 20:6.1f} | "
                  f"{bw_cols(base, p.weight_bytes)} | {bw_cols(one, p.weight_bytes)} | {base / one:5.2f}x  "
                  f"{cfg_str(p.config(m))}")
            if m > 1 and p.config(m).get("GEMV"):
                wins.setdefault((p.rows, p.k), {})[m] = one < base
        unfused, fused = layer_fns(projs, m)
        _, fused_no_pdl = layer_fns(projs, m, pdl=False)
        for layer in (0, layers - 1):  # (h = o's output + residual: o's output differs in its rounding)
            for got, want in zip(fused(layer), unfused(layer)):
                torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            for got, want in zip(fused(layer), fused_no_pdl(layer)):
                assert torch.equal(got, want), "the PDL launches changed the fused layer's outputs"
        nbytes = sum(p.weight_bytes for p in projs)
        base = projs[0].graph_us(unfused, args.iters, flush)
        one = projs[0].graph_us(fused, args.iters, flush)
        no_pdl = projs[0].graph_us(fused_no_pdl, args.iters, flush)
        print(f"{'layer':>8} {'':6} {'':6} {nbytes / 2 ** 20:6.1f} | {bw_cols(base, nbytes)} | "
              f"{bw_cols(one, nbytes)} | {base / one:5.2f}x  (fused with PDL off: {no_pdl:.2f} us, "
              f"PDL {no_pdl / one:.2f}x)")
        if args.sweep:
            for p in projs:
                best, best_us = sweep(p, args.iters, flush, m)
                (tuned if m == 1 else tuned_rows)[(p.rows, p.k)] = best
                if m == 1 and best_us < unfused_us[p.name]:
                    faster.add((p.rows, p.k))
                if m > 1:
                    wins.setdefault((p.rows, p.k), {})[m] = best_us < unfused_us[p.name]
        del projs
        if args.sweep and m > 1:  # the best row-GEMV config of M = m at the fewer rows 2..m-1, against the unfused
            for fewer in range(2, m):
                for p in projections(hidden, qkv, q_width, inter, fewer, layers, g):
                    cfg = tuned_rows[(p.rows, p.k)]
                    p.check(cfg)
                    base = p.graph_us(p.unfused, args.iters, flush)
                    one = p.graph_us(lambda layer, p=p, cfg=cfg: p.fused(layer, cfg), args.iters, flush)
                    wins[(p.rows, p.k)][fewer] = one < base
                    print(f"{p.name:>8} M {fewer}: unfused {base:.2f} us, row GEMV {one:.2f} us ({base / one:.2f}x) "
                          f"{cfg_str(cfg)}")


def valid(p: Proj, cfg: dict[str, int], m: int = 1) -> bool:
    """Skip tiles past one K step of the row, with fewer weight elements than threads, with more than 128 float32
    accumulator elements a thread over the m rows' tiles (spills), or grids of fewer than 32 programs."""
    w_rows = 2 if p.silu else 1
    tile = w_rows * cfg["BLOCK_N"] * cfg["BLOCK_K"]
    threads = 32 * cfg["num_warps"]
    cols = p.rows // w_rows
    return (cfg["BLOCK_K"] <= max(128, 1 << (p.k - 1).bit_length()) and threads <= tile <= 128 * threads // m
            and -(-cols // cfg["BLOCK_N"]) >= 32)


def sweep(p: Proj, iters: int, flush, m: int = 1) -> tuple[dict[str, int], float]:
    """(the best config for p at M = m, by a pruned search (see the module doc), its us); prints the timings. At
    m > 1 the configs are the row-unrolled GEMV's (GEMV=1), started from the M = 1 config."""
    rows_gemv = {"GEMV": 1} if m > 1 else {}
    t0 = time.time()
    seen: dict[tuple, float] = {}

    def timed(cfg: dict[str, int]) -> float:
        key = tuple(sorted(cfg.items()))
        if key not in seen:
            if not valid(p, cfg, m):
                seen[key] = float("inf")
            else:
                p.check(cfg)
                seen[key] = p.graph_us(lambda layer: p.fused(layer, cfg), iters, flush)
        return seen[key]

    default = dict(p.config(1), **rows_gemv)
    base = timed(default)
    best = dict(default)

    def keep_best(cfgs: list[dict[str, int]]) -> None:
        nonlocal best
        for cfg in cfgs:
            if timed(cfg) < timed(best):
                best = dict(cfg)

    keep_best([dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=2, **rows_gemv) for bn in SWEEP_N
               for bk in SWEEP_K])
    keep_best([dict(best, num_warps=nw) for nw in SWEEP_WARPS])  # around the best tile
    keep_best([dict(best, num_stages=ns) for ns in SWEEP_STAGES])
    tried = sum(1 for v in seen.values() if v != float("inf"))
    print(f"{'':>8} sweep {p.name} ({p.rows}, {p.k}) M {m}: default {cfg_str(default)} {base:.2f} us, best "
          f"{cfg_str(best)} {timed(best):.2f} us ({base / timed(best):.2f}x), {tried} configs, "
          f"{time.time() - t0:.0f} s")
    return best, timed(best)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="M: rows (1: the GEMV; 2..16: the skinny GEMM)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--layers", type=int, default=0, help="distinct weights per graph (0: per shape, 8 or 30)")
    p.add_argument("--warm", action="store_true", help="no L2 flush between replays")
    p.add_argument("--sweep", action="store_true", help="also search launch configurations (each M of --rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", default=None, help="also write the printed tables and dicts to this file (text)")
    args = p.parse_args()
    tee_stdout_to(args.output_file)

    g = torch.Generator(device="cuda").manual_seed(args.seed)
    flush = l2_flush(args.warm)
    print(f"{torch.cuda.get_device_name()}: bfloat16, CUDA-graph replays, median of {args.iters} "
          f"(L2 {'warm' if flush is None else 'flushed'}); us per call, GB/s of weights, fraction of "
          f"{PEAK_BW / 1e12:.1f} TB/s")
    tuned: dict[tuple[int, int], dict[str, int]] = {}
    faster: set[tuple[int, int]] = set()  # weight shapes whose tuned fused kernel beat the unfused path
    tuned_rows: dict[tuple[int, int], dict[str, int]] = {}  # the row-unrolled GEMV's best at M > 1
    wins: dict[tuple[int, int], dict[int, bool]] = {}  # shape -> M -> the row-unrolled GEMV beat the unfused path
    t0 = time.time()
    for name in args.shapes:
        bench_shape(name, args, g, flush, tuned, faster, tuned_rows, wins)
    if wins:
        most = {}
        for shape, by_m in wins.items():
            up_to = 1
            for m in sorted(by_m):
                if not by_m[m] or m != up_to + 1:
                    break
                up_to = m
            most[shape] = up_to
        print("\n# kernels/tuned_h200.py FASTER_ROWS (the row-unrolled GEMV faster at every M up to):")
        print(f"FASTER_ROWS = {dict(sorted(most.items()))}")
    if tuned_rows:
        print("GEMV_TUNED_ROWS: dict[tuple[int, int], dict[str, int]] = {")
        for key, cfg in tuned_rows.items():
            print(f"    {key}: dict(BLOCK_N={cfg['BLOCK_N']}, BLOCK_K={cfg['BLOCK_K']}, num_warps={cfg['num_warps']}, "
                  f"num_stages={cfg['num_stages']}),")
        print("}")
    if args.sweep and tuned:
        print(f"\n# kernels/tuned_h200.py GEMV_TUNED from bench_gemv.py --sweep on {torch.cuda.get_device_name()} "
              f"({time.time() - t0:.0f} s):")
        print("GEMV_TUNED: dict[tuple[int, int], dict[str, int]] = {")
        for key, cfg in tuned.items():
            print(f"    {key}: dict(BLOCK_N={cfg['BLOCK_N']}, BLOCK_K={cfg['BLOCK_K']}, num_warps={cfg['num_warps']}, "
                  f"num_stages={cfg['num_stages']}),")
        print("}")
        print("# kernels/tuned_h200.py: the shapes the tuned fused kernels beat the unfused path on")
        print(f"FASTER: frozenset[tuple[int, int]] = frozenset({sorted(faster)})")


if __name__ == "__main__":
    main()
