"""Fuzz the overlap schedule (engine/overlap.py, overlapped prefills included) against the synchronous one on a CPU:
random workloads (tiny random Llama, plain or MTP N = 1..3; chunk sizes, pool sizes, contexts, running limits;
prompts arriving at random steps, random aborts, max_new_tokens from 1, stop ids, greedy and seeded sampling). Each
workload runs under both schedules; outputs and finish reasons must be equal (an aborted request's: equal over
their common prefix, since the schedules reach an abort at different lengths), and every page and row must be back.

    python3 scripts/fuzz_overlap.py [first-seed] [count] [llama|hybrid|dsa] [--output-file PATH]

hybrid: a tiny Qwen3-Next (GDN state rows) with its MTP layer; dsa: a tiny GLM-5 (MLA + sparse attention, top 5)
with an MTP layer; llama (default): a tiny Llama, with an MTP layer for the speculative runs. Prints a line every
10 trials and a MISMATCH block per differing request; the last line counts trials, mismatches and overlapped
prefills; the exit status is 1 on any mismatch.
"""
import argparse
import os
import random
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import build_tiny_model  # noqa: E402
from test_overlap_schedule import overlapped  # noqa: E402

from specserve import Engine  # noqa: E402
from specserve.bench.tee import tee_stdout_to  # noqa: E402
from specserve.engine.request import Req  # noqa: E402
from specserve.engine.sampling_params import SamplingParams  # noqa: E402


def workload(rng: random.Random, ctx: int):
    n = rng.randint(3, 9)
    specs = []
    for i in range(n):
        plen = rng.randint(2, min(60, ctx - 1))
        prompt = [rng.randint(3, 250) for _ in range(plen)]
        kw = dict(max_new_tokens=rng.choice([1, 1, 2, 5, 12, 30]), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.4:
            kw["temperature"] = 0.8
        else:
            kw["temperature"] = 0.0
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randint(3, 250) for _ in range(rng.randint(1, 30))]
        specs.append((prompt, kw, i))
    arrive = {i: rng.randint(0, 12) for i in range(n)}
    abort = {i: rng.randint(0, 20) for i in range(n) if rng.random() < 0.2}
    return specs, arrive, abort


def drive(eng, specs, arrive, abort):
    sched = eng.scheduler
    reqs = [Req(f"r{i}", p, SamplingParams(**kw), seed=seed) for i, (p, kw, seed) in enumerate(specs)]
    k = 0
    while k <= max(arrive.values()) or sched.has_work:
        for i, at in arrive.items():
            if at == k:
                sched.add_request(reqs[i])
        for i, at in abort.items():
            if at == k and reqs[i].rid in sched.reqs:
                sched.abort(reqs[i].rid)
        sched.step()
        k += 1
        assert k < 5000
    sched.check_idle_invariants()
    return reqs


def build_models(family: str) -> dict[str, str]:
    """{"plain": checkpoint, "spec": checkpoint with an MTP layer} of a tiny random model of the family."""
    root = tempfile.mkdtemp()
    if family == "hybrid":
        from hybrid_helpers import build_tiny_hybrid

        path = build_tiny_hybrid(f"{root}/qwen3_next", "qwen3_next", seed=31, mtp=True)
        return {"plain": path, "spec": path}
    if family == "dsa":
        from deepseek_helpers import build_tiny_dsa
        from test_deepseek_dsa import _with_mtp

        path = _with_mtp(build_tiny_dsa(f"{root}/glm", "glm_moe_dsa", seed=63, index_topk=5), 64)
        return {"plain": path, "spec": path}
    return {"plain": build_tiny_model(f"{root}/llama", "llama", seed=1),
            "spec": build_tiny_model(f"{root}/llama_mtp", "llama", seed=11, mtp_layout="deepseek")}


def main(seed0: int, count: int, family: str = "llama") -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only slow them down
    try:
        return _trials(seed0, count, build_models(family))
    finally:
        torch.set_num_threads(threads)


def _trials(seed0: int, count: int, models: dict[str, str]) -> int:
    bad = 0
    prefills = 0
    for t in range(seed0, seed0 + count):
        rng = random.Random(t)
        spec = rng.random() < 0.5
        ctx = rng.choice([48, 128])
        kw = dict(model_path=models["spec" if spec else "plain"], context_length=ctx,
                  chunked_prefill_size=rng.choice([8, 16, 32, 64]), max_running_requests=rng.choice([2, 4, 8]),
                  max_total_tokens=rng.choice([160, 4096]), schedule_conservativeness=rng.choice([0.0, 1.0]))
        if spec:
            kw.update(speculative_algorithm="MTP", speculative_num_steps=rng.randint(1, 3))
        specs, arrive, abort = workload(rng, ctx)
        out = {}
        for ov in (False, True):
            eng = Engine(**kw)
            if ov:
                overlapped(eng)
            out[ov] = drive(eng, specs, arrive, abort)
            if ov:
                prefills += eng.scheduler.stats.num_overlapped_prefills
        for i, (x, y) in enumerate(zip(out[False], out[True])):
            aborted = {(z.finished_reason or {}).get("type") for z in (x, y)} & {"abort"}
            if i in abort and aborted:
                m = min(len(x.output_ids), len(y.output_ids))
                ok = y.output_ids[:m] == x.output_ids[:m]
            else:
                ok = y.output_ids == x.output_ids and y.finished_reason == x.finished_reason
            if not ok:
                bad += 1
                print(f"MISMATCH trial {t} req {i} spec={spec} kw={kw}\n sync {x.output_ids} {x.finished_reason}\n"
                      f" over {y.output_ids} {y.finished_reason}", flush=True)
        if t % 10 == 0:
            print(f"trial {t} done, bad {bad}, overlapped prefills so far {prefills}", flush=True)
    print(f"DONE {count} trials, {bad} mismatches, {prefills} overlapped prefills")
    return 1 if bad else 0


def _cli() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("first_seed", nargs="?", type=int, default=0)
    p.add_argument("count", nargs="?", type=int, default=100)
    p.add_argument("family", nargs="?", default="llama", choices=("llama", "hybrid", "dsa"))
    p.add_argument("--output-file", default=None, help="also write what is printed to this file (text)")
    args = p.parse_args()
    tee_stdout_to(args.output_file)
    return main(args.first_seed, args.count, args.family)


if __name__ == "__main__":
    sys.exit(_cli())
