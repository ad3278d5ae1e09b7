"""`specserve bench`: online serving benchmark against specserve, SGLang, vLLM or any OpenAI-compatible server.

Modelled on sglang.bench_serving (same summary field names). Example:
    specserve bench --backend specserve --dataset-name random --random-input-len 512 --random-output-len 256
        --num-prompts 200 --max-concurrency 1,4,16 --output-file bench.jsonl --plot sweep.png
The prefix cache (groups of prompts sharing a system prompt; the cache emptied before each run):
    specserve bench --dataset-name generated-shared-prefix --gsp-num-groups 8 --gsp-prompts-per-group 16
        --flush-cache --max-concurrency 16
Images (a vision-language model; /generate or /v1/chat/completions):
    specserve bench --dataset-name image --image-count 2 --image-resolution 720p --random-input-len 1000
        --random-output-len 256 --num-prompts 64 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from specserve.bench import plot, target
from specserve.bench.backends import BACKENDS, RequestOutput
from specserve.bench.datasets import BenchRequest, jsonl_requests, random_requests, shared_prefix_requests
from specserve.bench.image_dataset import IMAGE_CONTENTS, IMAGE_FORMATS, ImageSpec, image_requests, parse_resolution
from specserve.bench.metrics import compute_metrics, format_summary
from specserve.bench.runner import RunConfig, fill_missing_output_lens, run_benchmark, run_warmup
from specserve.server_args import CommandParser

MAX_ERRORS_SHOWN = 5


def parse_concurrency(text: str | None) -> list[int | None]:
    """"8" -> [8]; "1,2,4" -> [1, 2, 4] (a sweep); None -> [None] (no cap)."""
    if text is None:
        return [None]
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"--max-concurrency must be an integer or a comma list of integers, got {text!r}") from e
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--max-concurrency values must be >= 1, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="specserve bench", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="specserve",
                   help="specserve/sglang: native /generate; openai: /v1/completions; openai-chat: "
                        "/v1/chat/completions")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--base-url", default=None, help="server URL; overrides --host/--port")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name to send (default: ask /v1/models or /get_model_info)")
    p.add_argument("--tokenizer", default=None,
                   help="HF folder or .gguf file (default: the server's tokenizer/model path when local)")
    p.add_argument("--dataset-name", choices=("random", "generated-shared-prefix", "jsonl", "image"),
                   default="random",
                   help="random: random token ids; generated-shared-prefix: groups of random prompts that share a "
                        "random system prompt (--gsp-*; --num-prompts is ignored); jsonl: --dataset-path; image: "
                        "random text of --random-input-len tokens with generated images (--image-*)")
    p.add_argument("--dataset-path", default=None, help="jsonl with prompt/text/question/instruction or messages")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024,
                   help="output tokens per request (also the default for jsonl records)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len]")
    g = p.add_argument_group("generated-shared-prefix dataset (SGLang's flags and defaults)")
    g.add_argument("--gsp-num-groups", type=int, default=64, help="groups, one system prompt each")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="prompts per group")
    g.add_argument("--gsp-system-prompt-len", type=int, default=2048, help="tokens of each group's system prompt")
    g.add_argument("--gsp-question-len", type=int, default=128, help="tokens of each prompt's own question")
    g.add_argument("--gsp-output-len", type=int, default=256, help="output tokens per request")
    g = p.add_argument_group("image dataset (SGLang's flags and defaults)")
    g.add_argument("--image-count", type=int, default=1, help="images per request")
    g.add_argument("--image-resolution", default="1080p",
                   help="4k, 1080p, 720p, 360p or HEIGHTxWIDTH (e.g. 1080x1920)")
    g.add_argument("--image-format", choices=IMAGE_FORMATS, default="jpeg")
    g.add_argument("--image-content", choices=IMAGE_CONTENTS, default="random", help="random noise or blank white")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", default=None, help="int, or a comma list for a sweep (e.g. 1,4,16)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals; inf sends all at once")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--flush-cache", action="store_true",
                   help="empty the server's prefix cache (POST /flush_cache) before each run, after the warm-up")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the requested lengths (default: on for the generated datasets, off for "
                        "jsonl)")
    p.add_argument("--extra-request-body", default=None,
                   help="JSON merged into every request (sampling keys go into sampling_params for /generate)")
    p.add_argument("--output-file", default=None, help="append one JSON line per run")
    p.add_argument("--plot", default=None, help="PNG of output throughput and median TPOT vs concurrency")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def _check_args(args: argparse.Namespace) -> tuple[list[int | None], dict]:
    concurrencies = parse_concurrency(args.max_concurrency)
    if args.dataset_name == "jsonl" and not args.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    if args.dataset_name == "image" and BACKENDS[args.backend].kind == "completions":
        raise ValueError("--dataset-name image needs a backend that sends images: specserve, sglang (/generate "
                         "image_data) or openai-chat (image_url parts)")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    try:
        extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-request-body is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError("--extra-request-body must be a JSON object")
    if args.plot:
        plot.check_available()
    return concurrencies, extra


def _image_tokens(model_dir: str | None, width: int, height: int) -> int | None:
    """The placeholder tokens one width x height image expands to, from the checkpoint's image processor when its
    config is here; None otherwise (the server's counts are used)."""
    from specserve.multimodal.image_processing import QwenImageProcessor

    if model_dir is None:
        return None
    try:
        return QwenImageProcessor.from_model_dir(model_dir).num_tokens_for(width, height)
    except (OSError, ValueError):
        return None


def _load_requests(args: argparse.Namespace, tokenizer, model_dir: str | None = None) -> list[BenchRequest]:
    if args.dataset_name == "image":
        width, height = parse_resolution(args.image_resolution)
        spec = ImageSpec(args.image_count, width, height, args.image_format, args.image_content)
        return image_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, spec, args.seed, _image_tokens(model_dir, width, height))
    if args.dataset_name == "random":
        return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, args.seed)
    if args.dataset_name == "generated-shared-prefix":
        return shared_prefix_requests(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                                      args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                      args.seed)
    return jsonl_requests(args.dataset_path, tokenizer, args.num_prompts, args.random_output_len)


