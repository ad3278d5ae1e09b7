"""The prefix cache's effect, side by side in one process (kvcache/radix_cache.py): time to first token of a
conversation's next turn, cache on vs off; decode speed with the cache on vs off; a recurrent-state snapshot's cost.

    python3 scripts/gpu/bench_prefix_cache.py [--presets smollm2-135m,qwen3-next-80b-a3b] [--prefixes 4096,32768] \\
        [--answer 32] [--question 64] [--repeats 3] [--steps 3] [--layers L] [--output-file F]

Per preset (random bf16 weights of the real shapes, bench/phase_setup.py, a random MTP layer as the draft), two
speculating engines over the same weights, --disable-radix-cache off and on, the server's defaults otherwise
(chunked prefill, prefill and step graphs). A turn: a prompt of `prefix` random tokens answered with --answer greedy
tokens; the next turn's prompt is that whole conversation plus --question new tokens; its time to first token is
timed from add_request to its first token read (device synchronised), both engines alternating, the median of
--repeats (after one warm-up pair). Decode: ms per new token of bs requests (512-token prompts, 128 tokens),
cache on vs off alternating. Snapshot (models with recurrent state): one StateSnapshots.take, timed over 50,
against one prefill chunk of --chunked-prefill-size tokens.
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


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def random_ids(n: int, g: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(10, min(30000, vocab), (n,), generator=g).tolist()


def run(sched: Scheduler, reqs: list[Req]) -> None:
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        sched.step()


def next_turn_ttft(sched: Scheduler, prefix: int, answer: int, question: int, seed: int,
                   vocab: int) -> tuple[float, int]:
    """One turn of `prefix` tokens answered, then the next turn's time to first token (ms) and its cached tokens."""
    g = torch.Generator().manual_seed(seed)
    first = Req(f"t1-{seed}", random_ids(prefix, g, vocab), greedy(answer), seed=seed)
    run(sched, [first])
    nxt = Req(f"t2-{seed}", first.fill_ids + random_ids(question, g, vocab), greedy(4), seed=seed)
    sync()
    t = time.perf_counter()
    sched.add_request(nxt)
    while not nxt.output_ids:
        sched.step()
    sync()
    ms = (time.perf_counter() - t) * 1e3
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    sched.flush_cache()  # each repeat starts cold
    return ms, nxt.cached_tokens


def decode_ms(sched: Scheduler, bs: int, seed: int, vocab: int, prompt: int = 512, tokens: int = 128) -> float:
    g = torch.Generator().manual_seed(seed)
    reqs = [Req(f"d{seed}-{i}", random_ids(prompt, g, vocab), greedy(tokens), seed=i) for i in range(bs)]
    for r in reqs:
        sched.add_request(r)
    while sched.waiting or sched.prefilling:
        sched.step()
    sync()
    t = time.perf_counter()
    while sched.has_work:
        sched.step()
    sync()
    return (time.perf_counter() - t) * 1e3 / (tokens - 1)


