"""`specserve bench-spec`: a draft head measured end to end, side by side in one run, with the target and the head
loaded once:

  * acceptance: greedy mean accept length (accepted drafts + 1 per verify) per prompt file for N in a list;
  * speed: output tokens/s of plain decoding and of speculative decoding (N in a list) at each concurrency,
    on the same chat-templated prompts, greedy by default (or sampled: --temperature, --top-p, --top-k, --min-p,
    the same for every configuration, a seed per prompt), with the speculative/plain ratio end to end (prefill
    included, the number to quote) and over the time outside prefill steps (what the decode steps alone gain), and
    the share of the wall time spent in prefill steps. Each engine runs as served, so on a GPU under the overlap
    schedule (engine/overlap.py): a prefill step's time then also holds the rest of the decode step in flight.

    specserve bench-spec --model-path M --speculative-draft-model-path D --prompts qa.jsonl sum.jsonl \
        --accept-steps 1,2,3,4,5 --speed-steps 3,4 --concurrency 1,8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from specserve.engine.engine import resolve_device
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker
from specserve.layers.quant import OnlineFp8, quantize_draft, quantize_fp8_online
from specserve.models.loader import ModelSource, load_hf_config, load_mtp_draft, load_target, resolve_dtype
from specserve.server_args import DRAFT_SAMPLING, QUANTIZATIONS, CommandParser, ServerArgs, embedded_draft_quantization
from specserve.tokenizer import eos_token_ids, load_tokenizer


@dataclass(frozen=True)
class SpeedConfig:
    """One row of the speed table: plain decoding (n = 0) or speculation with N = n."""

    n: int
    one_graph: bool = True  # greedy spec steps as one CUDA graph (False: phase by phase)
    float_draft: bool = False  # the head without its int8 weights (when the bench quantizes it)
    prefill_graph: bool = True  # prefill as CUDA graphs (False: eager, --cuda-graph-max-prefill-tokens 0)
    draft_sampling: str = "argmax"  # sampled requests' drafts (--speculative-draft-sampling)
    mtp_chain: str = "normed"  # the draft's chained hidden state (--speculative-mtp-chain)
    fp8: bool = False  # target and draft with online FP8 weights and an fp8_e4m3 KV cache (--compare-fp8)

    @property
    def label(self) -> str:
        eager = ("" if self.prefill_graph else " eager prefill") + (" fp8" if self.fp8 else "")
        if self.n == 0:
            return "plain" + eager
        return (f"MTP N={self.n}" + ("" if self.one_graph else " phases") + (" float" if self.float_draft else "")
                + (" q-drafts" if self.draft_sampling == "sample" else "")
                + (" prenorm" if self.mtp_chain == "prenorm" else "") + eager)

    @property
    def baseline(self) -> SpeedConfig:
        """The plain configuration this one's speed-up is against (the same prefill)."""
        return SpeedConfig(0, prefill_graph=self.prefill_graph, fp8=self.fp8)


@dataclass
class Run:
    """One timed pass over the prompts."""

    reqs: list[Req]
    wall: float  # seconds, everything
    prefill: float  # seconds spent in prefill steps

    @property
    def tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.reqs)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall

    @property
    def decode_tok_per_s(self) -> float:
        """Output tokens per second of the time outside prefill steps."""
        return self.tokens / max(self.wall - self.prefill, 1e-9)


