"""Decoding after an image (issue 47): the speculative iteration and the plain step on image requests against text
requests of the same length, at batch 1 and 8, with CUDA graphs and eagerly, side by side in one process.

    python3 scripts/gpu/bench_vision_decode.py [--preset qwen3-next-80b-a3b] [--layers 12] [--text 1024] \\
        [--resolution 1280x720] [--batch-sizes 1,8] [--steps 40] [--images 1] [--output-file F]

The model: the preset's per-layer shapes (--layers of them) read as a Qwen3.5 vision-language checkpoint
(architecture Qwen3_5MoeForConditionalGeneration: interleaved mRoPE, so every decode, verify and draft graph carries
three position rows) with a random MTP layer and the Qwen3.5 vision tower (transformers' Qwen3_5VisionConfig
defaults), all random bf16. An image request holds --images pictures of --resolution (the checkpoint processor's
real preprocessing) and --text random text tokens; its text twin holds random ids of the same total length, so both
decode over the same KV length; the image request decodes at its mRoPE offset (position = index + delta, delta < 0).

Each engine (MTP with 3 drafts, graphs or eager; plain decoding with graphs) runs `bs` requests to their first
tokens and a few warm-up steps, then --steps decode steps timed wall-clock with the device synchronised each step:
ms per step and tokens per step per request (random weights: the draft is rarely accepted, so the ratio of iteration
costs is the figure here, not the speed-up real weights give).
"""

from __future__ import annotations

import argparse
import json
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
from specserve.multimodal.request_images import image_from_pil, prepare_request_images
from specserve.server_args import ServerArgs

PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
                "image_processor_type": "Qwen2VLImageProcessor"}
VL_ARCH = "Qwen3_5MoeForConditionalGeneration"
IMAGE_TOKEN = 151655  # Qwen's <|image_pad|> id (inside every preset's vocabulary)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_requests(kind: str, bs: int, args, proc: QwenImageProcessor, vocab: int, max_new: int, seed: int
                  ) -> list[Req]:
    rng = np.random.default_rng(seed)
    w, h = (int(x) for x in args.resolution.split("x"))
    reqs = []
    for i in range(bs):
        text = rng.integers(10, 30000, size=args.text).tolist()
        pics = [image_from_pil(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), f"image {k}")
                for k in range(args.images)]
        ids, images, delta = prepare_request_images([IMAGE_TOKEN] * args.images + text, pics, proc, IMAGE_TOKEN,
                                                    vocab)
        sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
        if kind == "image":
            reqs.append(Req(f"{kind}{seed}-{i}", ids, sp, seed=i, mrope_delta=delta, images=images))
        else:  # the same length of text: the same KV length, positions without an offset
            reqs.append(Req(f"{kind}{seed}-{i}", rng.integers(10, 30000, size=len(ids)).tolist(), sp, seed=i))
    return reqs


def decode_rate(sched: Scheduler, reqs: list[Req], steps: int, warm: int = 4) -> tuple[float, float]:
    """(ms per decode step, tokens per step per request) over `steps` steps once every request decodes."""
    for r in reqs:
        sched.add_request(r)
    while not all(r.output_ids for r in reqs):
        sched.step()
    for _ in range(warm):
        sched.step()
    before = sum(len(r.output_ids) for r in reqs)
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sync()
    ms = (time.perf_counter() - t) * 1e3 / steps
    made = sum(len(r.output_ids) for r in reqs) - before
    for r in reqs:
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()
    sched.flush_cache()
    return ms, made / (steps * len(reqs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-next-80b-a3b")
    p.add_argument("--layers", type=int, default=12, help="only the first L layers of the preset (0: all)")
    p.add_argument("--text", type=int, default=1024, help="text tokens of each request besides its images")
    p.add_argument("--resolution", default="1280x720")
    p.add_argument("--images", type=int, default=1, help="images per request")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--output-file", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny settings), no figures")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    proc = QwenImageProcessor(PREPROCESSOR)
    w, h = (int(x) for x in a.resolution.split("x"))
    per_image = proc.num_tokens_for(w, h)
    batch_sizes = [int(b) for b in a.batch_sizes.split(",")]
    steps = a.steps
    ctx = a.text + a.images * per_image + 4 * (steps + 16) + 64
    target, draft, cfg = random_models(a.preset, torch.bfloat16, dev, ctx + 16, layers=a.layers,
                                       architecture=VL_ARCH)
    assert cfg.mrope_section is not None, "the VL architecture should give interleaved mRoPE"
    from transformers import Qwen3_5VisionConfig as HFVision

    vision = {**HFVision().to_dict(), "out_hidden_size": cfg.hidden_size}
    target.visual = Qwen3_5VisionEncoder(Qwen3_5VisionConfig.from_hf({"vision_config": vision})).to(dev,
                                                                                                  torch.bfloat16)
    target.image_token_id = IMAGE_TOKEN
    max_bs = max(batch_sizes)
    engines = {"MTP graphs": dict(speculative_algorithm="MTP"),
               "MTP eager": dict(speculative_algorithm="MTP", disable_cuda_graph=True),
               "plain graphs": dict()}
    rows = []
    for name, extra in engines.items():
        spec = "speculative_algorithm" in extra
        args = ServerArgs(context_length=ctx, max_total_tokens=(max_bs + 1) * ctx, max_running_requests=max_bs,
                          cuda_graph_max_bs=max_bs, disable_radix_cache=True, disable_overlap_schedule=True,
                          **({"speculative_num_steps": 3, "speculative_adaptive": False} if spec else {}), **extra)
        mr = ModelRunner(args, target, cfg, draft if spec else None, dev, torch.bfloat16, ctx)
        mr.capture_graphs()
        sched = Scheduler(mr, StopChecker(None, set()), args.chunked_prefill_size)
        for bs in batch_sizes:
            for kind in ("text", "image"):
                reqs = make_requests(kind, bs, a, proc, cfg.vocab_size, 4 * (steps + 16), seed=bs)
                ms, per_req = decode_rate(sched, reqs, steps)
                row = {"engine": name, "bs": bs, "kind": kind, "ms_per_step": ms, "tokens_per_step": per_req,
                       "delta": reqs[0].mrope_delta, "prompt_len": len(reqs[0].origin_input_ids),
                       "preset": a.preset, "layers": cfg.num_layers, "resolution": a.resolution,
                       "images": a.images}
                rows.append(row)
                print(f"{name:13s} bs={bs:2d} {kind:5s}: {ms:7.3f} ms/step, {per_req:.2f} tokens/step/request "
                      f"(prompt {row['prompt_len']}, mrope delta {row['delta']})", flush=True)
        del sched, mr
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    by = {(r["engine"], r["bs"], r["kind"]): r["ms_per_step"] for r in rows}
    for bs in batch_sizes:
        for kind in ("text", "image"):
            g, e, pl = by[("MTP graphs", bs, kind)], by[("MTP eager", bs, kind)], by[("plain graphs", bs, kind)]
            print(f"bs={bs} {kind}: MTP iteration / plain step {g / pl:.2f}x; eager / graphs {e / g:.2f}x")
        ratio = by[("MTP graphs", bs, "image")] / by[("MTP graphs", bs, "text")]
        print(f"bs={bs}: MTP iteration image / text {ratio:.3f}x")
    if a.output_file:
        with open(a.output_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
