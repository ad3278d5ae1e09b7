"""Sampling from logits on the GPU: the torch reference (softmax, a sort per row for the filter, the hash noise
over the vocabulary, the race: layers/sampler.py probs_reference + sample_from_probs) against the sort-free Triton
kernels (kernels/triton_sample.py), both captured in CUDA graphs, side by side.

    python3 scripts/gpu/bench_sample.py [--vocab 49152 128256 151936] [--rows 1 5 40 320] [--iters 50]
                                        [--chunks 1024 2048 4096 8192]

Rows per call: 1 (a plain decode step at batch 1), 5 (a verify at N = 4), 40, 320 (verify at batch 8, 64).
Sampling: temperature 0.8 with top-k 200 (gpt-fast's), temperature 0.7 with top-p 0.95, temperature 1 alone.
"sample" draws tokens [R]; "probs" writes the filtered distribution [R, V] (what verify's acceptance reads). Logits
are random normal x 4, rounded to bfloat16 (the lm head's output). Before timing, the kernel's tokens are checked
against the reference's (equal but for near-ties of the race). --chunks: the kernels' sample and probs times at
each of these tokens-per-program (kernels/triton_sample.py pick_chunk chooses one by default; at few rows a smaller
chunk gives each pass more, shorter programs), printed after the comparison's columns.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from bench_moe import time_ms  # this folder: the scripts run as files

from specserve.bench.tee import tee_stdout_to
from specserve.graphs.capture import capture_graph
from specserve.kernels.triton_sample import probs_triton, sample_triton
from specserve.layers.sampler import SamplingBatch, probs_reference, sample_from_probs

SETTINGS = [("T0.8 top-k 200", 0.8, 200, 1.0), ("T0.7 top-p 0.95", 0.7, None, 0.95), ("T1", 1.0, None, 1.0)]


def batch(rows: int, vocab: int, temp: float, top_k: int | None, top_p: float) -> SamplingBatch:
    dev = torch.device("cuda")
    f = lambda v: torch.full((rows,), v, dtype=torch.float32, device=dev)  # noqa: E731
    return SamplingBatch(f(temp), f(top_p), torch.full((rows,), top_k or vocab, dtype=torch.int64, device=dev),
                         f(0.0), torch.arange(rows, dtype=torch.int64, device=dev) + 11,
                         torch.zeros(rows, dtype=torch.bool, device=dev), all_greedy=False,
                         need_filter=top_k is not None or top_p < 1.0)


def _sample_ref(x: torch.Tensor, sb: SamplingBatch, pos: torch.Tensor) -> torch.Tensor:
    return sample_from_probs(probs_reference(x, sb), sb.seeds, pos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256, 151936])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 5, 40, 320])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--chunks", type=int, nargs="*", default=[], help="also time the kernels at these chunk sizes")
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    a = p.parse_args()
    tee_stdout_to(a.output_file)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}: graph replay us (median of {a.iters}); torch reference vs Triton")
    print(f"{'vocab':>7} {'rows':>5} {'sampling':<16} {'sample ref':>10} {'triton':>8} {'x':>6} "
          f"{'probs ref':>10} {'triton':>8} {'x':>6} {'equal':>6}")
    for vocab in a.vocab:
        for rows in a.rows:
            x = (torch.randn((rows, vocab), device=dev) * 4).to(torch.bfloat16).float()
            pos = torch.arange(rows, dtype=torch.int64, device=dev) + 100
            for name, temp, top_k, top_p in SETTINGS:
                sb = batch(rows, vocab, temp, top_k, top_p)
                args = (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy)
                want = sample_from_probs(probs_reference(x, sb), sb.seeds, pos)
                got = sample_triton(x, *args, sb.seeds, pos, sb.need_filter)
                equal = (got == want).float().mean().item()
                fns = {
                    "sample_ref": partial(_sample_ref, x, sb, pos),
                    "sample": partial(sample_triton, x, *args, sb.seeds, pos, sb.need_filter),
                    "probs_ref": partial(probs_reference, x, sb),
                    "probs": partial(probs_triton, x, *args, sb.need_filter),
                }
                for c in a.chunks:
                    kw = dict(chunk=c, block=min(1024, c))
                    fns[f"sample@{c}"] = partial(sample_triton, x, *args, sb.seeds, pos, sb.need_filter, **kw)
                    fns[f"probs@{c}"] = partial(probs_triton, x, *args, sb.need_filter, **kw)
                us = {}
                for key, fn in fns.items():
                    graph, _, _ = capture_graph(fn, None)
                    us[key] = time_ms(graph.replay, a.iters, 5, None) * 1e3
                    del graph
                print(f"{vocab:>7} {rows:>5} {name:<16} {us['sample_ref']:>10.1f} {us['sample']:>8.1f} "
                      f"{us['sample_ref'] / us['sample']:>5.1f}x {us['probs_ref']:>10.1f} {us['probs']:>8.1f} "
                      f"{us['probs_ref'] / us['probs']:>5.1f}x {equal:>6.3f}"
                      + "".join(f" | chunk {c}: {us[f'sample@{c}']:.1f} / {us[f'probs@{c}']:.1f}" for c in a.chunks),
                      flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
