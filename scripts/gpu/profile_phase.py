"""Kernel breakdown of one graphed phase on a preset's random weights: the CUDA kernels of `--steps` replays grouped
by name, with their share of the GPU time. Finds what dominates a phase before optimising it.

    python3 scripts/gpu/profile_phase.py --preset qwen3-next-80b-a3b --phase decode --bs 1
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.phase_setup import PRESETS, fake_requests, make_runners, random_models, random_token_map
from specserve.bench.phases import phase_inputs
from specserve.bench.tee import tee_stdout_to


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), required=True)
    p.add_argument("--phases", default="decode,target_verify")
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--token-map-size", type=int, default=0, help="the draft's head restricted to this many ids")
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    args = p.parse_args()
    tee_stdout_to(args.output_file)
    dev = torch.device("cuda")
    target, draft, cfg = random_models(args.preset, torch.bfloat16, dev, 4096)
    if args.token_map_size:
        draft.restrict_vocab(random_token_map(cfg.vocab_size, args.token_map_size))
    pair = make_runners(target, draft, cfg, torch.bfloat16, dev, 3, args.bs, 2048, disable_graphs=False,
                        capture_bs=[args.bs])
    for phase in args.phases.split(","):
        mr = pair.plain if phase == "decode" else pair.spec
        runner = {r.name: r for r in (mr.phases.all() if mr.spec is None else mr.spec.phases.all())}[phase]
        reqs = fake_requests(mr, args.bs, args.prefix_len)
        live = phase_inputs(mr, reqs, phase)
        for _ in range(3):
            runner.run(live)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                runner.run(live)
            torch.cuda.synchronize()
        total, count = defaultdict(float), defaultdict(int)
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start:
                total[e.name] += (e.time_range.end - e.time_range.start) / args.steps
                count[e.name] += 1
        busy = sum(total.values())
        print(f"\n=== {phase} bs {args.bs}: GPU busy {busy / 1e3:.3f} ms/replay, "
              f"{sum(count.values()) // args.steps} kernels/replay ===")
        for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{us:9.1f} us {100 * us / busy:5.1f}%  x{count[name] // args.steps:<4} {name[:90]}")
        for r in reqs:
            mr.kv.release(r.kv)


if __name__ == "__main__":
    main()