def _print_errors(outputs: list[RequestOutput], what: str) -> list[str]:
    errors = [o.error for o in outputs if not o.success]
    if errors:
        print(f"{len(errors)} {what} failed; first errors:", file=sys.stderr)
        for e in errors[:MAX_ERRORS_SHOWN]:
            print(f"  {e}", file=sys.stderr)
    return errors[:MAX_ERRORS_SHOWN]


def _json_safe(v):
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        concurrencies, extra = _check_args(args)
    except ValueError as e:
        parser.error(str(e))
    base = target.base_url(args.host, args.port, args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    backend = BACKENDS[args.backend]
    model, model_info = target.discover_model(base, headers)
    model = args.model or model
    if model is None and backend.kind != "native":
        print(f"specserve bench: could not ask {base} for its model name (is the server up?); pass --model",
              file=sys.stderr)
        return 2
    try:
        tokenizer = target.resolve_tokenizer(args.tokenizer, model_info)
        requests = _load_requests(args, tokenizer, target.local_model_dir(args.tokenizer, model_info))
    except (ValueError, OSError) as e:
        print(f"specserve bench: {e}", file=sys.stderr)
        return 2
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name != "jsonl"
    images = sum(len(r.image_data or ()) for r in requests)
    print(f"#Prompts: {len(requests)}  #Input tokens: {sum(r.prompt_len for r in requests)}  "
          f"#Output tokens (max): {sum(r.output_len for r in requests)}" + (f"  #Images: {images}" if images else "")
          + f"  model: {model}  url: {base}")
    cfg = RunConfig(backend=backend, url=base + backend.path, model=model, ignore_eos=ignore_eos, extra_body=extra,
                    headers=headers, request_rate=args.request_rate, seed=args.seed, disable_tqdm=args.disable_tqdm)

    warm = run_warmup(cfg, requests[0], args.warmup_requests)
    if warm and not any(o.success for o in warm):
        _print_errors(warm, "warm-up requests")
        print("specserve bench: every warm-up request failed; check --backend, the URL and --model", file=sys.stderr)
        return 1

    results = []
    for conc in concurrencies:
        cfg.max_concurrency = conc
        if args.flush_cache:
            err = target.flush_cache(base, headers)
            if err is not None:
                print(f"specserve bench: /flush_cache failed ({err}); the run starts with the cache as it is",
                      file=sys.stderr)
        before = target.SpecCounters.read(base, headers)
        outputs, duration = run_benchmark(cfg, requests)
        retokenized = fill_missing_output_lens(outputs, tokenizer)
        result = {"backend": args.backend, "dataset_name": args.dataset_name, "model": model,
                  "request_rate": args.request_rate, "max_concurrency": conc, "num_prompts": len(requests),
                  "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                  "random_range_ratio": args.random_range_ratio}
        if args.dataset_name == "image":
            result.update(image_count=args.image_count, image_resolution=args.image_resolution,
                          image_format=args.image_format, image_content=args.image_content)
        result.update(compute_metrics(outputs, duration))
        result["server_accept_length"], result["server_accept_length_scope"] = target.run_accept_length(
            before, target.SpecCounters.read(base, headers))
        result["output_tokens_retokenized"] = retokenized
        print(format_summary(result))
        if result["total_cached_tokens"] is None and args.dataset_name == "generated-shared-prefix":
            print("note: the server reported no cached prompt tokens (meta_info.cached_tokens / "
                  "usage.prompt_tokens_details)", file=sys.stderr)
        if retokenized:
            print(f"note: {retokenized} responses reported no completion token count; their text was re-tokenized",
                  file=sys.stderr)
        result["errors"] = _print_errors(outputs, "requests")
        result["timestamp"] = time.time()
        result["args"] = {k: _json_safe(v) for k, v in vars(args).items()}
        results.append(result)
        if args.output_file:
            with open(args.output_file, "a") as f:
                f.write(json.dumps({k: _json_safe(v) for k, v in result.items()}, allow_nan=False) + "\n")
    if args.plot:
        plot.plot_sweep(results, args.plot, title=f"{args.backend} {model or ''}")
        print(f"plot written to {args.plot}")
    return 0 if any(r["completed"] for r in results) else 1
