"""Adaptive speculation's modes side by side through the scheduler (it should never be slower than plain).

    python3 scripts/gpu/bench_adaptive.py [--preset smollm2-135m] [--batch-sizes 1] [--prompt-len 512]
        [--tokens 512] [--steps 3] [--repeats 3]

Random bf16 weights of a preset's shapes (bench/phase_setup.py) and a random MTP draft, which accepts almost
nothing: what is compared is what each mode's steps cost, host work included, under the overlap schedule. One
plain engine, and one speculating engine whose policy is, in turn: always plain, a cycle of 28 plain and 4
speculative steps (adaptive speculation's shortest probe period taken plain), of 124 and 4 (its longest), always
speculative, and the real policy
(engine/adaptive_spec.py). Each runs `bs` requests of --prompt-len random tokens to --tokens new tokens, greedy and
sampled (T 0.7, top-p 0.95), timed from after the prefill (the median of --repeats). Printed per mode: decode ms per
new token, against the plain engine, and the step times the scheduler handed the policy, split into steady steps
(after a decode step of their own kind) and the others: what the policy's averages see. A mode's "x plain" below
1.0 is slower than the plain engine. Needs a CUDA GPU (--device cuda).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specserve.engine.scheduler import Scheduler

SAMPLINGS = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7, top_p=0.95)}


class Recorded:
    """A policy that forwards to `inner` (a pattern of plain (True) / speculative steps, or a policy object) and keeps
    what the scheduler reports: (plain, seconds, steady) per step."""

    def __init__(self, inner):
        self.inner, self.i, self.steps, self.catch_ups = inner, 0, [], []

    def choose_plain(self, bs: int) -> bool:
        if isinstance(self.inner, list):
            self.i += 1
            return self.inner[(self.i - 1) % len(self.inner)]
        return self.inner.choose_plain(bs)

    def record(self, bs: int, plain: bool, seconds: float, tokens_per_request: float,
               catch_up: tuple[float, int, int] | None = None, steady: bool = True) -> None:
        self.steps.append((plain, seconds, steady))
        if catch_up is not None:
            self.catch_ups.append(catch_up[0])
        if not isinstance(self.inner, list):
            self.inner.record(bs, plain, seconds, tokens_per_request, catch_up, steady)

    def split(self) -> dict[str, str]:
        """Mean ms and count of plain / speculative steps, steady and not."""
        out = {}
        for plain in (True, False):
            for steady in (True, False):
                xs = [s for p, s, st in self.steps if p == plain and st == steady]
                key = ("plain" if plain else "spec") + (" steady" if steady else " switch")
                out[key] = f"{1e3 * statistics.mean(xs):.3f} x{len(xs)}" if xs else "-"
        c = self.catch_ups
        out["catch-up"] = f"{1e3 * statistics.mean(c):.3f} x{len(c)}" if c else "-"
        return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_ms_per_token(sched: Scheduler, bs: int, prompt_len: int, tokens: int, seed: int, vocab: int,
                        sampling: dict) -> float:
    from specserve.engine.request import Req
    from specserve.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    reqs = [Req(f"a{seed}-{i}", torch.randint(10, min(1000, vocab), (prompt_len,), generator=g).tolist(),
                SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling), seed=i) for i in range(bs)]
    for r in reqs:
        sched.add_request(r)
    while sched.waiting or sched.prefilling:
        sched.step()
    sync()
    t = time.perf_counter()
    while sched.has_work:
        sched.step()
    sync()
    ms = (time.perf_counter() - t) * 1e3 / (tokens - 1)
    sched.check_idle_invariants()
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-file", default=None, help="append one JSON line per point")
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    from specserve.bench.phase_setup import make_runners, random_models  # (after --help: the engine's imports)
    from specserve.engine.adaptive_spec import AdaptiveSpeculation
    from specserve.engine.scheduler import Scheduler
    from specserve.engine.stop import StopChecker

    dev = torch.device(a.device)
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    ctx = a.prompt_len + a.tokens + 64
    target, draft, cfg = random_models(a.preset, torch.bfloat16, dev, ctx + 16)
    pair = make_runners(target, draft, cfg, torch.bfloat16, dev, a.steps, max(sizes), ctx, False, adaptive=True,
                        spec_prefill_graph_tokens=256)
    policies = {"plain": lambda: [True], "28 plain + 4 spec": lambda: [True] * 28 + [False] * 4,
                "124 plain + 4 spec": lambda: [True] * 124 + [False] * 4,
                "spec": lambda: [False], "adaptive": AdaptiveSpeculation}
    for name, sampling in SAMPLINGS.items():
        for bs in sizes:
            plain = Scheduler(pair.plain, StopChecker(None, set()), ctx, overlap=True)
            base = statistics.median([decode_ms_per_token(plain, bs, a.prompt_len, a.tokens, i, cfg.vocab_size,
                                                          sampling) for i in range(a.repeats + 1)][1:])
            print(f"{a.preset} {name} bs {bs}: plain engine {base:.3f} ms/token", flush=True)
            for label, make in policies.items():
                sched = Scheduler(pair.spec, StopChecker(None, set()), ctx, overlap=True)
                times, split = [], {}
                for i in range(a.repeats + 1):  # the first round warms up
                    sched.adaptive = rec = Recorded(make())
                    ms = decode_ms_per_token(sched, bs, a.prompt_len, a.tokens, i, cfg.vocab_size, sampling)
                    if i:
                        times.append(ms)
                        split = rec.split()
                ms = statistics.median(times)
                print(f"  {label:<18} {ms:7.3f} ms/token ({base / ms:.3f}x plain)  step ms: "
                      + ", ".join(f"{k} {v}" for k, v in split.items()), flush=True)
                if a.output_file:
                    with open(a.output_file, "a") as f:
                        f.write(json.dumps({"preset": a.preset, "sampling": name, "bs": bs, "policy": label,
                                            "ms_per_token": ms, "plain_engine_ms": base, "steps": split}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
