"""Plain decode at batch 1, specserve against gpt-fast, side by side in one process.

    python3 scripts/gpu/vs_gpt_fast.py --gpt-fast /tmp/gpt-fast [--shapes llama-3.1-8b,smollm2-135m] \\
        [--prompt-len 512] [--tokens 256] [--repeats 3]

gpt-fast runs from a checkout outside this repository (`--gpt-fast DIR`: nothing of it is committed here or
imported at module level): only its model.py (Transformer, ModelArgs) is imported, at run time. Its decode step is
compiled the way its generate.py compiles it (torch.compile, mode "reduce-overhead", fullgraph, with the same
inductor settings: coordinate-descent tuning on) and samples the way generate.py samples (logits / temperature, the
top-k kept, softmax, an exponential race), here at temperature 0.8 and top-k 200. specserve serves the same shapes
as a plain engine (random bf16 weights, bench/phase_setup.py presets; --attention-backend auto) with the same
sampling, timed through Scheduler.step as a loop: the steps as served (input staging, the one-graph plain step, the
host read of the tokens), under the overlap schedule (a GPU's default: each step launched before the previous one's
token is read) and, for reference, the synchronous one (--disable-overlap-schedule). Both decode --tokens tokens
after a prompt of --prompt-len random tokens; the runs are interleaved (rounds of specserve overlapped,
synchronous, gpt-fast; the first round warms up and compiles), so a drift of the machine meets every side, and the
median of --repeats rounds is printed per shape with the ratio (each run's figure in the JSON line). Only shapes
matter for time: weights are random on both sides. `--gpt-fast ""` runs specserve alone (a smoke test; also on a
CPU with --device cpu).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from specserve.bench.phase_setup import PRESETS, random_init, random_models
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker
from specserve.server_args import ServerArgs


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def specserve_runs(preset: str, dev: torch.device, prompt_len: int, tokens: int, temperature: float, top_k: int,
                   decode_gemv: str = "auto") -> dict[str, Callable[[int], float]]:
    """One engine, two schedulers on it: {"overlap": run, "sync": run}, where run(i) decodes request i (seed i)
    and returns its seconds per decoded token (the prefill step excluded)."""
    ctx = prompt_len + tokens + 64
    target, _, cfg = random_models(preset, torch.bfloat16, dev, ctx + 8)
    args = ServerArgs(context_length=ctx, max_running_requests=1, cuda_graph_max_bs=1, max_total_tokens=2 * ctx,
                      decode_gemv=decode_gemv)
    mr = ModelRunner(args, target, cfg, None, dev, torch.bfloat16, ctx)
    mr.capture_graphs()
    prompt = torch.randint(10, 1000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    def runner(sched: Scheduler) -> Callable[[int], float]:
        def run(i: int) -> float:
            r = Req(f"r{i}", list(prompt), SamplingParams(max_new_tokens=tokens, temperature=temperature,
                                                          top_k=top_k, ignore_eos=True), seed=i)
            prefills = sched.stats.num_prefill_steps
            sched.add_request(r)
            while not r.output_ids:  # the prefill (under the overlap schedule its token comes with the next step)
                sched.step()
            assert sched.stats.num_prefill_steps == prefills + 1
            sync(dev)  # a decode step in flight now is done before the clock starts: its token is not counted
            done = len(r.output_ids) + int(sched.in_flight)
            t = time.perf_counter()
            while sched.has_work:  # decode steps as the engine runs them, timed as a loop (as gpt-fast's)
                sched.step()
            sync(dev)
            sched.check_idle_invariants()
            return (time.perf_counter() - t) / (len(r.output_ids) - done)
        return run

    return {name: runner(Scheduler(mr, StopChecker(None, set()), args.chunked_prefill_size, overlap=on))
            for name, on in (("overlap", dev.type == "cuda"), ("sync", False))}


def gpt_fast_args(preset: str, model_args, block_size: int):
    p = PRESETS[preset]
    rope = (p.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return model_args(block_size=block_size, vocab_size=p["vocab_size"], n_layer=p["num_hidden_layers"],
                      n_head=p["num_attention_heads"], dim=p["hidden_size"], intermediate_size=p["intermediate_size"],
                      n_local_heads=p["num_key_value_heads"], rope_base=rope, norm_eps=p["rms_norm_eps"])


def gpt_fast_run(gpt_fast_dir: str, preset: str, dev: torch.device, prompt_len: int, tokens: int,
                 temperature: float, top_k: int, coordinate_descent: bool) -> Callable[[int], float]:
    """gpt-fast's model compiled as its generate.py does; run(i) decodes `tokens` after the prompt and returns the
    seconds per decoded token (its first call compiles)."""
    import torch._inductor.config as inductor

    sys.path.insert(0, gpt_fast_dir)
    from model import ModelArgs, Transformer  # gpt-fast's model.py, from the checkout (not this repository)

    inductor.coordinate_descent_tuning = coordinate_descent
    inductor.triton.unique_kernel_names = True
    ctx = prompt_len + tokens + 64
    with torch.device(dev):
        model = Transformer(gpt_fast_args(preset, ModelArgs, ctx))
    model = model.to(torch.bfloat16)
    random_init(model, 0)  # as specserve's side: Normal(0, 0.02) weights, unit norms
    with torch.device(dev):
        model.setup_caches(max_batch_size=1, max_seq_length=ctx)

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        logits = model(x, pos)[0, -1] / temperature  # [V]
        kth = torch.topk(logits, top_k).values[-1]
        probs = torch.softmax(torch.where(logits < kth, float("-inf"), logits), dim=-1)
        return torch.argmax(probs / torch.empty_like(probs).exponential_(1)).view(1, 1).to(torch.int)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(10, 1000, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(dev)

    def run(i: int) -> float:
        with torch.no_grad():
            x = step(prompt, torch.arange(prompt_len, device=dev))  # prefill, eager (as generate.py by default)
            pos = torch.tensor([prompt_len], device=dev, dtype=torch.int)
            sync(dev)
            t = time.perf_counter()
            for _ in range(tokens - 1):
                x = compiled(x, pos).clone()
                pos += 1
            sync(dev)
        return (time.perf_counter() - t) / (tokens - 1)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpt-fast", required=True, help="a gpt-fast checkout outside this repository ('' to skip it)")
    p.add_argument("--shapes", default="llama-3.1-8b,smollm2-135m")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=200)
    p.add_argument("--decode-gemv", default="auto", choices=("auto", "triton", "cublas"),
                   help="specserve's dense decode projections (as `serve --decode-gemv`)")
    p.add_argument("--no-coordinate-descent", action="store_true", help="gpt-fast: faster compile, slower kernels")
    p.add_argument("--device", default="cuda")
    p.add_argument("--output-file", default=None, help="append one JSON line per shape")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    for shape in a.shapes.split(","):
        row = {"shape": shape, "prompt_len": a.prompt_len, "tokens": a.tokens, "temperature": a.temperature,
               "top_k": a.top_k, "decode_gemv": a.decode_gemv}
        runs = specserve_runs(shape, dev, a.prompt_len, a.tokens, a.temperature, a.top_k, a.decode_gemv)
        if a.gpt_fast:
            runs["gpt-fast"] = gpt_fast_run(a.gpt_fast, shape, dev, a.prompt_len, a.tokens, a.temperature,
                                            a.top_k, not a.no_coordinate_descent)
        times = {name: [] for name in runs}
        for i in range(a.repeats + 1):  # rounds interleave the runs, so a drift of the machine meets all of them
            for name, run in runs.items():
                sec = run(i)
                if i:  # the first round compiles and warms up
                    times[name].append(sec)
        row["specserve_ms"] = 1e3 * statistics.median(times["overlap"])
        row["specserve_sync_ms"] = 1e3 * statistics.median(times["sync"])
        line = (f"{shape:<14} specserve {row['specserve_ms']:.3f} ms/token (synchronous schedule "
                f"{row['specserve_sync_ms']:.3f})")
        if a.gpt_fast:
            row["gpt_fast_ms"] = 1e3 * statistics.median(times["gpt-fast"])
            row["gpt_fast_runs_ms"] = [round(1e3 * t, 3) for t in times["gpt-fast"]]
            row["specserve_runs_ms"] = [round(1e3 * t, 3) for t in times["overlap"]]
            row["specserve_speedup"] = row["gpt_fast_ms"] / row["specserve_ms"]
            line += f" | gpt-fast {row['gpt_fast_ms']:.3f} ms/token | specserve {row['specserve_speedup']:.3f}x"
        print(line, flush=True)
        if a.output_file:
            with open(a.output_file, "a") as f:
                f.write(json.dumps(row) + "\n")
        del runs
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
