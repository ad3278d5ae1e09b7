"""`specserve bench-compare`: speculation against plain decoding through two live servers, over input lengths x
concurrency (the shape in which the reference deployment proved its result), side by side in one run.

    specserve serve --port 30000 ...                                   # speculating (the default model's MTP head)
    specserve serve --port 30001 --speculative-algorithm NONE ...      # plain
    specserve bench-compare --spec-url http://127.0.0.1:30000 --plain-url http://127.0.0.1:30001 \\
        --input-lens 1024,4096,30720 --output-len 512 --concurrency 1,8,32,64 --plot compare.png

Each point runs `specserve bench` (random prompts of exactly the input length: range ratio 1.0, exactly the output
length, 2 x concurrency prompts, the warm-up requests first) against the plain server, then the speculating one,
and reports median TPOT, output throughput, their ratio and the speculating server's accept length over that run;
then the geometric mean of the throughput ratios over all points. --output-file appends one JSON line per point.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from specserve.bench import plot
from specserve.bench.serving import main as bench_main
from specserve.server_args import CommandParser


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _run_point(url: str, isl: int, osl: int, conc: int, args: argparse.Namespace) -> dict:
    """One `specserve bench` run -> its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "point.jsonl")
        argv = ["--backend", args.backend, "--base-url", url, "--dataset-name", "random",
                "--random-input-len", str(isl), "--random-output-len", str(osl), "--random-range-ratio", "1.0",
                "--num-prompts", str(args.prompts_per_concurrency * conc), "--max-concurrency", str(conc),
                "--warmup-requests", str(args.warmup_requests), "--seed", str(args.seed), "--disable-tqdm",
                "--output-file", out]
        if args.tokenizer:
            argv += ["--tokenizer", args.tokenizer]
        if bench_main(argv) != 0:
            raise RuntimeError(f"specserve bench against {url} failed at input {isl}, concurrency {conc}")
        with open(out) as f:
            return json.loads(f.read().splitlines()[-1])


def compare_point(spec: dict, plain: dict, isl: int, conc: int) -> dict:
    tp_s, tp_p = spec["output_throughput"], plain["output_throughput"]
    return {"input_len": isl, "max_concurrency": conc, "num_prompts": spec["num_prompts"],
            "plain_median_tpot_ms": plain["median_tpot_ms"], "spec_median_tpot_ms": spec["median_tpot_ms"],
            "plain_output_throughput": tp_p, "spec_output_throughput": tp_s,
            "speedup": tp_s / tp_p if tp_p else None, "spec_accept_length": spec.get("server_accept_length"),
            "completed": (plain["completed"], spec["completed"])}


def geomean(values: list[float]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def format_table(rows: list[dict]) -> str:
    head = (f"{'input':>6} {'conc':>5} | {'TPOT plain':>10} {'TPOT spec':>10} | {'tok/s plain':>11} "
            f"{'tok/s spec':>11} | {'speedup':>7} | {'accept':>6}")
    lines = [head, "-" * len(head)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        lines.append(f"{r['input_len']:>6} {r['max_concurrency']:>5} | {fmt(r['plain_median_tpot_ms'], '10.2f')} "
                     f"{fmt(r['spec_median_tpot_ms'], '10.2f')} | {r['plain_output_throughput']:11.1f} "
                     f"{r['spec_output_throughput']:11.1f} | {fmt(r['speedup'], '6.2f')}x | "
                     f"{fmt(r['spec_accept_length'], '6.2f')}")
    g = geomean([r["speedup"] for r in rows])
    lines.append(f"geomean output-throughput speedup over {len(rows)} points: {fmt(g, '.3f')}x")
    return "\n".join(lines)


def plot_compare(rows: list[dict], path: str) -> None:
    """Speedup (spec / plain output throughput) against concurrency, one line per input length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for isl in sorted({r["input_len"] for r in rows}):
        pts = sorted((r["max_concurrency"], r["speedup"]) for r in rows if r["input_len"] == isl and r["speedup"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"input {isl}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output throughput, spec / plain")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = CommandParser(prog="specserve bench-compare", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec-url", required=True, help="the speculating server")
    p.add_argument("--plain-url", required=True, help="the same model served without speculation")
    p.add_argument("--backend", default="specserve", choices=("openai", "openai-chat", "sglang", "specserve"))
    p.add_argument("--input-lens", default="1024,4096,30720")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--prompts-per-concurrency", type=int, default=2, help="prompts per point = this x concurrency")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tokenizer", default=None, help="as specserve bench's (default: the servers')")
    p.add_argument("--output-file", default=None, help="append one JSON line per point")
    p.add_argument("--plot", default=None, help="PNG of the speedup against concurrency per input length")
    args = p.parse_args(argv)
    lens, concs = _ints(args.input_lens), _ints(args.concurrency)
    if not lens or not concs or min(lens + concs) < 1 or args.output_len < 1 or args.prompts_per_concurrency < 1:
        p.error("--input-lens, --concurrency, --output-len and --prompts-per-concurrency must be positive")
    if args.plot:
        try:
            plot.check_available()
        except ValueError as e:
            p.error(str(e))
    rows = []
    for isl in lens:
        for conc in concs:
            try:
                plain = _run_point(args.plain_url, isl, args.output_len, conc, args)
                spec = _run_point(args.spec_url, isl, args.output_len, conc, args)
            except RuntimeError as e:
                print(f"specserve bench-compare: {e}", file=sys.stderr)
                return 1
            rows.append(compare_point(spec, plain, isl, conc))
            if args.output_file:
                with open(args.output_file, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    print("\n=== speculation vs plain, output length", args.output_len, "===")
    print(format_table(rows))
    if args.plot:
        plot_compare(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0
