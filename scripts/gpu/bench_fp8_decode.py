"""FP8 weights against bf16 on the decode step (issue 48), side by side in one process: a preset's random bf16
model is timed, then quantised in place to FP8 and timed again with the same requests and KV.

    python3 scripts/gpu/bench_fp8_decode.py --preset llama-3.1-8b [--layers 0] [--scheme block|channel] \\
        [--batch-sizes 1,32] [--prefix-len 512] [--output-file F]

--scheme block: every linear layer and the routed experts in 128 x 128 blocks with the input per token per 128
columns, as the FP8 checkpoints of DeepSeek / GLM / Qwen hold them; channel: linear layers with a scale per output
row and the input per token (online `--quantization fp8`), experts in blocks. Embeddings, the lm-head, routers and
the other layers that no FP8 kernel reads stay bf16 (layers/quant.py). Times: the plain decode step and the MTP
iteration (3 drafts; the draft quantised too) replayed from their CUDA graphs, medians of --iters; bandwidth: the
target's weight bytes read per plain step (all dense weights, the chosen experts' only, by the preset's top-k at
batch 1) over the step's time.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specserve.bench.phase_setup import fake_requests, make_runners, random_models, release
from specserve.bench.phases import timeit
from specserve.engine.steps import run_decode, run_spec_step
from specserve.kvcache.cache_spec import bytes_per_token
from specserve.layers.linear import Linear
from specserve.layers.moe import FusedMoE
from specserve.layers.quant import OnlineFp8, quantize_fp8_online


def step_bytes(model: torch.nn.Module, top_k: int) -> int:
    """Weight bytes one decode token reads: every linear layer, the chosen experts' share of each expert stack,
    norms and routers (not the embedding table: one row)."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE):
            per = sum(t.numel() * t.element_size() for t in (m.w13, m.w2)) // m.num_experts
            total += per * min(top_k, m.num_experts)
            total += sum(b.numel() * b.element_size() for n, b in m.named_buffers())
        elif isinstance(m, Linear) or "lm_head" in name:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            total += sum(b.numel() * b.element_size() for b in m.buffers(recurse=False))
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=0, help="only the first L layers (0: all)")
    p.add_argument("--scheme", choices=("block", "channel"), default="block")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-spec", action="store_true", help="the plain decode step only")
    p.add_argument("--kv", action="store_true",
                   help="compare the KV cache instead: bf16 weights, a bf16 cache against --kv-cache-dtype fp8_e4m3 "
                        "(bytes per token and the decode step)")
    p.add_argument("--output-file", default=None)
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    bss = [int(b) for b in a.batch_sizes.split(",")]
    ctx = a.prefix_len + 64
    target, draft, cfg = random_models(a.preset, torch.bfloat16, dev, ctx + 16, layers=a.layers)
    top_k = getattr(cfg, "num_experts_per_tok", 0) or 1
    rows = []
    for mode in ("bf16", "fp8"):
        if mode == "fp8" and not a.kv:
            block = (128, 128) if a.scheme == "block" else None
            n = sum(quantize_fp8_online(m, OnlineFp8(), block) for m in (target, draft))
            print(f"quantised {n} layers to FP8 ({a.scheme})", flush=True)
        torch.cuda.empty_cache()
        kv = "fp8_e4m3" if a.kv and mode == "fp8" else "auto"
        pair = make_runners(target, draft, cfg, torch.bfloat16, dev, 3, max(bss), ctx, disable_graphs=False,
                            capture_bs=sorted(set(bss)), kv_cache_dtype=kv)
        if a.kv:
            per_tok = bytes_per_token(target.cache_specs(), pair.plain.kv_dtype, {})
            print(f"KV {kv}: {per_tok} bytes per token over the target's layers (the tokens a given memory holds "
                  "scale with its inverse)", flush=True)
        for bs in bss:
            reqs = fake_requests(pair.plain, bs, a.prefix_len, seed=bs)
            plain_ms = timeit(lambda r=reqs, mr=pair.plain: run_decode(mr, r), dev, a.iters)
            release(pair.plain, reqs)
            spec_ms = None
            if not a.no_spec:
                reqs = fake_requests(pair.spec, bs, a.prefix_len, seed=bs)
                spec_ms = timeit(lambda r=reqs, mr=pair.spec: run_spec_step(mr, r), dev, a.iters)
                release(pair.spec, reqs)
            nbytes = step_bytes(target, top_k * (1 if bs == 1 else bs))
            row = {"preset": a.preset, "layers": cfg.num_layers, "scheme": "kv" if a.kv else a.scheme,
                   "weights": mode, "bs": bs,
                   "plain_step_ms": plain_ms, "spec_iter_ms": spec_ms, "step_weight_gb": nbytes / 1e9,
                   "gbps": nbytes / 1e9 / (plain_ms * 1e-3)}
            rows.append(row)
            spec = f", MTP iteration {spec_ms:.3f} ms" if spec_ms is not None else ""
            print(f"{mode:4s} bs={bs:3d}: plain step {plain_ms:.3f} ms ({bs / plain_ms * 1e3:.0f} tok/s){spec}; "
                  f"{nbytes / 1e9:.2f} GB of weights -> {row['gbps']:.0f} GB/s", flush=True)
        del pair
    by = {(r["weights"], r["bs"]): r for r in rows}
    for bs in bss:
        b, f = by[("bf16", bs)], by[("fp8", bs)]
        line = f"bs={bs}: FP8 / bf16 tokens/s {b['plain_step_ms'] / f['plain_step_ms']:.2f}x (plain step)"
        if b["spec_iter_ms"]:
            line += f", {b['spec_iter_ms'] / f['spec_iter_ms']:.2f}x (MTP iteration)"
        print(line)
    if a.output_file:
        with open(a.output_file, "a") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