def snapshot_cost(mr: ModelRunner, sched: Scheduler, vocab: int) -> dict | None:
    cache = mr.kv.prefix_cache
    if cache is None or cache.snapshots is None or mr.device.type != "cuda":
        return None
    chunk = mr.args.chunked_prefill_size
    g = torch.Generator().manual_seed(7)
    # one prefill chunk, timed: a request of one chunk + 1 token, its first chunk alone
    req = Req("snap", random_ids(chunk + 1, g, vocab), greedy(1), seed=0)
    sched.add_request(req)
    sync()
    t = time.perf_counter()
    sched.step()  # the first chunk
    sync()
    chunk_ms = (time.perf_counter() - t) * 1e3
    while sched.has_work:
        sched.step()
    snaps = cache.snapshots
    row = 1
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sids = []
    start.record()
    for _ in range(min(50, snaps.num_free)):
        sids.append(snaps.take(row))
    end.record()
    sync()
    take_ms = start.elapsed_time(end) / len(sids)
    for s in sids:
        snaps.free(s)
    sched.flush_cache()
    state_mb = (snaps.conv[:, 0].numel() * snaps.conv.element_size() + snaps.ssm[:, 0].numel()
                * snaps.ssm.element_size()) / 2**20
    return {"snapshot_ms": take_ms, "chunk_ms": chunk_ms, "chunk_tokens": chunk, "snapshot_mb": state_mb}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="smollm2-135m,qwen3-next-80b-a3b")
    p.add_argument("--prefixes", default="4096,32768")
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--question", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--output-file", default=None, help="append one JSON line per preset")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=0, help="only the first L layers of each preset (0: all)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    prefixes = [int(x) for x in a.prefixes.split(",")]
    sizes = [int(x) for x in a.batch_sizes.split(",")]
    ctx = max(max(prefixes) + a.answer + a.question, 512 + 128) + 64  # (decode: 512-token prompts)
    for preset in a.presets.split(","):
        target, draft, cfg = random_models(preset, torch.bfloat16, dev, ctx + 16, layers=a.layers)
        scheds, runners = {}, {}
        for cache in (False, True):
            args = ServerArgs(speculative_algorithm="MTP", speculative_num_steps=a.steps, context_length=ctx,
                              max_total_tokens=2 * ctx + 8 * 1024, max_running_requests=max(sizes),
                              cuda_graph_max_bs=max(sizes), disable_radix_cache=not cache,
                              speculative_adaptive=False)
            mr = ModelRunner(args, target, cfg, draft, dev, torch.bfloat16, ctx)
            mr.capture_graphs()
            runners[cache] = mr
            scheds[cache] = Scheduler(mr, StopChecker(None, set()), args.chunked_prefill_size)
        row = {"preset": preset, "layers": cfg.num_layers, "N": a.steps, "answer": a.answer, "question": a.question,
               "ttft": [], "decode": []}
        for prefix in prefixes:
            times, cached = {False: [], True: []}, 0
            for i in range(a.repeats + 1):  # the first pair warms up
                for cache in (False, True):
                    ms, hit = next_turn_ttft(scheds[cache], prefix, a.answer, a.question, 100 * i + prefix,
                                             cfg.vocab_size)
                    if i:
                        times[cache].append(ms)
                    if cache:
                        cached = hit
            off, on = statistics.median(times[False]), statistics.median(times[True])
            row["ttft"].append({"prefix": prefix, "off_ms": off, "on_ms": on, "cached_tokens": cached})
            print(f"{preset:<20} prefix {prefix:>6}: next-turn TTFT cache off {off:8.2f} ms, on {on:8.2f} ms "
                  f"({off / on:.1f}x), cached {cached} of {prefix + a.answer + a.question}", flush=True)
        for bs in sizes:
            times = {False: [], True: []}
            for i in range(a.repeats + 1):
                for cache in (False, True):
                    ms = decode_ms(scheds[cache], bs, 1000 + i, cfg.vocab_size)
                    scheds[cache].flush_cache()
                    if i:
                        times[cache].append(ms)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            row["decode"].append({"bs": bs, "off_ms": off, "on_ms": on})
            print(f"{preset:<20} decode bs {bs:>3}: cache off {off:7.3f} ms/token, on {on:7.3f} ({on / off:.3f}x)",
                  flush=True)
        snap = snapshot_cost(runners[True], scheds[True], cfg.vocab_size)
        if snap is not None:
            row["snapshot"] = snap
            print(f"{preset:<20} state snapshot {snap['snapshot_ms']:.3f} ms ({snap['snapshot_mb']:.1f} MiB) vs a "
                  f"{snap['chunk_tokens']}-token prefill chunk {snap['chunk_ms']:.2f} ms", flush=True)
        if a.output_file:
            with open(a.output_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        del scheds, runners, target, draft
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