class Bench:
    def __init__(self, args):
        from specserve.defaults import embedded_draft_path, embedded_model_path

        self.model_path = args.model_path or embedded_model_path()
        self.draft_path = args.speculative_draft_model_path or (
            embedded_draft_path() if args.model_path is None else None)
        self.device = resolve_device(args.device)
        src = ModelSource.resolve(self.model_path)
        hf = load_hf_config(src)
        self.dtype = resolve_dtype(args.dtype, hf, self.device)
        self.context_len = args.context_length
        self.max_pos = self.context_len + 32
        self.target = load_target(src, self.dtype, self.device, self.max_pos, hf)
        self.draft = load_mtp_draft(self.target, self.draft_path, self.dtype, self.device, self.max_pos)
        quant = args.speculative_draft_model_quantization
        if quant is None:  # as the server: int8 for the shipped head on a CPU
            quant = embedded_draft_quantization(self.device.type) if args.model_path is None else "none"
        quantize_draft(self.draft, quant, self.device)
        self.draft_quantization = quant
        self.float_draft = None  # loaded on demand: the same head without int8 (--compare-draft-quantization)
        self.fp8_models = None  # loaded on demand: target and draft in online FP8 (--compare-fp8)
        self.tokenizer = load_tokenizer(src)
        self.stop = StopChecker(self.tokenizer, eos_token_ids(self.tokenizer, self.target.config.eos_token_ids, {}))
        self.args = args

    def fp8_pair(self) -> tuple:
        """The target and draft again, given online FP8 as the server gives them under `--quantization fp8` (a scale
        per output row, the gated delta net's gate rows kept), then the draft's own quantization as for the others."""
        if self.fp8_models is None:
            src = ModelSource.resolve(self.model_path)
            target = load_target(src, self.dtype, self.device, self.max_pos, load_hf_config(src))
            draft = load_mtp_draft(target, self.draft_path, self.dtype, self.device, self.max_pos)
            online = OnlineFp8.from_flags("fp8", None)
            for m in (target.model, draft):
                quantize_fp8_online(m, online)
            quantize_draft(draft, self.draft_quantization, self.device)
            self.fp8_models = (target, draft)
        return self.fp8_models

    def scheduler(self, cfg: SpeedConfig, concurrency: int) -> Scheduler:
        a = self.args
        n = cfg.n
        target = self.target
        draft = None
        if cfg.fp8:
            target, fp8_draft = self.fp8_pair()
            draft = fp8_draft if n else None
        elif n and cfg.float_draft:
            if self.float_draft is None:
                self.float_draft = load_mtp_draft(self.target, self.draft_path, self.dtype, self.device, self.max_pos)
            draft = self.float_draft
        elif n:
            draft = self.draft
        # An explicit KV budget per run: several runners live in this process one after another, so none may take
        # the memory-fraction default (most of the GPU).
        kv = a.max_total_tokens or concurrency * (self.context_len + 64)
        sa = ServerArgs(model_path=self.model_path, context_length=self.context_len,
                        max_running_requests=concurrency, max_total_tokens=kv,
                        cuda_graph_max_bs=concurrency, disable_cuda_graph=a.disable_cuda_graph,
                        disable_spec_step_graph=not cfg.one_graph,
                        cuda_graph_max_prefill_tokens=None if cfg.prefill_graph else 0,
                        speculative_algorithm="MTP" if n else None, speculative_num_steps=n or None,
                        speculative_ngram_lookup=a.speculative_ngram_lookup and bool(n),
                        speculative_ngram_confidence=a.speculative_ngram_confidence,
                        speculative_draft_sampling=cfg.draft_sampling, speculative_mtp_chain=cfg.mtp_chain,
                        kv_cache_dtype="fp8_e4m3" if cfg.fp8 else "auto")
        mr = ModelRunner(sa, target.model, target.config, draft, self.device, self.dtype, self.context_len)
        mr.capture_graphs()
        return Scheduler(mr, self.stop, sa.chunked_prefill_size)

    def run(self, sched: Scheduler, prompts: list[list[int]], max_new: int) -> Run:
        a = self.args
        sp = dict(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p)
        reqs = [Req(f"b{i}", p, SamplingParams(max_new_tokens=max_new, **sp), seed=i)
                for i, p in enumerate(prompts)]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        prefill = 0.0
        t0 = time.perf_counter()
        for r in reqs:
            sched.add_request(r)
        while sched.has_work:
            n_prefill = sched.stats.num_prefill_steps
            t = time.perf_counter()
            sched.step()  # ends in the step's host sync: its time is the step's
            if sched.stats.num_prefill_steps != n_prefill:
                prefill += time.perf_counter() - t
        wall = time.perf_counter() - t0
        sched.check_idle_invariants()
        return Run(reqs, wall, prefill)


