"""`specserve bench-phases`: per-phase times eager vs CUDA graph, the whole speculative iteration vs one plain decode
step, decode bandwidth at batch 1, and the GPU idle time between steps — all measured side by side in one run.

    specserve bench-phases --preset llama-3.1-8b --batch-sizes 1,8,32,64        (random bf16 weights on the GPU)
    specserve bench-phases --model-path M.gguf --speculative-draft-model-path D   (a real checkpoint)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from specserve.bench.floors import phase_floors
from specserve.bench.phase_setup import (
    PRESETS,
    fake_requests,
    make_runners,
    random_draft,
    random_models,
    random_token_map,
    release,
)
from specserve.engine.steps import run_decode, run_plain_step, run_spec_step
from specserve.graphs.padding import LiveInputs
from specserve.server_args import ATTENTION_BACKENDS, DECODE_GEMV, INDEXER_CACHE_DTYPES, CommandParser


def timeit(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call (CUDA events on the GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Measured device copy bandwidth in GB/s, counting bytes read plus written."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timeit(lambda: dst.copy_(src), device, 10)
    return 2 * n * 2 / (ms * 1e-3) / 1e9


def phase_inputs(mr, reqs, name: str) -> LiveInputs:
    dev = mr.device
    n = mr.num_steps
    rows = torch.tensor([r.kv.row for r in reqs], device=dev)
    s_host = [r.seq_len for r in reqs]
    s = torch.tensor(s_host, device=dev)
    bs, m = len(reqs), max(s_host)
    if name == "decode":
        return LiveInputs(bs, mr.last_token[rows], s, rows, s + 1, m + 1)
    if name == "draft_decode":
        return LiveInputs(bs, mr.spec.state.draft_token[rows], s, rows, s + 1, m + n - 1,
                          hidden=mr.spec.state.draft_hidden[rows])
    w = n + 1
    pos = (s[:, None] + torch.arange(w, device=dev)).reshape(-1)
    ids = torch.randint(10, min(1000, mr.cfg.vocab_size), (bs * w,), device=dev)
    if name == "target_verify":
        return LiveInputs(bs, ids, pos, rows, s + w, m + w)
    hidden = torch.randn(bs * w, mr.draft.feature_size, device=dev).to(mr.dtype)  # target features
    return LiveInputs(bs, ids, pos, rows, s + w, m + w, accept_len=torch.randint(0, w, (bs,), device=dev),
                      hidden=hidden)


def bench_batch(pair, bs: int, prefix: int, iters: int) -> dict:
    dev = pair.plain.device
    out: dict = {"bs": bs}
    for mr, names in ((pair.plain, ["decode"]), (pair.spec, ["target_verify", "draft_decode", "draft_extend"])):
        reqs = fake_requests(mr, bs, prefix, seed=bs)
        runners = {r.name: r for r in (mr.spec.phases.all() if mr.spec is not None else mr.phases.all())}
        for name in names:
            if name not in runners:
                continue
            r = runners[name]
            live = phase_inputs(mr, reqs, name)
            eager = timeit(lambda r=r, live=live: r.forward_phase(live, r.eager_backends, graph_mode=False), dev,
                           iters)
            graph = timeit(lambda r=r, live=live: r.run(live), dev, iters) if r.use_graphs and r.graphs else None
            per = mr.num_steps - 1 if name == "draft_decode" else 1
            out[name] = {"eager_ms": eager / per, "graph_ms": None if graph is None else graph / per}
        if mr is pair.plain:
            out["plain_step_ms"] = timeit(lambda mr=mr, reqs=reqs: run_decode(mr, reqs), dev, iters)
        else:
            # the step as run: one graph (greedy); then phase by phase (each phase's graph); then all eager
            out["spec_iter_ms"] = timeit(lambda mr=mr, reqs=reqs: run_spec_step(mr, reqs), dev, iters)
            switchable = list(runners.values())
            if mr.spec.spec_step_graph is not None:
                mr.spec.spec_step_graph.use_graphs = False
                out["spec_iter_phases_ms"] = timeit(lambda mr=mr, reqs=reqs: run_spec_step(mr, reqs), dev, iters)
                switchable.append(mr.spec.spec_step_graph)
            for rr in runners.values():
                rr.use_graphs = False
            out["spec_iter_eager_ms"] = timeit(lambda mr=mr, reqs=reqs: run_spec_step(mr, reqs), dev,
                                               max(3, iters // 4))
            for rr in switchable:
                rr.use_graphs = bool(rr.graphs) or dev.type != "cuda"
            if mr.spec.plain_step_ctx is not None:  # adaptive speculation's plain step (the draft lags; cleared)
                rows = [r.kv.row for r in reqs]
                out["spec_plain_step_ms"] = timeit(lambda mr=mr, reqs=reqs, rows=rows: (
                    run_plain_step(mr, reqs), mr.spec.lag.clear(rows)), dev, iters)
        release(mr, reqs)
    out["spec_iter_over_plain_step"] = out["spec_iter_ms"] / out["plain_step_ms"]
    if "spec_plain_step_ms" in out:
        out["spec_plain_over_plain_step"] = out["spec_plain_step_ms"] / out["plain_step_ms"]
    return out


def bench_prefill(mr, tokens: int, iters: int) -> dict:
    """One prompt of `tokens` tokens from an empty prefix through the target's prefill: the eager forward against
    the prefill runner (its CUDA graph at the padded count when one was captured)."""
    from specserve.graphs.prefill import ExtendBatch
    from specserve.kvcache.manager import KVHandle

    dev = mr.device
    h = KVHandle()
    assert mr.kv.assign_row(h) and mr.kv.ensure([h], [tokens])
    ids = torch.randint(10, min(1000, mr.cfg.vocab_size), (tokens,), device=dev)
    x = ExtendBatch(ids, torch.arange(tokens, device=dev), mr.req_to_token.table[h.row, :tokens], [h.row],
                    [tokens], [tokens])
    r = mr.prefill
    eager = timeit(lambda: r.forward(r._eager_batch(x)), dev, max(3, iters // 2))
    graph = timeit(lambda: r.run(x), dev, max(3, iters // 2)) if r.fits(x) and r.graphs else None
    mr.kv.release(h)
    return {"tokens": tokens, "eager_ms": eager, "graph_ms": graph}


def idle_fraction(mr, prefix: int, steps: int, spec: bool) -> dict:
    """GPU idle share of wall time over `steps` real steps at batch 1 (each step: stage, replay, sample/accept,
    read the tokens back), from the kernel intervals CUPTI records (CUDA activity only, so the profiler adds no
    per-op host overhead)."""
    from torch.profiler import ProfilerActivity, profile

    reqs = fake_requests(mr, 1, prefix, seed=7)
    step = (lambda: run_spec_step(mr, reqs)) if spec else (lambda: run_decode(mr, reqs))
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    release(mr, reqs)
    return {"steps": steps, "wall_ms_per_step": wall * 1e3 / steps, "gpu_busy_us_per_step": busy / steps,
            "idle_fraction": 1.0 - busy / window if window else None}


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="specserve bench-phases", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="random weights of these shapes")
    p.add_argument("--model-path", default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=3)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--prefix-len", type=int, default=512, help="KV tokens already cached per request")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="as the server's flag (triton: the Triton MLA and indexer kernels, sparse rows per query)")
    p.add_argument("--decode-gemv", default="auto", choices=DECODE_GEMV,
                   help="dense layers' decode-row projections: fused Triton GEMVs or cuBLAS (as `serve`)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--idle-steps", type=int, default=50)
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help="one prompt of this many tokens: the target prefill, eager vs graph (0: skip)")
    p.add_argument("--project-accept-lengths", default=None,
                   help="comma-separated accept lengths (tokens per verify): print the projected speed-up "
                        "accept / (spec iter / plain step) at each batch size, labelled a projection")
    p.add_argument("--indexer-cache-dtype", default="auto", choices=INDEXER_CACHE_DTYPES,
                   help="the DSA indexer's key cache (as the server's flag)")
    p.add_argument("--token-map-size", type=int, default=0,
                   help="restrict the draft's head to this many token ids (--speculative-token-map; random ids: "
                        "timing only). 0: the full vocabulary")
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    bss = [int(x) for x in args.batch_sizes.split(",")]
    max_pos = args.context_length + args.speculative_num_steps + 8
    if args.preset:
        target, draft, cfg = random_models(args.preset, dtype, dev, max_pos)
        label = f"{args.preset} (random {args.dtype})"
    else:
        from specserve.defaults import embedded_model_path
        from specserve.models.loader import ModelSource, load_mtp_draft, load_target

        t = load_target(ModelSource.resolve(args.model_path or embedded_model_path()), dtype, dev, max_pos)
        target, cfg = t.model, t.config
        if args.speculative_draft_model_path or t.has_mtp:
            draft = load_mtp_draft(t, args.speculative_draft_model_path, dtype, dev, max_pos)
        else:
            draft = random_draft(cfg, target, dtype, dev, max_pos)  # timing only: weights do not matter
        label = args.model_path or "embedded SmolLM2-135M-Instruct"
    if args.token_map_size:
        draft.restrict_vocab(random_token_map(cfg.vocab_size, args.token_map_size))
        label += f", token map of {args.token_map_size}"
    if args.indexer_cache_dtype != "auto":
        label += f", indexer keys {args.indexer_cache_dtype}"
    pair = make_runners(target, draft, cfg, dtype, dev, args.speculative_num_steps, max(bss), args.context_length,
                        disable_graphs=False, attention_backend=args.attention_backend, capture_bs=bss,
                        prefill_graph_tokens=args.prefill_tokens, decode_gemv=args.decode_gemv,
                        indexer_cache_dtype=args.indexer_cache_dtype)
    result: dict = {"model": label, "attention_backend": args.attention_backend, "decode_gemv": args.decode_gemv,
                    "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "N": args.speculative_num_steps, "prefix_len": args.prefix_len, "batches": []}
    if dev.type == "cuda":
        result["copy_bw_GBps"] = copy_bandwidth(dev)
    for bs in bss:
        result["batches"].append(bench_batch(pair, bs, args.prefix_len, args.iters))
    if args.prefill_tokens:
        result["prefill"] = bench_prefill(pair.plain, args.prefill_tokens, args.iters)
    if args.project_accept_lengths:
        result["projection"] = [
            {"bs": b["bs"], "accept": a, "speedup": a / b["spec_iter_over_plain_step"]}
            for a in (float(x) for x in args.project_accept_lengths.split(",")) for b in result["batches"]]
    for b in result["batches"]:  # each phase's bandwidth floor (bench/floors.py) at the measured copy bandwidth
        b["floors"] = phase_floors(target, draft, b["bs"], args.prefix_len + 1, args.speculative_num_steps, dtype,
                                   pair.spec.kind_dtypes).as_dict(result.get("copy_bw_GBps"))
    b1 = next((b for b in result["batches"] if b["bs"] == 1), None)
    if b1 is not None and b1["decode"]["graph_ms"]:
        moved = b1["floors"]["decode"]
        bw = moved / (b1["decode"]["graph_ms"] * 1e-3) / 1e9
        result["decode_bs1"] = {"bytes": moved, "ms": b1["decode"]["graph_ms"], "GBps": bw}
        if "copy_bw_GBps" in result:
            result["decode_bs1"]["fraction_of_copy_bw"] = bw / result["copy_bw_GBps"]
    if dev.type == "cuda" and args.idle_steps > 0:
        result["idle_plain"] = idle_fraction(pair.plain, args.prefix_len, args.idle_steps, spec=False)
        result["idle_spec"] = idle_fraction(pair.spec, args.prefix_len, args.idle_steps, spec=True)
    if b1 is not None and b1["decode"]["graph_ms"]:
        # Without a profiler: the graph replay alone (events, back to back) against the whole step.
        result["host_share_plain"] = 1.0 - b1["decode"]["graph_ms"] / b1["plain_step_ms"]
    if b1 is not None and "idle_plain" in result:
        # The profiler's own host cost stretches the profiled wall time, so the idle share is also given against
        # the un-profiled step time: 1 - (kernel busy time per step) / (step time measured with events).
        result["idle_plain"]["idle_vs_unprofiled_step"] = 1.0 - result["idle_plain"]["gpu_busy_us_per_step"] / (
            1e3 * b1["plain_step_ms"])
        result["idle_spec"]["idle_vs_unprofiled_step"] = 1.0 - result["idle_spec"]["gpu_busy_us_per_step"] / (
            1e3 * b1["spec_iter_ms"])
    print_table(result)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


def print_table(r: dict) -> None:
    print(f"\n=== bench-phases: {r['model']} on {r['device']}, N={r['N']}, prefix {r['prefix_len']} tokens ===")
    if "copy_bw_GBps" in r:
        print(f"measured copy bandwidth: {r['copy_bw_GBps']:.0f} GB/s")
    hdr = f"{'bs':>4} | {'phase':<14} | {'eager ms':>9} | {'graph ms':>9} | {'speedup':>7}"
    print(hdr)
    print("-" * len(hdr))
    for b in r["batches"]:
        for name in ("decode", "target_verify", "draft_decode", "draft_extend"):
            if name not in b:
                continue
            e, g = b[name]["eager_ms"], b[name]["graph_ms"]
            label = "draft step" if name == "draft_decode" else name
            gs = f"{g:9.3f}" if g else f"{'-':>9}"
            sp = f"{e / g:6.1f}x" if g else f"{'-':>7}"
            print(f"{b['bs']:>4} | {label:<14} | {e:9.3f} | {gs} | {sp}")
        if "spec_iter_phases_ms" in b:
            print(f"{b['bs']:>4} | {'spec phases':<14} | {'':9} | {b['spec_iter_phases_ms']:9.3f} |  (each phase "
                  "its own graph)")
        print(f"{b['bs']:>4} | {'spec iter':<14} | {b['spec_iter_eager_ms']:9.3f} | {b['spec_iter_ms']:9.3f} | "
              f"{b['spec_iter_eager_ms'] / b['spec_iter_ms']:6.1f}x")
        print(f"{b['bs']:>4} | {'plain step':<14} | {'':9} | {b['plain_step_ms']:9.3f} |")
        if "spec_plain_step_ms" in b:  # what adaptive speculation's plain steps cost against a plain engine's
            print(f"{b['bs']:>4} | {'plain (spec)':<14} | {'':9} | {b['spec_plain_step_ms']:9.3f} |  "
                  f"(a speculating engine's plain step: {b['spec_plain_over_plain_step']:.2f}x a plain engine's)")
        print(f"{b['bs']:>4} | spec iter / plain step = {b['spec_iter_over_plain_step']:.2f}x")
        if "ms" in b.get("floors", {}):
            print_floor_line(b)
    if "prefill" in r:
        pf = r["prefill"]
        g = pf["graph_ms"]
        gs = f"{g:9.3f}" if g else f"{'-':>9}"
        sp = f"{pf['eager_ms'] / g:6.1f}x" if g else f"{'-':>7}"
        print(f"{1:>4} | {'prefill ' + str(pf['tokens']):<14} | {pf['eager_ms']:9.3f} | {gs} | {sp}")
    for pr in r.get("projection", []):
        print(f"PROJECTION (not measured end to end): accept length {pr['accept']:.1f} at bs {pr['bs']} -> "
              f"{pr['speedup']:.2f}x plain decode throughput")
    if "decode_bs1" in r:
        d = r["decode_bs1"]
        frac = f" = {100 * d['fraction_of_copy_bw']:.1f}% of copy bandwidth" if "fraction_of_copy_bw" in d else ""
        print(f"plain decode bs1: {d['bytes'] / 1e9:.2f} GB in {d['ms']:.3f} ms -> {d['GBps']:.0f} GB/s{frac}")
    if "host_share_plain" in r:
        print(f"plain step bs1 beyond its graph replay (host work + sampling): {100 * r['host_share_plain']:.1f}%")
    for k in ("idle_plain", "idle_spec"):
        if k in r:
            i = r[k]
            extra = (f"; against the un-profiled step: idle {100 * i['idle_vs_unprofiled_step']:.1f}%"
                     if "idle_vs_unprofiled_step" in i else "")
            print(f"{k}: profiled wall {i['wall_ms_per_step']:.3f} ms/step, GPU busy "
                  f"{i['gpu_busy_us_per_step'] / 1e3:.3f} ms/step, idle {100 * i['idle_fraction']:.1f}%{extra}")


def print_floor_line(b: dict) -> None:
    """A batch's phases against their bandwidth floors, and the least spec iter / plain step that faster spec
    phases could give against the plain step measured (the spec iteration at its floor)."""
    f, ms = b["floors"], b["floors"]["ms"]
    # the measured phases are keyed by runner: the draft decode runner's floor is "draft_step"
    ms_of = {"decode": ms["decode"], "target_verify": ms["target_verify"], "draft_decode": ms["draft_step"],
             "draft_extend": ms["draft_extend"]}
    eff = {k: ms_of[k] / b[k]["graph_ms"] for k in ms_of if k in b and b[k]["graph_ms"]}
    parts = ", ".join(f"{k} {ms_of[k]:.3f} ms ({100 * v:.0f}%)" for k, v in eff.items())
    print(f"{b['bs']:>4} | floors: {parts}; spec iter {ms['spec_iter']:.3f} ms "
          f"({100 * ms['spec_iter'] / b['spec_iter_ms']:.0f}%)")
    print(f"{b['bs']:>4} | spec iter / plain step at both floors {f['spec_over_plain']:.2f}x; with the spec "
          f"iteration at its floor, against this plain step: >= {ms['spec_iter'] / b['plain_step_ms']:.2f}x")
