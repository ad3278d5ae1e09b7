"""Per-kernel GPU time of one graphed plain decode step at batch 1 (random weights of a preset's shapes).

    python3 scripts/gpu/profile_decode.py llama-3.1-8b
    python3 scripts/gpu/profile_decode.py llama-3.1-8b --steps greedy sampled

Default: the decode runner's graph alone (the model: embedding to logits). `--steps`: the whole plain step as the
engine runs it (engine/steps.py launch_decode: the one-graph step of decode, sampling and the last-token update),
greedy and/or sampled at gpt-fast's setting (temperature 0.8, top-k 200), side by side: each one's wall time a step
(CUDA events over back-to-back steps) and its kernels, so the cost of sampling shows against the greedy step.
"""

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.phase_setup import fake_requests, make_runners, random_models
from specserve.bench.phases import phase_inputs
from specserve.bench.tee import tee_stdout_to
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.steps import launch_decode

SAMPLING = {"greedy": SamplingParams(max_new_tokens=1 << 30, temperature=0.0, ignore_eos=True),
            "sampled": SamplingParams(max_new_tokens=1 << 30, temperature=0.8, top_k=200, ignore_eos=True)}


def kernel_table(fn, steps: int, top: int) -> list[str]:
    """fn run `steps` times under the profiler: its CUDA kernels by total time, per step."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:70]
            t, n = rows.get(name, (0.0, 0))
            rows[name] = (t + e.time_range.end - e.time_range.start, n + 1)
    total = sum(t for t, _ in rows.values())
    lines = [f"kernel time {total / steps / 1e3:.3f} ms/step over {steps} steps",
             f"{'kernel':<72} {'us/step':>9} {'calls/step':>10} {'us/call':>8}"]
    for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{name:<72} {t / steps:9.1f} {n / steps:10.1f} {t / n:8.2f}")
    return lines


def wall_ms(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", nargs="?", default="llama-3.1-8b")
    p.add_argument("--steps", nargs="*", choices=list(SAMPLING), default=None,
                   help="profile the whole plain step (decode + sampling) instead of the decode graph alone")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--output-file", default=None, help="also write what is printed (the results) to this file (text)")
    a = p.parse_args()
    tee_stdout_to(a.output_file)
    dev = torch.device("cuda")
    target, draft, cfg = random_models(a.preset, torch.bfloat16, dev, 2100)
    pair = make_runners(target, draft, cfg, torch.bfloat16, dev, 3, 1, 2048, disable_graphs=False)
    mr = pair.plain
    if not a.steps:
        runner = mr.phases.decode
        live = phase_inputs(mr, fake_requests(mr, 1, 512), "decode")
        for _ in range(10):
            runner.run(live)
        torch.cuda.synchronize()
        table = kernel_table(lambda: runner.run(live), a.iters, a.top)
        print(f"{a.preset} bs1 decode: {table[0]}")
        print("\n".join(table[1:]))
        return
    calls = {}
    base = fake_requests(mr, 1, 512)  # the runner has one request row
    for kind in a.steps:
        # a copy of the request per kind (same KV row): the engine caches a sampling batch per request list
        reqs = [dataclasses.replace(r, sampling=SAMPLING[kind]) for r in base]
        calls[kind] = (lambda reqs=reqs: launch_decode(mr, reqs))
        for _ in range(10):  # captures the step's graph for this sampling, then warms it
            calls[kind]()
        torch.cuda.synchronize()
    walls = {kind: [] for kind in calls}
    for _ in range(3):  # alternating rounds: a drift of the machine meets every kind
        for kind, fn in calls.items():
            walls[kind].append(wall_ms(fn, a.iters))
    for kind, fn in calls.items():
        table = kernel_table(fn, a.iters, a.top)
        runs = ", ".join(f"{w:.3f}" for w in walls[kind])
        print(f"\n{a.preset} bs1 plain step, {kind}: wall {runs} ms/step; {table[0]}")
        print("\n".join(table[1:]))


if __name__ == "__main__":
    main()
