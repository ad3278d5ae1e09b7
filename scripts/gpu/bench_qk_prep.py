"""An attention layer's q/k preparation and K/V store: the unfused launches (per-head q RMSNorm, k RMSNorm, rotary,
store_kv; Triton kernels) against the one fused kernel (specserve/kernels/triton_qk_prep.py), as CUDA-graph replays.

    python3 scripts/gpu/bench_qk_prep.py [--tokens 1 8 32 128 1024] [--layers 32] [--iters 100]

Shapes: Llama-3-8B (Hq 32, Hkv 8, D 128, no q/k norm), Qwen3-30B-A3B (Hq 32, Hkv 4, D 128, q/k norms) and
Qwen3-Next (Hq 16, Hkv 2, D 256, zero-centred norms, rotary on 64 dims), bfloat16. Each graph holds --layers
layers, each with its own qkv buffer and K/V cache; the per-layer time is a replay's CUDA-event time over
--layers, the median of --iters replays. Before timing, the fused kernel is checked against the unfused one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from bench_moe import time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph
from specserve.kernels import triton_ops as tk


@dataclass
class Shape:
    name: str
    hq: int
    hkv: int
    d: int
    rot_dim: int
    norms: bool
    offset: float


SHAPES = [Shape("llama-3-8b", 32, 8, 128, 128, False, 0.0), Shape("qwen3-30b-a3b", 32, 4, 128, 128, True, 0.0),
          Shape("qwen3-next", 16, 2, 256, 64, True, 1.0)]
SLOTS = 8192


@dataclass
class Layer:
    qkv: torch.Tensor  # [T, (Hq + 2 Hkv) D]
    k_cache: torch.Tensor  # [S, Hkv, D]
    v_cache: torch.Tensor
    qw: torch.Tensor | None
    kw: torch.Tensor | None


def views(s: Shape, qkv: torch.Tensor):
    t = qkv.shape[0]
    q, k, v = qkv.split([s.hq * s.d, s.hkv * s.d, s.hkv * s.d], dim=-1)
    return q.view(t, s.hq, s.d), k.view(t, s.hkv, s.d), v.view(t, s.hkv, s.d)


def unfused(s: Shape, layer: Layer, cs, pos, loc):
    q, k, v = views(s, layer.qkv)
    if s.norms:
        q = tk.rms_norm(q, layer.qw, 1e-6, weight_offset=s.offset)
        k = tk.rms_norm(k, layer.kw, 1e-6, weight_offset=s.offset)
    if s.rot_dim == s.d:
        q, k = tk.rope(q, k, cs, pos, None)
    else:
        tk.rope(q[..., :s.rot_dim], k[..., :s.rot_dim], cs, pos, None)
    tk.store_kv(layer.k_cache, layer.v_cache, loc, k, v)
    return q


def fused(s: Shape, layer: Layer, cs, pos, loc):
    q, k, v = views(s, layer.qkv)
    return tk.qk_norm_rope_store_triton(q, k, v, layer.k_cache, layer.v_cache, loc, cs, pos, None, layer.qw,
                                        layer.kw, 1e-6, s.offset)[0]


def graph_us(fn, s: Shape, layers: list[Layer], cs, pos, loc, iters: int) -> float:
    graph, _, _ = capture_graph(lambda: [fn(s, la, cs, pos, loc) for la in layers], None)
    return time_ms(graph.replay, iters, 10, None) * 1e3 / len(layers)


def check(s: Shape, layer: Layer, cs, pos, loc) -> float:
    """Max |fused - unfused| over q, k and both caches at loc (bfloat16: rounding of the norm sums' order)."""
    outs = []
    for fn in (unfused, fused):
        la = Layer(layer.qkv.clone(), layer.k_cache.clone(), layer.v_cache.clone(), layer.qw, layer.kw)
        q = fn(s, la, cs, pos, loc)
        outs.append((q.float(), la.k_cache[loc].float(), la.v_cache[loc].float()))
    return max((a - b).abs().max().item() for a, b in zip(outs[0], outs[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    args = p.parse_args()
    tee_stdout_to(args.output_file)
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: bfloat16, CUDA-graph replays of {args.layers} layers, median of "
          f"{args.iters}; per layer in us")
    for s in SHAPES:
        print(f"\n{s.name}: Hq {s.hq}, Hkv {s.hkv}, D {s.d}, rotary {s.rot_dim}, "
              f"{'norms offset ' + str(s.offset) if s.norms else 'no norms'}")
        print(f"{'T':>5} {'unfused':>8} {'fused':>8} {'ratio':>6} {'max diff':>9}")
        inv = 1.0 / (10000 ** (torch.arange(0, s.rot_dim, 2, dtype=torch.float32, device=dev) / s.rot_dim))
        freqs = torch.outer(torch.arange(4096, dtype=torch.float32, device=dev), inv)
        cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, rot_dim]
        for t in args.tokens:
            pos = torch.randint(0, 4096, (t,), generator=g, device=dev)
            loc = torch.randperm(SLOTS, generator=g, device=dev)[:t]
            layers = []
            for _ in range(args.layers):
                w = [(torch.randn(s.d, generator=g, device=dev) * 0.1 + 1 - s.offset).to(dt) for _ in range(2)]
                layers.append(Layer(torch.randn(t, (s.hq + 2 * s.hkv) * s.d, generator=g, device=dev).to(dt),
                                    torch.zeros(SLOTS, s.hkv, s.d, dtype=dt, device=dev),
                                    torch.zeros(SLOTS, s.hkv, s.d, dtype=dt, device=dev),
                                    *(w if s.norms else (None, None))))
            diff = check(s, layers[0], cs, pos, loc)
            base = graph_us(unfused, s, layers, cs, pos, loc, args.iters)
            one = graph_us(fused, s, layers, cs, pos, loc, args.iters)
            print(f"{t:5d} {base:8.2f} {one:8.2f} {base / one:5.2f}x {diff:9.2e}")


if __name__ == "__main__":
    main()
