"""`specserve` command line: generate, serve, bench, eval, train-mtp, token-map, bench-phases."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="[%(asctime)s %(levelname)s] %(message)s",
                        datefmt="%H:%M:%S")


def cmd_generate(argv: list[str]) -> int:
    from specserve.server_args import CommandParser, ServerArgs

    p = CommandParser(prog="specserve generate", description="Generate text offline with the engine.")
    ServerArgs.add_cli_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap each prompt in the model's chat template (default: on for the embedded chat model, "
                        "off for a --model-path)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the full results as JSON")
    args = p.parse_args(argv)
    _setup_logging(args.log_level)
    from specserve.engine.sampling_params import SamplingParams

    sp = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
          "top_k": args.top_k, "seed": args.seed}
    try:
        sa = ServerArgs.from_cli_args(args)
        SamplingParams.from_dict(sp)  # bad sampling values fail here, before the model loads
    except ValueError as e:
        p.error(str(e))
    from specserve.engine.engine import Engine

    try:
        eng = Engine(**{k: v for k, v in vars(sa).items() if k != "extra"})
    except ValueError as e:  # what only the checkpoint can say (a missing MTP layer, a token map that does not fit)
        p.error(str(e))
    prompts = args.prompt
    # The embedded model is a chat model: a bare question without its template gets an empty answer.
    chat = args.chat if args.chat is not None else sa.model_path is None
    if chat:
        prompts = [eng.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
    outs = eng.generate(prompts, sp)
    for q, o in zip(args.prompt, outs):
        if args.json:
            print(json.dumps({"prompt": q, **o}))
        else:
            m = o["meta_info"]
            extra = f", accept length {m['spec_accept_length']:.2f}" if "spec_accept_length" in m else ""
            print(f"### {q}\n{o['text']}\n[{m['completion_tokens']} tokens, {m['finish_reason']['type']}{extra}]")
    eng.shutdown()
    return 0


COMMANDS = {
    "generate": ("specserve.cli", "cmd_generate"),
    "serve": ("specserve.server.launch", "main"),
    "bench": ("specserve.bench.serving", "main"),
    "bench-compare": ("specserve.bench.compare", "main"),
    "eval": ("specserve.bench.eval_cli", "main"),
    "train-mtp": ("specserve.train.cli", "main"),
    "token-map": ("specserve.train.token_map_cli", "main"),
    "bench-phases": ("specserve.bench.phases", "main"),
    "bench-floors": ("specserve.bench.floors", "main"),
    "bench-spec": ("specserve.bench.spec_speed", "main"),
    "soak": ("specserve.bench.soak", "main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: specserve {" + ",".join(COMMANDS) + "} [args]\n\n"
              "  generate      offline generation with the engine\n"
              "  serve         OpenAI-compatible HTTP server (SGLang-style flags)\n"
              "  bench         serving benchmark client\n"
              "  bench-compare speculation vs plain through two servers, input lengths x concurrency\n"
              "  eval          accuracy evals (gsm8k)\n"
              "  train-mtp     train an MTP draft head by self-distillation\n"
              "  token-map     write a --speculative-token-map file (the draft's hot tokens) from text\n"
              "  bench-phases  per-phase GPU timings, eager vs CUDA graph\n"
              "  bench-floors  each phase's bandwidth floor (bytes it must move) for a preset, no GPU needed\n"
              "  bench-spec    a draft head end to end: acceptance per N, tokens/s spec vs plain\n"
              "  soak          mixed valid/aborted/bad requests against a server; checks answers and KV leaks")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"specserve: unknown command {cmd!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    mod, fn = COMMANDS[cmd]
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name == mod:
            print(f"specserve: {cmd!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    rc = getattr(module, fn)(rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
