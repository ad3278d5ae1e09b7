"""The overlap schedule against the synchronous one, side by side in one process (engine/overlap.py).

    python3 scripts/gpu/bench_overlap.py [--presets smollm2-135m,llama-3.1-8b,qwen3-30b-a3b] \\
        [--batch-sizes 1,8,32] [--prompt-len 512] [--tokens 128] [--steps 3] [--repeats 3]

Per preset (random bf16 weights of the real shapes, bench/phase_setup.py; a random MTP layer as the draft), one
plain engine and one speculating engine (N = --steps, adaptive speculation off so that every step speculates) are
built; each runs `bs` greedy requests of --prompt-len random tokens for --tokens new tokens through
Scheduler.step, timed as a loop from after the prefill to the last token (as a server's decode runs), under the
overlap schedule and under the synchronous one (the same engine and graphs, runs alternating; the median of
--repeats). Printed: decode ms per new token of a request, and the ratio. A random draft accepts almost nothing, so
speculative steps here measure the step's cost, not speculation's speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specserve.bench.phase_setup import make_runners, random_models
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def decode_ms_per_token(sched: Scheduler, dev: torch.device, bs: int, prompt_len: int, tokens: int, seed: int,
                        vocab: int) -> float:
    """Decode milliseconds per new token of each of bs requests run from their prompts to `tokens` new tokens each
    (the first token, from the prefill, not counted)."""
    g = torch.Generator().manual_seed(seed)
    reqs = [Req(f"o{seed}-{i}", torch.randint(10, min(1000, vocab), (prompt_len,), generator=g).tolist(),
                SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True), seed=i) for i in range(bs)]
    for r in reqs:
        sched.add_request(r)
    while sched.waiting or sched.prefilling:
        sched.step()
    sync(dev)
    t = time.perf_counter()
    while sched.has_work:
        sched.step()
    sync(dev)
    ms = (time.perf_counter() - t) * 1e3 / (tokens - 1)
    sched.check_idle_invariants()
    assert all(len(r.output_ids) == tokens for r in reqs)
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="smollm2-135m,llama-3.1-8b,qwen3-30b-a3b")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--output-file", default=None, help="append one JSON line per preset")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    ctx = a.prompt_len + a.tokens + 64
    for preset in a.presets.split(","):
        target, draft, cfg = random_models(preset, torch.bfloat16, dev, ctx + 16)
        pair = make_runners(target, draft, cfg, torch.bfloat16, dev, a.steps, max(sizes), ctx, False,
                            adaptive=False)
        row = {"preset": preset, "N": a.steps, "prompt_len": a.prompt_len, "tokens": a.tokens, "points": []}
        for kind, mr in (("plain", pair.plain), ("spec", pair.spec)):
            scheds = {on: Scheduler(mr, StopChecker(None, set()), mr.args.chunked_prefill_size, overlap=on)
                      for on in (True, False)}
            for bs in sizes:
                times = {True: [], False: []}
                for i in range(a.repeats + 1):  # the first round warms up
                    for on, sched in scheds.items():
                        ms = decode_ms_per_token(sched, dev, bs, a.prompt_len, a.tokens, i, cfg.vocab_size)
                        if i:
                            times[on].append(ms)
                over, syn = statistics.median(times[True]), statistics.median(times[False])
                row["points"].append({"kind": kind, "bs": bs, "overlap_ms": over, "sync_ms": syn})
                print(f"{preset:<14} {kind:<5} bs {bs:>3}: overlap {over:7.3f} ms/token, synchronous {syn:7.3f} "
                      f"({syn / over:.3f}x)", flush=True)
        if a.output_file:
            with open(a.output_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        del pair, target, draft
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