def accept_length(reqs: list[Req]) -> float:
    v = sum(r.spec_verify_ct for r in reqs)
    return (sum(r.spec_accepted_drafts for r in reqs) + v) / v if v else 0.0


def load_prompt_sets(b: Bench, files: list[str], per_file: int, max_new: int) -> dict[str, list[list[int]]]:
    from specserve.train.data import load_prompts

    out = {}
    room = b.context_len - max_new - 8
    for f in files:
        ps = load_prompts([f])[:per_file]
        # as the server and `specserve generate --chat` tokenise a chat: the template's text, then encode
        ids = [b.tokenizer.encode(b.tokenizer.apply_chat_template(p.messages, tokenize=False,
                                                                  add_generation_prompt=True)) for p in ps]
        kept = [x for x in ids if len(x) < room]
        if not kept:
            print(f"note: {os.path.basename(f)}: no prompt fits the context with {max_new} new tokens; skipped")
            continue
        out[os.path.basename(f)] = kept
    return out


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="specserve bench-spec", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="target (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--speculative-draft-model-path", default=None, help="default: the shipped head")
    p.add_argument("--prompts", nargs="+", required=True, help="prompt files (JSON/JSONL)")
    p.add_argument("--prompts-per-file", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--accept-steps", default="1,2,3,4,5", help="N values for the acceptance table ('' to skip)")
    p.add_argument("--speed-steps", default="3", help="N values for the speed table ('' to skip)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--speed-prompts", type=int, default=16, help="prompts per speed run (from all files)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved timed runs per speed configuration; the median is reported")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--compare-spec-step-graph", action="store_true",
                   help="also time each N with greedy spec steps run phase by phase (--disable-spec-step-graph), "
                        "interleaved with the rest")
    p.add_argument("--speculative-ngram-lookup", action="store_true",
                   help="drafts may come from n-gram continuations in the context (see `specserve serve --help`)")
    p.add_argument("--speculative-ngram-confidence", type=float, default=0.5)
    p.add_argument("--speculative-draft-model-quantization", choices=QUANTIZATIONS, default=None,
                   help="int8: weight-only int8 draft on CPU (default: int8 for the shipped head on a CPU, else none)")
    p.add_argument("--compare-draft-quantization", action="store_true",
                   help="with an int8 draft, also time each N with the head in float, interleaved with the rest")
    p.add_argument("--compare-prefill-graph", action="store_true",
                   help="also time plain and each N with eager prefill (--cuda-graph-max-prefill-tokens 0), "
                        "interleaved with the rest; their speed-ups are against plain with eager prefill")
    p.add_argument("--compare-fp8", action="store_true",
                   help="also measure with FP8 weights (online, as --quantization fp8) and an fp8_e4m3 KV cache, "
                        "target and draft, on the same prompts")
    p.add_argument("--speculative-draft-sampling", choices=DRAFT_SAMPLING, default="argmax",
                   help="sampled requests' drafts: the head's argmax or drawn from its distribution")
    p.add_argument("--compare-draft-sampling", action="store_true",
                   help="also time each N with the other --speculative-draft-sampling, interleaved with the rest")
    p.add_argument("--speculative-mtp-chain", choices=("normed", "prenorm"), default="normed",
                   help="the draft's hidden state chained into its next step: after its final norm or before")
    p.add_argument("--compare-mtp-chain", action="store_true",
                   help="acceptance table: every N with both chains (the draft is shared, so not in the speed table)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling of every run, acceptance and speed (0: greedy; sampled speculation is lossless in "
                        "distribution, so outputs are compared with plain only when greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--output-file", default=None, help="append the results as one JSON line")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    greedy = args.temperature == 0.0
    mode = "greedy" if greedy else (f"sampled: temperature {args.temperature}, top-p {args.top_p}, "
                                    f"top-k {args.top_k}, min-p {args.min_p}")
    steps = [int(x) for x in args.accept_steps.split(",") if x]
    speed_steps = [int(x) for x in args.speed_steps.split(",") if x]
    conc = [int(x) for x in args.concurrency.split(",") if x]
    b = Bench(args)
    if args.compare_draft_quantization and b.draft_quantization == "none":
        p.error("--compare-draft-quantization needs a quantized draft (--speculative-draft-model-quantization int8)")
    sets = load_prompt_sets(b, args.prompts, args.prompts_per_file, args.max_new_tokens)
    result: dict = {"model": b.model_path, "draft": b.draft_path, "draft_quantization": b.draft_quantization,
                    "device": str(b.device),
                    "dtype": str(b.dtype).replace("torch.", ""), "max_new_tokens": args.max_new_tokens,
                    "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                 "min_p": args.min_p},
                    "acceptance": {}, "speed": []}
    if steps:
        # columns: N, or (with --compare-mtp-chain) N with the normed chain, then N with the pre-norm chain
        # columns: N, or (with --compare-mtp-chain) N with the normed chain, then N with the pre-norm chain; with
        # --compare-fp8 each of those in the checkpoint's dtype, then with FP8 weights and an FP8 KV cache
        chains = ("normed", "prenorm") if args.compare_mtp_chain else (args.speculative_mtp_chain,)
        fp8s = (False, True) if args.compare_fp8 else (False,)
        cols = [(n, c, f) for n in steps for c in chains for f in fp8s]

        def key(n: int, chain: str, fp8: bool) -> str:
            return str(n) + ("" if len(chains) == 1 else f"/{chain}") + ("/fp8" if fp8 else "")

        print(f"\n=== acceptance ({mode}, {args.max_new_tokens} new tokens) ===")
        print(f"{'file':<28} " + " ".join(f"N={key(*col):<12}" for col in cols))
        big = max(len(v) for v in sets.values())
        for name, prompts in sets.items():
            row = {}
            for n, c, f in cols:
                cfg = SpeedConfig(n, draft_sampling=args.speculative_draft_sampling, mtp_chain=c, fp8=f)
                sched = b.scheduler(cfg, min(big, 64))  # built and run one at a time: the shared draft's chain
                row[key(n, c, f)] = round(accept_length(b.run(sched, prompts, args.max_new_tokens).reqs), 3)
                del sched
            result["acceptance"][name] = row
            print(f"{name:<28} " + " ".join(f"{row[key(*col)]:<14.3f}" for col in cols))
        mean = {key(*col): round(sum(r[key(*col)] for r in result["acceptance"].values()) / len(sets), 3)
                for col in cols}
        result["acceptance"]["mean"] = mean
        print(f"{'mean':<28} " + " ".join(f"{mean[key(*col)]:<14.3f}" for col in cols))
        if args.compare_fp8:  # the bound: FP8 may cost at most 2% of the accept length
            change = {key(n, c, False): round(mean[key(n, c, True)] / mean[key(n, c, False)] - 1, 4)
                      for n, c, f in cols if not f}
            result["acceptance"]["fp8_relative_change"] = change
            print("FP8 weights + FP8 KV vs " + str(b.dtype).replace("torch.", "") + ", mean accept length: "
                  + ", ".join(f"N={k} {100 * v:+.1f}%" for k, v in change.items()))
    if speed_steps and conc:
        pool = [x for v in sets.values() for x in v]
        prompts = [pool[i * len(pool) // args.speed_prompts] for i in range(min(args.speed_prompts, len(pool)))]
        print(f"\n=== speed: output tokens/s, {len(prompts)} prompts, {mode}, {args.max_new_tokens} new tokens ===")
        for c in conc:
            # Every configuration is built and warmed up first, then the runs are interleaved (plain, N=.., plain,
            # N=.., ...) `--repeats` times and each configuration reports its median: a shared or thermally drifting
            # machine then moves all of them alike, and one-off costs (a first Triton compile) do not land on one.
            plain = SpeedConfig(0)
            ds = args.speculative_draft_sampling
            configs = [plain] + [SpeedConfig(n, draft_sampling=ds) for n in speed_steps]
            if args.compare_draft_sampling:
                other = "sample" if ds == "argmax" else "argmax"
                configs += [SpeedConfig(n, draft_sampling=other) for n in speed_steps]
            if args.compare_spec_step_graph:
                configs += [SpeedConfig(n, one_graph=False) for n in speed_steps]
            if args.compare_draft_quantization:
                configs += [SpeedConfig(n, float_draft=True) for n in speed_steps]
            if args.compare_prefill_graph:
                configs += [SpeedConfig(n, prefill_graph=False) for n in [0] + speed_steps]
            if args.compare_fp8:
                configs += [SpeedConfig(n, fp8=True) for n in [0] + speed_steps]
            # one chain for every speculating row: the runners below share the one draft, whose chain the last
            # runner built would otherwise set for all
            configs = [dataclasses.replace(x, mtp_chain=args.speculative_mtp_chain) if x.n else x for x in configs]
            scheds = {cfg: b.scheduler(cfg, c) for cfg in configs}
            for sched in scheds.values():
                b.run(sched, prompts[:min(2, len(prompts))], 16)  # warm-up
            runs: dict[SpeedConfig, list[Run]] = {cfg: [] for cfg in configs}
            for _ in range(args.repeats):
                for cfg in configs:
                    runs[cfg].append(b.run(scheds[cfg], prompts, args.max_new_tokens))
            for cfg in configs:
                base = statistics.median(r.tok_per_s for r in runs[cfg.baseline])
                base_decode = statistics.median(r.decode_tok_per_s for r in runs[cfg.baseline])
                n = cfg.n
                rates = [r.tok_per_s for r in runs[cfg]]
                decode = statistics.median(r.decode_tok_per_s for r in runs[cfg])
                reqs = runs[cfg][0].reqs
                row = {"concurrency": c, "N": n, "output_tokens": runs[cfg][0].tokens,
                       "repeats": args.repeats, "tok_per_s": round(statistics.median(rates), 2),
                       "tok_per_s_runs": [round(t, 2) for t in rates],
                       "decode_tok_per_s": round(decode, 2),
                       "prefill_share": round(statistics.median(r.prefill / r.wall for r in runs[cfg]), 3),
                       "accept_length": round(accept_length(reqs), 3)}
                row["prefill_graph"] = cfg.prefill_graph
                row["fp8"] = cfg.fp8
                if n and greedy:  # lossless check: greedy speculative text == greedy plain (bf16 ties may flip a few)
                    plain_out = [r.output_ids for r in runs[cfg.baseline][0].reqs]  # the same weights and cache
                    row["same_as_plain"] = min(sum(r.output_ids == o for r, o in zip(run.reqs, plain_out))
                                               for run in runs[cfg])
                row["speedup_vs_plain"] = round(row["tok_per_s"] / base, 3)
                row["decode_speedup_vs_plain"] = round(decode / base_decode, 3)
                if n:
                    row["spec_step_graph"] = cfg.one_graph
                    row["draft_quantization"] = "none" if cfg.float_draft else b.draft_quantization
                    row["spec_plain_steps"] = scheds[cfg].stats.spec_plain_steps  # adaptive: steps taken plain
                    row["draft_sampling"] = cfg.draft_sampling
                    one = scheds[cfg].model_runner.spec.spec_step_graph
                    if one is not None:  # which one-graph steps ran (sampled ones at 0: phase by phase)
                        row["spec_step_replays"] = one.replays_by_kind
                result["speed"].append(row)
                acc = f", accept {row['accept_length']:.2f}" if n else ""
                if "same_as_plain" in row:
                    acc += f", {row['same_as_plain']}/{len(reqs)} outputs = plain"
                if "spec_step_replays" in row:
                    acc += ", one-graph steps " + "/".join(f"{k} {v}" for k, v in row["spec_step_replays"].items())
                spread = f" (runs {min(rates):.0f}..{max(rates):.0f})" if len(rates) > 1 else ""
                print(f"concurrency {c:>3} | {cfg.label:<18} | {row['tok_per_s']:9.1f} tok/s{spread} | "
                      f"x{row['speedup_vs_plain']:.2f} (outside prefill x{row['decode_speedup_vs_plain']:.2f}, "
                      f"prefill {100 * row['prefill_share']:.0f}%){acc}")
            del scheds, runs
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0
