"""Per-kernel GPU time of one graphed plain decode step at batch 1 (random weights of a preset's shapes).

    python3 scripts/gpu/profile_decode.py llama-3.1-8b
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.phase_setup import fake_requests, make_runners, random_models
from specserve.bench.phases import phase_inputs

preset = sys.argv[1] if len(sys.argv) > 1 else "llama-3.1-8b"
dev = torch.device("cuda")
target, draft, cfg = random_models(preset, torch.bfloat16, dev, 2100)
pair = make_runners(target, draft, cfg, torch.bfloat16, dev, 3, 1, 2048, disable_graphs=False)
mr = pair.plain
reqs = fake_requests(mr, 1, 512)
runner = mr.runners["decode"]
live = phase_inputs(mr, reqs, "decode")
for _ in range(10):
    runner.run(live)
torch.cuda.synchronize()
steps = 20
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        runner.run(live)
    torch.cuda.synchronize()
rows = {}
for e in prof.events():
    if e.device_type.name == "CUDA":
        name = e.name[:70]
        t, n = rows.get(name, (0.0, 0))
        rows[name] = (t + e.time_range.end - e.time_range.start, n + 1)
total = sum(t for t, _ in rows.values())
print(f"{preset} bs1 decode: kernel time {total / steps / 1e3:.3f} ms/step over {steps} steps")
print(f"{'kernel':<72} {'us/step':>9} {'calls/step':>10} {'us/call':>8}")
for name, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{name:<72} {t / steps:9.1f} {n / steps:10.1f} {t / n:8.2f}")
