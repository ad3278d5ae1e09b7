"""An image request's first token, split into its parts, side by side in one process (issue 47): the Qwen3.5 vision
encoder over one image against the language model's prefill of the image's tokens plus --text tokens of text.

    python3 scripts/gpu/bench_vision.py [--preset qwen3-next-80b-a3b] [--layers 12] [--text 4096] \\
        [--resolutions 1280x720,1920x1080] [--repeats 5] [--output-file F]

The encoder: transformers' Qwen3_5VisionConfig defaults (depth 27, hidden 1152, 16 heads, patch 16, merge 2, as
the released Qwen3.5 vision-language checkpoints), its output width the preset's hidden size, random bf16 weights;
its input the checkpoint processor's real pixel_values for a random picture of each resolution (preprocessing is
timed apart, on the CPU). The prefill: the preset's language model with random bf16 weights (bench/phase_setup.py,
--layers of them) and a random MTP layer, the engine's scheduler with the server's defaults; one prompt of
text + image-token count random ids, timed from add_request to its first token (device synchronised), with prefill
graphs as text requests run and eagerly as image requests run (image batches are refused by the prefill graphs).
Medians of --repeats after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image

from specserve.bench.phase_setup import random_models
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker
from specserve.models.qwen3_5_vision import Qwen3_5VisionConfig, Qwen3_5VisionEncoder
from specserve.multimodal.image_processing import QwenImageProcessor
from specserve.server_args import ServerArgs

# Qwen3.5's preprocessor_config.json (patch 16, merge 2, mean = std = 0.5, 64k..16M pixels)
PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "image_processor_type": "Qwen2VLImageProcessor"}


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median ms of fn() over `repeats` runs after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def ttft_ms(sched: Scheduler, tokens: int, seed: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(seed)
    req = Req(f"v{seed}", torch.randint(10, min(30000, vocab), (tokens,), generator=g).tolist(),
              SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True), seed=seed)
    sync()
    t = time.perf_counter()
    sched.add_request(req)
    while not req.output_ids:
        sched.step()
    sync()
    ms = (time.perf_counter() - t) * 1e3
    while sched.has_work:
        sched.step()
    sched.flush_cache()
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=12, help="only the first L layers of the preset (0: all)")
    p.add_argument("--text", type=int, default=4096, help="text tokens next to the image")
    p.add_argument("--resolutions", default="1280x720,1920x1080")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-file", default=None, help="append one JSON line per resolution")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    proc = QwenImageProcessor(PREPROCESSOR)
    sizes = [tuple(int(x) for x in r.split("x")) for r in a.resolutions.split(",")]
    rng = np.random.default_rng(0)
    images = {}
    for w, h in sizes:
        pic = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        t = time.perf_counter()
        out = proc([pic])
        images[(w, h)] = (out, (time.perf_counter() - t) * 1e3)
    longest = max(sum(o.num_tokens) for o, _ in images.values())
    ctx = a.text + longest + 64
    target, draft, cfg = random_models(a.preset, torch.bfloat16, dev, ctx + 16, layers=a.layers)
    from transformers import Qwen3_5VisionConfig as HFVision

    vision = {**HFVision().to_dict(), "out_hidden_size": cfg.hidden_size}
    encoder = Qwen3_5VisionEncoder(Qwen3_5VisionConfig.from_hf({"vision_config": vision})).to(dev, torch.bfloat16)
    scheds = {}
    for graphs in (True, False):
        args = ServerArgs(speculative_algorithm="MTP", speculative_num_steps=3, context_length=ctx,
                          max_total_tokens=2 * ctx, max_running_requests=1, cuda_graph_max_bs=1,
                          disable_radix_cache=True, speculative_adaptive=False,
                          cuda_graph_max_prefill_tokens=None if graphs else 0)
        mr = ModelRunner(args, target, cfg, draft, dev, torch.bfloat16, ctx)
        mr.capture_graphs()
        scheds[graphs] = Scheduler(mr, StopChecker(None, set()), args.chunked_prefill_size)
    for (w, h), (out, prep_ms) in images.items():
        pixels, grid = out.pixel_values.to(dev, torch.bfloat16), out.image_grid_thw.to(dev)
        n_img = sum(out.num_tokens)
        with torch.inference_mode():
            enc_ms = timed(lambda x=pixels, g=grid: encoder(x, g), a.repeats)
        tokens = a.text + n_img
        pre = {}
        for g in (True, False):
            runs = [ttft_ms(scheds[g], tokens, 100 * i + int(g), cfg.vocab_size) for i in range(a.repeats + 1)]
            pre[g] = statistics.median(runs[1:])  # (the first warms up)
        row = {"preset": a.preset, "layers": cfg.num_layers, "resolution": f"{w}x{h}",
               "patches": int(pixels.shape[0]), "image_tokens": n_img, "text_tokens": a.text,
               "preprocess_ms": prep_ms, "encoder_ms": enc_ms, "prefill_graphs_ms": pre[True],
               "prefill_eager_ms": pre[False]}
        share = enc_ms / (enc_ms + pre[False])
        print(f"{w}x{h}: {pixels.shape[0]} patches, {n_img} image tokens + {a.text} text: preprocess "
              f"{prep_ms:.1f} ms (CPU), encoder {enc_ms:.2f} ms, prefill {pre[True]:.2f} ms with graphs / "
              f"{pre[False]:.2f} ms eager (encoder = {share:.0%} of an image request's GPU time to first token)",
              flush=True)
        if a.output_file:
            with open(a.output_file, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
