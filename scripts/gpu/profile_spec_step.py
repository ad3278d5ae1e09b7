"""Per-kernel GPU time of one speculative step run as one CUDA graph at batch 1, against a plain engine's decode
step (its one graph: decode, sampling, last-token update) and a speculating engine's plain step (adaptive
speculation's: the target alone, the draft's inputs kept): random SmolLM2-135M weights (only shapes matter for
timing) with the shipped draft head and context lookup. Greedy, and with --sampled at temperature 0.7, top-p 0.95
(argmax drafts, and drafts drawn from the head).

    python3 scripts/gpu/profile_spec_step.py [--sampled] [N ...] [--output-file PATH]

Printed per step kind: wall ms per step (graph replay + reading the tokens back), kernels per step and kernel time
per step, then the top kernels by device time per step (us/step, calls/step, us/call). Needs a CUDA GPU.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.phase_setup import fake_requests, random_models
from specserve.bench.tee import tee_stdout_to
from specserve.engine.model_runner import ModelRunner
from specserve.layers.sampler import GREEDY, SamplingBatch
from specserve.models.loader import LoadedTarget, ModelSource, load_mtp_draft
from specserve.server_args import ServerArgs

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("steps", nargs="*", type=int, help="draft steps N to profile (default: 3 4)")
parser.add_argument("--sampled", action="store_true", help="also sampled (temperature 0.7, top-p 0.95)")
parser.add_argument("--output-file", default=None, help="also write what is printed to this file (text)")
args = parser.parse_args()
tee_stdout_to(args.output_file)

HEAD = "specserve/assets/smollm2-135m-mtp"
dev, dtype, ctx_len = torch.device("cuda"), torch.bfloat16, 2048
target, _, cfg = random_models("smollm2-135m", dtype, dev, ctx_len + 64)
draft = load_mtp_draft(LoadedTarget(target, cfg, ModelSource("."), {}), HEAD, dtype, dev, ctx_len + 64)
common = dict(max_total_tokens=8192, max_running_requests=1, cuda_graph_bs=[1], context_length=ctx_len)


def kernel_table(fn, steps: int, label: str) -> None:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / 200
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:80]
            t0, n = rows.get(name, (0.0, 0))
            rows[name] = (t0 + e.time_range.end - e.time_range.start, n + 1)
    busy = sum(t0 for t0, _ in rows.values()) / steps / 1e3
    count = sum(n for _, n in rows.values()) / steps
    print(f"\n{label}: wall {1e3 * wall:.3f} ms/step (replay + read), kernels {count:.0f}/step, "
          f"kernel time {busy:.3f} ms/step")
    print(f"{'kernel':<82} {'us/step':>8} {'calls':>6} {'us/call':>8}")
    for name, (t0, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:22]:
        print(f"{name:<82} {t0 / steps:8.1f} {n / steps:6.1f} {t0 / n:8.2f}")


def sampled_batch() -> SamplingBatch:
    f = lambda v: torch.tensor([v], dtype=torch.float32, device=dev)  # noqa: E731
    return SamplingBatch(f(0.7), f(0.95), torch.tensor([cfg.vocab_size], device=dev), f(0.0),
                         torch.tensor([11], device=dev), torch.tensor([False], device=dev), all_greedy=False,
                         need_filter=True)


def profile_plain(sb: SamplingBatch) -> None:
    mr = ModelRunner(ServerArgs(**common), target, cfg, None, dev, dtype, ctx_len)
    mr.capture_graphs()
    row = fake_requests(mr, 1, 512)[0].kv.row
    assert mr.decode_step_graph.covers(1, sb)
    kernel_table(lambda: mr.decode_step_graph.run([row], [512], [512], sb).tolist(), 20,
                 f"plain engine's decode step (one graph, {'greedy' if sb.all_greedy else 'sampled'})")


def profile_spec(n: int, sb: SamplingBatch, draft_sampling: str) -> None:
    mr = ModelRunner(ServerArgs(speculative_algorithm="MTP", speculative_num_steps=n, speculative_ngram_lookup=True,
                                speculative_draft_sampling=draft_sampling, **common),
                     target, cfg, draft, dev, dtype, ctx_len)
    mr.capture_graphs()
    row = fake_requests(mr, 1, 512)[0].kv.row
    label = "greedy" if sb.all_greedy else f"sampled, {draft_sampling} drafts"
    kernel_table(lambda: mr.spec.spec_step_graph.run([row], [512], [512], sb).tolist(), 20,
                 f"spec step N={n} (one graph, {label})")
    if draft_sampling == "argmax":  # the speculating engine's plain step (the draft lags; no catch-up here)
        one = mr.spec.plain_step_graph
        assert one is not None and one.covers(1, sb)
        kernel_table(lambda: one.run([row], [512], [512], sb).tolist(), 20,
                     f"speculating engine's plain step N={n} ({'greedy' if sb.all_greedy else 'sampled'})")


sampled = args.sampled
steps = args.steps or [3, 4]
batches = [GREEDY] + ([sampled_batch()] if sampled else [])
for batch in batches:
    profile_plain(batch)
for n in steps:
    profile_spec(n, GREEDY, "argmax")
    if sampled:
        profile_spec(n, batches[1], "argmax")
        profile_spec(n, batches[1], "sample")
