"""A batch-1 prefill step on the GPU, eager against CUDA graphs: the scheduler's prefill step (target extend, and
with MTP N = 4 and context lookup also the draft extend) for prompts of several lengths, and the kernel count and
kernel time of one eager 256-token step.

    python3 scripts/gpu/profile_prefill.py /tmp/smollm2.gguf specserve/assets/smollm2-135m-mtp [--output-file PATH]

Printed: per engine (plain, MTP N=4) the eager 256-token step's kernel count and kernel time, then per prompt length
the median prefill step in ms, eager and graphed, and their ratio (above 1: the graph is faster). Needs a CUDA GPU.
"""

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.tee import tee_stdout_to
from specserve.engine.engine import EngineCore
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.server_args import ServerArgs

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("model_path", help="the target (a GGUF file or a Hugging Face folder)")
parser.add_argument("draft_path", help="the MTP draft head's folder")
parser.add_argument("--output-file", default=None, help="also write what is printed to this file (text)")
args = parser.parse_args()
tee_stdout_to(args.output_file)
model, draft = args.model_path, args.draft_path
lengths = [64, 256, 1024, 2000]


def make_core(spec: bool, max_prefill: int | None) -> EngineCore:
    kw = dict(speculative_algorithm="MTP", speculative_num_steps=4, speculative_draft_model_path=draft,
              speculative_ngram_lookup=True) if spec else {}
    return EngineCore(ServerArgs.from_kwargs(model_path=model, context_length=4096, max_running_requests=1,
                                             max_total_tokens=16384, cuda_graph_max_bs=1,
                                             cuda_graph_max_prefill_tokens=max_prefill, **kw))


def prefill_step(core: EngineCore, ids: list[int], i: int) -> float:
    sched = core.scheduler
    sched.add_request(Req(f"r{i}", ids, SamplingParams(max_new_tokens=4, temperature=0.0), seed=0))
    torch.cuda.synchronize()
    t = time.perf_counter()
    sched.step()  # the prefill (it ends in the step's host sync)
    return time.perf_counter() - t


def finish(core: EngineCore) -> None:
    while core.scheduler.has_work:
        core.scheduler.step()


table: dict[tuple[str, int], dict[str, float]] = {}
for spec in (False, True):
    for max_prefill in (0, None):
        core = make_core(spec, max_prefill)
        g = torch.Generator().manual_seed(0)
        vocab = core.model_config.vocab_size
        name = "MTP N=4" if spec else "plain"
        mode = "eager" if max_prefill == 0 else "graph"
        for n in lengths:
            ids = torch.randint(100, vocab, (n,), generator=g).tolist()
            times = []
            for i in range(8):
                times.append(prefill_step(core, ids, i))
                finish(core)
            table.setdefault((name, n), {})[mode] = statistics.median(times[2:])
        if max_prefill == 0:
            ids = torch.randint(100, vocab, (256,), generator=g).tolist()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                prefill_step(core, ids, 99)
            finish(core)
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            busy = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3
            print(f"{name}: one eager 256-token prefill step: {len(kernels)} kernels, {busy:.2f} ms kernel time")
        del core
        torch.cuda.empty_cache()

print(f"{'':8} {'prompt':>6} {'eager ms':>9} {'graph ms':>9} {'ratio':>6}")
for (name, n), t in table.items():
    print(f"{name:8} {n:6} {1e3 * t['eager']:9.2f} {1e3 * t['graph']:9.2f} {t['eager'] / t['graph']:5.1f}x")
