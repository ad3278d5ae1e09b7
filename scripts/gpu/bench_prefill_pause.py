"""What a long prompt arriving does to running requests' decode (issue 46: prefill never freezes decoding),
side by side in one process over the same random bf16 weights.

    python3 scripts/gpu/bench_prefill_pause.py [--presets smollm2-135m,llama-3.1-8b] [--prompt 32768] [--bs 8] \\
        [--chunks 2048,8192] [--spec] [--output-file F]

Per preset and --chunked-prefill-size: bs running greedy requests (512-token prompts) decode; after 16 of their
steps a --prompt-token request arrives. Every step() is timed (device synchronised); a running request's token gap is
the time between two steps that gave it tokens. Two schedules of the same engine: `alternate` (the scheduler's own:
after a prefill step the running requests decode, Scheduler.decode_owed) and `prefill-first` (the schedule before
issue 46, reproduced by clearing decode_owed before every step: all chunks run before any decode). Reported: the
running requests' median and p99 inter-token time from the long request's arrival to their first token after its
first token, their longest pause, and the long request's time to first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from specserve.bench.phase_setup import random_models
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker
from specserve.server_args import ServerArgs


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, min(30000, vocab), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def window(sched: Scheduler, bs: int, prompt: int, vocab: int, alternate: bool, seed: int) -> dict:
    """Running requests' inter-token times while a long prompt is prefilled, and its time to first token."""
    greedy = SamplingParams(max_new_tokens=4096, temperature=0.0, ignore_eos=True)
    running = [Req(f"r{seed}-{alternate}-{i}", ids(512, seed + i, vocab), greedy, seed=i) for i in range(bs)]
    for r in running:
        sched.add_request(r)
    while sched.waiting or sched.prefilling:
        sched.step()
    for _ in range(16):
        sched.step()
    long = Req(f"long{seed}-{alternate}", ids(prompt, seed + 1000, vocab),
               SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True), seed=0)
    sync()
    t0 = last = time.perf_counter()
    sched.add_request(long)
    seen = [len(r.output_ids) for r in running]
    last_tok = [t0] * bs
    gaps: list[float] = []
    ttft = None
    # until the long request's first token and one token of every running request after it (the pause it caused
    # ends there)
    while ttft is None or min(last_tok) < t0 + ttft:
        if not alternate:
            sched.decode_owed = False
        sched.step()
        sync()
        last = time.perf_counter()
        for i, r in enumerate(running):
            if len(r.output_ids) > seen[i]:
                # a step of k tokens: k gaps of (elapsed / k), as a client sees a token rate
                k = len(r.output_ids) - seen[i]
                gaps += [(last - last_tok[i]) / k] * k
                seen[i], last_tok[i] = len(r.output_ids), last
        if ttft is None and long.output_ids:
            ttft = last - t0
    pause = max(gaps)
    for r in running + [long]:
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    gaps.sort()
    return {"tpot_median_ms": 1e3 * statistics.median(gaps),
            "tpot_p99_ms": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "max_pause_ms": 1e3 * pause, "ttft_ms": 1e3 * ttft, "tokens": len(gaps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="smollm2-135m,llama-3.1-8b")
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--chunks", default="2048,8192")
    p.add_argument("--spec", action="store_true", help="MTP N = 3 (a random MTP layer) instead of plain decoding")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output-file", default=None)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    ctx = a.prompt + 4096 + 64
    for preset in a.presets.split(","):
        target, draft, cfg = random_models(preset, torch.bfloat16, dev, ctx + 16)
        for chunk in [int(c) for c in a.chunks.split(",")]:
            spec = dict(speculative_algorithm="MTP", speculative_num_steps=3) if a.spec else {}
            args = ServerArgs(context_length=ctx, max_total_tokens=a.prompt + (a.bs + 1) * 4700,
                              max_running_requests=a.bs + 1, cuda_graph_max_bs=a.bs + 1, chunked_prefill_size=chunk,
                              disable_radix_cache=True, **spec)
            mr = ModelRunner(args, target, cfg, draft if a.spec else None, dev, torch.bfloat16, ctx)
            mr.capture_graphs()
            sched = Scheduler(mr, StopChecker(None, set()), chunk)
            window(sched, a.bs, a.prompt, cfg.vocab_size, True, 1)  # warm-up
            for alternate in (False, True):
                rows = [window(sched, a.bs, a.prompt, cfg.vocab_size, alternate, 10 * i + 3)
                        for i in range(a.repeats)]
                row = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                row.update(preset=preset, chunk=chunk, bs=a.bs, prompt=a.prompt, spec=a.spec,
                           schedule="alternate" if alternate else "prefill-first")
                print(f"{preset:<14} chunk {chunk:>5} {row['schedule']:<13}: running TPOT median "
                      f"{row['tpot_median_ms']:7.2f} ms, p99 {row['tpot_p99_ms']:8.2f} ms, longest pause "
                      f"{row['max_pause_ms']:8.1f} ms; {a.prompt}-token TTFT {row['ttft_ms']:8.1f} ms", flush=True)
                if a.output_file:
                    with open(a.output_file, "a") as f:
                        f.write(json.dumps(row) + "\n")
            del sched, mr
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del target, draft
    return 0


if __name__ == "__main__":
    sys.exit(main())
