"""Eager MLA prefill attention, absorbed against decompressed (--mla-prefill absorbed / mha), one layer, bf16: the
time from the rotated query (q_nope, q_rope) and the latent rows [c ; k_rope] to o_proj's input [T, H, v], through
the engine's own code (attention/torch_mla_backend.py TorchMLABackend.forward between the W_UK / W_UV einsums of
layers/mla.py, against TorchMLABackend.forward_mha), for one request's chunk of 512, 2048 and 8192 tokens over a
cached prefix of 0, 4096 and 32768 tokens. C = 512 latent + R = 64 rope dims per token. Shapes:

    h64   64 heads, nope 128, v 128 (GLM-5's head count at DeepSeek-V3's head dims)
    dsv3  128 heads, nope 128, v 128 (DeepSeek-V3)
    glm5  64 heads, nope 192, v 256 (GLM-5's own dims; a DSA model, whose layers the engine keeps absorbed)

Median of a few runs timed with CUDA events (after a warm-up run); ratio = absorbed / mha (above 1: mha faster).
err: the largest |mha - absorbed| over the largest |absorbed| of the output, a bf16 sanity check. The GFLOP
columns count the multiply-adds x 2 of each form over the causal pairs (absorbed: (C + R) + C per key and head plus
the W_UK / W_UV einsums; mha: (nope + R) + v plus the [S, C] x [C, H (nope + v)] decompression).

    python3 scripts/gpu/bench_mla_prefill.py [h64] [dsv3] [glm5] [--output-file PATH]     (default: h64 dsv3)
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import torch

from specserve.attention.mla_prefill import MHAPrefillMeta
from specserve.attention.torch_backend import _ExtendMeta
from specserve.attention.torch_mla_backend import TorchMLABackend
from specserve.bench.tee import tee_stdout_to

C, R = 512, 64
SHAPES = {"h64": (64, 128, 128), "dsv3": (128, 128, 128), "glm5": (64, 192, 256)}  # heads, nope, v
CHUNKS, PREFIXES = (512, 2048, 8192), (0, 4096, 32768)
BF = torch.bfloat16


def timed(fn, reps: int = 5) -> tuple[float, torch.Tensor]:
    """(median ms of `reps` runs, the warm-up run's output), each run between its own CUDA events."""
    out = fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out


def row(heads: int, nope: int, v: int, chunk: int, prefix: int, dev: torch.device) -> None:
    s = prefix + chunk
    g = torch.Generator(device=dev).manual_seed(chunk + prefix)
    rows = torch.randn((s + 1, C + R), device=dev, dtype=BF, generator=g)  # slot 0: the dummy
    latent = rows[prefix + 1:].clone()  # [chunk, C + R] this chunk's new rows (stored again by each call)
    q_nope = torch.randn((chunk, heads, nope), device=dev, dtype=BF, generator=g)
    q_rope = torch.randn((chunk, heads, R), device=dev, dtype=BF, generator=g)
    w = torch.randn((heads, nope + v, C), device=dev, dtype=BF, generator=g) * C ** -0.5  # kv_b_proj by head
    slots = torch.arange(1, s + 1, device=dev)
    mask = torch.arange(s, device=dev)[None, :] <= torch.arange(prefix, s, device=dev)[:, None]  # [chunk, s]
    pieces = [(0, chunk, slots, mask)]
    backend = TorchMLABackend(None, SimpleNamespace(rows=[rows]))
    layer = SimpleNamespace(cache_index=0, kv_lora_rank=C, num_heads=heads, scaling=(nope + R) ** -0.5)
    fb = SimpleNamespace(out_cache_loc=slots[prefix:])

    def absorbed() -> torch.Tensor:  # layers/mla.py's absorbed path from q to o_proj's input
        backend.meta = _ExtendMeta(pieces)
        q_abs = torch.einsum("thn,hnc->thc", q_nope, w[:, :nope])
        out = backend.forward(torch.cat((q_abs, q_rope), dim=-1), latent, layer, fb)
        return torch.einsum("thc,hvc->thv", out, w[:, nope:])

    def mha() -> torch.Tensor:
        backend.meta = MHAPrefillMeta(pieces)
        return backend.forward_mha(q_nope, q_rope, latent, w, layer, fb)

    t = {}
    outs = {}
    for name, fn in (("absorbed", absorbed), ("mha", mha)):
        try:
            t[name], outs[name] = timed(fn)
        except torch.OutOfMemoryError:
            t[name] = float("nan")
        torch.cuda.empty_cache()
    err = float("nan")
    if len(outs) == 2:
        err = float((outs["mha"].float() - outs["absorbed"].float()).abs().max() / outs["absorbed"].float().abs().max())
    pairs = chunk * prefix + chunk * (chunk + 1) // 2  # causal (query, key) pairs
    flop_abs = 2 * (pairs * heads * (2 * C + R) + chunk * heads * C * (nope + v)) / 1e9
    flop_mha = 2 * (pairs * heads * (nope + R + v) + s * C * heads * (nope + v)) / 1e9
    print(f"{heads:>5} {chunk:>6} {prefix:>7} | {t['absorbed']:10.3f} {t['mha']:10.3f} | "
          f"{t['absorbed'] / t['mha']:6.2f} | {flop_abs:9.1f} {flop_mha:9.1f} | {err:8.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", help=f"of {' '.join(SHAPES)} (default: h64 dsv3)")
    p.add_argument("--output-file", default=None, help="also write the printed tables to this file (text)")
    args = p.parse_args()
    names = args.shapes or ["h64", "dsv3"]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    if not torch.cuda.is_available():
        print("bench_mla_prefill: needs a CUDA GPU; nothing to time here")
        return
    tee_stdout_to(args.output_file)
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; ms per layer, bf16")
    for name in names:
        heads, nope, v = SHAPES[name]
        print(f"\n--- {name}: {heads} heads, C {C} + R {R}, nope {nope}, v {v} ---")
        print(f"{'heads':>5} {'chunk':>6} {'prefix':>7} | {'absorbed':>10} {'mha':>10} | {'ratio':>6} | "
              f"{'GF abs':>9} {'GF mha':>9} | {'err':>8}")
        for prefix in PREFIXES:
            for chunk in CHUNKS:
                row(heads, nope, v, chunk, prefix, dev)


if __name__ == "__main__":
    main()
