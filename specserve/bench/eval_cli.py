"""`specserve eval {gsm8k}`: accuracy evals against a running OpenAI-compatible server.

Example:
    specserve eval gsm8k --data gsm8k/test.jsonl --num-examples 200 --num-threads 64 --api completion
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from specserve.bench import gsm8k, target
from specserve.server_args import CommandParser

MAX_ERRORS_SHOWN = 5


def _add_gsm8k(sub) -> None:
    p = sub.add_parser("gsm8k", help="grade-school math word problems (answer accuracy)",
                       description="GSM8K accuracy through /v1/completions (few-shot) or /v1/chat/completions.")
    p.add_argument("--data", required=True, help="GSM8K jsonl (question, answer with '#### N')")
    p.add_argument("--shots-data", default=None,
                   help="jsonl to take the few-shot examples from (default: the first K examples of --data, "
                        "which are then left out of the evaluation)")
    p.add_argument("--num-examples", type=int, default=None, help="default: all")
    p.add_argument("--num-threads", type=int, default=64, help="requests in flight")
    p.add_argument("--api", choices=("chat", "completion"), default="completion")
    p.add_argument("--num-shots", type=int, default=None, help="default: 5 for completion, 0 for chat")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat-template-kwargs", default=None, help='JSON, e.g. {"enable_thinking": false}')
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--base-url", default=None, help="server URL; overrides --host/--port")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None, help="model name to send (default: ask /v1/models)")
    p.add_argument("--output-file", default=None, help="append one JSON line with the results and the arguments")
    p.add_argument("--disable-tqdm", action="store_true")


def _split_shots(args, examples: list[gsm8k.Example]) -> tuple[list[gsm8k.Example], list[gsm8k.Example]]:
    k = args.num_shots if args.num_shots is not None else (5 if args.api == "completion" else 0)
    if k < 0:
        raise ValueError("--num-shots must be >= 0")
    if args.shots_data:
        shots = gsm8k.load_gsm8k(args.shots_data)[:k]
    else:
        shots, examples = examples[:k], examples[k:]  # a shot is never also a question
    if len(shots) < k:
        raise ValueError(f"asked for {k} shots but only {len(shots)} examples are available for them")
    if args.num_examples is not None:
        examples = examples[: args.num_examples]
    if not examples:
        raise ValueError("no examples left to evaluate")
    return shots, examples


def run_gsm8k_cli(args, parser: argparse.ArgumentParser) -> int:
    if args.num_threads < 1 or args.max_tokens < 1 or (args.num_examples is not None and args.num_examples < 1):
        parser.error("--num-threads, --max-tokens and --num-examples must be >= 1")
    try:
        kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object")
        shots, examples = _split_shots(args, gsm8k.load_gsm8k(args.data))
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        print(f"specserve eval gsm8k: {e}", file=sys.stderr)
        return 2
    base = target.base_url(args.host, args.port, args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or target.discover_model(base, headers)[0]
    if model is None:
        print(f"specserve eval gsm8k: could not ask {base} for its model name (is the server up?); pass --model",
              file=sys.stderr)
        return 2
    cfg = gsm8k.EvalConfig(base_url=base, api=args.api, model=model, max_tokens=args.max_tokens,
                           temperature=args.temperature, num_threads=args.num_threads, chat_template_kwargs=kwargs,
                           headers=headers, disable_tqdm=args.disable_tqdm)
    before = target.SpecCounters.read(base, headers)
    summary, results = gsm8k.run_gsm8k(cfg, shots, examples)
    summary["server_accept_length"], scope = target.run_accept_length(before, target.SpecCounters.read(base, headers))
    summary["server_accept_length_scope"] = scope
    errors = [r.error for r in results if r.error]
    for e in errors[:MAX_ERRORS_SHOWN]:
        print(f"  request failed: {e}", file=sys.stderr)
    print(f"Accuracy: {summary['accuracy']:.3f}  ({summary['correct']}/{summary['num_examples']})")
    print(f"Invalid: {summary['invalid']:.3f}")
    print(f"Failed requests: {summary['failed']}")
    print(f"Latency: {summary['latency']:.3f} s")
    print(f"Output throughput: {summary['output_throughput']:.3f} token/s")
    server_label = ("Accept length (server, this run)" if scope == "run"
                    else "Accept length (server, since it started)")
    for key, label in (("accept_length", "Accept length"), ("server_accept_length", server_label)):
        if summary[key] is not None:
            print(f"{label}: {summary[key]:.3f}")
    if args.output_file:
        line = {"task": "gsm8k", "api": args.api, "model": model, "num_shots": len(shots), **summary,
                "errors": errors[:MAX_ERRORS_SHOWN], "timestamp": time.time(), "args": vars(args)}
        with open(args.output_file, "a") as f:
            f.write(json.dumps(line) + "\n")
    return 0 if summary["failed"] < summary["num_examples"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="specserve eval", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)
    _add_gsm8k(sub)
    args = parser.parse_args(argv)
    if args.task == "gsm8k":
        return run_gsm8k_cli(args, sub.choices["gsm8k"])
    parser.error(f"unknown eval {args.task!r}")
    return 2
