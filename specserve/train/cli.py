"""`specserve train-mtp`: self-distil a target, train a chained MTP draft head on its hidden states, write the draft
checkpoint folder (config.json + model.safetensors) and report.json, and measure held-out acceptance.

    specserve train-mtp --prompts a.json b.jsonl --held-out c.jsonl --output out/ [--model-path M] ...

The generated data is cached in <output>/selfdistill/ (keyed by everything that shaped it), so a rerun with other
training settings skips generation.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import time

import torch

from specserve.server_args import CommandParser
from specserve.train.objective import LOSSES

logger = logging.getLogger(__name__)

_MIN_RESPONSE_ROOM = 32  # a training prompt must leave at least this many tokens of --max-seq-len for the response


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="specserve train-mtp", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model-path", "--model", dest="model_path", default=None,
      help="target HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    a("--prompts", nargs="+", required=True, help="training prompt files (JSON list or JSONL)")
    a("--held-out", nargs="*", default=[], help="held-out prompt files for the acceptance measurement")
    a("--output", required=True, help="output folder: the draft checkpoint, report.json and the data cache")
    # self-distillation
    a("--num-prompts", type=int, default=0, help="training prompts to use, drawn at random (0: all)")
    a("--max-new-tokens", type=int, default=256)
    a("--sampled-fraction", type=float, default=0.5, help="share of prompts answered by sampling (rest greedy)")
    a("--temperature", type=float, default=0.7, help="temperature of the sampled responses")
    a("--extra-sampled-responses", type=int, default=0,
      help="further sampled responses per prompt, generated after every prompt has its first one")
    a("--reading-prompts", type=int, default=0,
      help="add this many reading prompts: an instruction (summarise, list the points, ...) over a document "
           "joined from the long texts in the prompt files' answer fields (teaches drafting from a long context)")
    a("--reading-chars", default="1200,6000", help="min,max characters of a reading prompt's document")
    a("--generation-time-budget", type=float, default=None,
      help="seconds: generation stops here; finished and long enough partial responses are kept")
    a("--generate-only", action="store_true",
      help="stop after self-distillation (the data cache is written; a later run with the same generation "
           "settings trains from it, also on another machine when <output>/selfdistill is copied there)")
    # training
    a("--chain-steps", type=int, default=4, help="training depth: draft steps chained through the head's hidden")
    a("--train-steps", type=int, default=1000)
    a("--train-time-budget", type=float, default=None,
      help="seconds: after 10 timed steps, fewer steps are run (with the schedule fitted to them) when the "
           "requested ones would take longer")
    a("--batch-size", type=int, default=16, help="sequences per training step (when --batch-tokens is 0)")
    a("--batch-tokens", type=int, default=0,
      help="padded tokens per training step instead of a fixed sequence count (length-grouped batches)")
    a("--lr", type=float, default=3e-4)
    a("--warmup-steps", type=int, default=None, help="default: 5%% of the steps, at most 200")
    a("--weight-decay", type=float, default=0.0)
    a("--grad-clip", type=float, default=1.0)
    a("--depth-decay", type=float, default=0.8, help="loss weight of depth k is depth_decay^(k-1)")
    a("--loss", choices=LOSSES, default="kl", help="kl: to the target's distribution; ce: to the next token")
    a("--max-seq-len", type=int, default=1024, help="sequences (prompt + response) are cut to this many tokens")
    a("--val-fraction", type=float, default=0.02,
      help="share of generated sequences held back to report validation loss / top-1 per depth")
    a("--draft-vocab-size", type=int, default=0, help="reduced draft vocabulary size (0: the target's)")
    a("--train-draft-head", action="store_true",
      help="with a reduced vocabulary, train (and ship) the head's lm-head rows; by default they stay the "
           "target's rows, which the checkpoint then does not store (only the token ids)")
    a("--greedy-only", action="store_true",
      help="train on the greedy responses only (the sampled ones stay in the cache): a head for greedy serving")
    a("--init-draft", default=None,
      help="start from this draft checkpoint folder (a head trained before on the same target) instead of the "
           "target's last block: continues a training run, with that head's draft vocabulary (which overrides "
           "--draft-vocab-size); a head without aux layers may start one with --aux-hidden-layers")
    a("--init-noise", type=float, default=0.01, help="std of the embedding half of eh_proj at initialisation")
    a("--init-residual-scale", type=float, default=0.0,
      help="scale of the copied last block's o_proj/down_proj at initialisation (0: the block starts as identity)")
    a("--hidden-batch-tokens", type=int, default=16384, help="padded tokens per target forward for hidden states")
    a("--aux-hidden-layers", default="auto",
      help="EAGLE-3 style features: target layers whose outputs the head reads beside the final hidden state "
           "(first draft step of a chain): 'auto' (low/mid/high = 1, L/2-1, L-4), comma-separated layer indices, "
           "or 'none' (on SmolLM2, auto took the held-out accept length at N = 4 from 1.95 to 2.30)")
    a("--live-target-states", action="store_true",
      help="run the target per training batch instead of storing its states for all sequences (the default when "
           "they would not fit on the GPU)")
    a("--save-dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    a("--log-every", type=int, default=20)
    # evaluation
    a("--eval-num-steps", default="1,2,3,4,5", help="comma-separated N (draft steps) to measure")
    a("--eval-prompts-per-file", type=int, default=20)
    a("--eval-max-new-tokens", type=int, default=256)
    # device and engine
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="target dtype")
    a("--seed", type=int, default=0)
    a("--max-running-requests", type=int, default=None)
    a("--cuda-graph-max-bs", type=int, default=None)
    a("--context-length", type=int, default=None)
    a("--disable-cuda-graph", action="store_true")
    a("--max-total-tokens", type=int, default=None)
    a("--chunked-prefill-size", type=int, default=None, help="prefill tokens per step while generating")
    a("--mem-fraction-static", type=float, default=None)
    a("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    kw = {"device": args.device, "dtype": args.dtype, "random_seed": args.seed,
          "disable_cuda_graph": args.disable_cuda_graph, "log_level": args.log_level}
    for name in ("max_running_requests", "cuda_graph_max_bs", "context_length", "max_total_tokens",
                 "mem_fraction_static", "chunked_prefill_size"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    return kw


def _release_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def self_distill(args: argparse.Namespace, model_path: str) -> tuple[list, dict]:
    """Generated samples (from the cache when it matches) and the report's data section."""
    from specserve.train import data
    from specserve.train.reading import reading_prompts

    gs = data.GenerationSettings(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                                 sampled_fraction=args.sampled_fraction, temperature=args.temperature,
                                 seed=args.seed, max_prompt_len=args.max_seq_len - _MIN_RESPONSE_ROOM,
                                 extra_sampled=args.extra_sampled_responses,
                                 time_budget_s=args.generation_time_budget)
    files = [os.path.abspath(f) for f in args.prompts]
    chars = [int(x) for x in args.reading_chars.split(",")]
    if len(chars) != 2:
        raise SystemExit("--reading-chars takes min,max")
    # base names and sizes (not absolute paths): a cache carried to another machine still matches
    fields = {"model": [os.path.basename(model_path), os.path.getsize(model_path) if os.path.isfile(model_path)
                        else 0],
              "files": [[os.path.basename(f), os.path.getsize(f)] for f in files],
              "reading": [args.reading_prompts, *chars], **vars(gs)}
    key = data.cache_key(fields)
    cache_dir = os.path.join(args.output, "selfdistill")
    t0 = time.perf_counter()
    samples = data.load_cached(cache_dir, key)
    from_cache = samples is not None
    if samples is None:
        from specserve.engine.engine import Engine

        prompts = data.load_prompts(files) + reading_prompts(files, args.reading_prompts, args.seed, *chars)
        prompts = data.select_prompts(prompts, args.num_prompts, args.seed)
        # the resolved path, never None: the embedded default target would otherwise speculate with a shipped head
        eng = Engine(model_path=model_path, **engine_kwargs(args))
        try:
            samples = data.generate_samples(eng, prompts, gs)
        finally:
            eng.shutdown()
            del eng
            _release_cuda()
        if not samples:
            raise ValueError("no training sequences: every prompt was too long for --max-seq-len, or the "
                             "generation time budget ended before any response was long enough")
        data.save_cache(cache_dir, key, fields, samples)
    else:
        logger.info("reusing %d cached self-distilled sequences from %s", len(samples), cache_dir)
    info = {
        "num_sequences": len(samples),
        "num_tokens": sum(min(len(s.ids), args.max_seq_len) for s in samples),
        "num_response_tokens": sum(len(s.response_ids) for s in samples),
        "sampled_sequences": sum(s.sampled for s in samples),
        "reading_sequences": sum(s.source == "reading" for s in samples),
        "prompt_files": [os.path.basename(f) for f in files],
        "from_cache": from_cache,
        "generation_time_s": round(time.perf_counter() - t0, 2),
    }
    return samples, info


def _subset(idx: list[int], seqs: list[list[int]], prompt_lens: list[int], store):
    return [seqs[i] for i in idx], [prompt_lens[i] for i in idx], store.subset(idx)


def split_validation(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded split of n sequences into (train, validation); validation is empty when fraction is 0 or n < 2."""
    if fraction <= 0 or n < 2:
        return list(range(n)), []
    k = min(max(round(n * fraction), 1), n - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[k:]), sorted(order[:k])


def target_states(args: argparse.Namespace, model_path: str, samples: list, device: torch.device):
    """Load the target with our model code and collect its hidden states and greedy tokens for every sequence.
    Returns (loaded target, sequences cut to --max-seq-len, their prompt lengths, HiddenStore, seconds)."""
    from specserve.models.loader import ModelSource, load_hf_config, load_target, resolve_dtype
    from specserve.train.hidden import LiveTargetStates, collect_hidden

    src = ModelSource.resolve(model_path)
    hf_config = load_hf_config(src)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    target = load_target(src, dtype, device, args.max_seq_len + 8, hf_config)
    target.model.set_aux_layers(aux_hidden_layers(args.aux_hidden_layers, target.config.num_layers))
    seqs = [s.ids[:args.max_seq_len] for s in samples]
    prompt_lens = [min(s.prompt_len, len(q)) for s, q in zip(samples, seqs)]
    live = args.live_target_states
    if device.type == "cuda" and not live:
        # keep the states on the GPU when they take well under the free memory (no per-step host copies), else
        # run the target per batch
        need = sum(len(s) for s in seqs) * target.model.feature_size * torch.tensor([], dtype=dtype).element_size()
        live = need >= 0.3 * torch.cuda.mem_get_info(device)[0]
    if live:
        logger.info("target states: computed per training batch")
        return target, seqs, prompt_lens, LiveTargetStates(target.model), 0.0
    t0 = time.perf_counter()
    store = collect_hidden(target.model, seqs, device, dtype, device, args.hidden_batch_tokens)
    return target, seqs, prompt_lens, store, time.perf_counter() - t0


def aux_hidden_layers(spec: str, num_layers: int) -> list[int]:
    """--aux-hidden-layers: 'none' or '' -> [], 'auto' -> [1, L/2 - 1, L - 4] (EAGLE-3's low/mid/high), else the
    listed ones."""
    if spec.strip() in ("", "none"):
        return []
    if spec.strip() == "auto":
        return sorted({min(1, num_layers - 1), max(num_layers // 2 - 1, 0), max(num_layers - 4, 0)})
    try:
        layers = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--aux-hidden-layers: expected 'auto' or comma-separated integers, got {spec!r}") from None
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise SystemExit(f"--aux-hidden-layers: {bad} outside the target's layers 0..{num_layers - 1}")
    return layers


def train_head(args: argparse.Namespace, target, samples: list, seqs: list[list[int]], prompt_lens: list[int],
               store, device: torch.device) -> dict:
    """Draft vocabulary, head initialisation, training, validation and the checkpoint; returns the report's
    train and draft_vocab sections."""
    from specserve.tokenizer import load_tokenizer
    from specserve.train.export import write_draft_checkpoint
    from specserve.train.objective import (
        ObjectiveConfig,
        build_draft,
        init_draft_from_checkpoint,
        init_draft_from_target,
    )
    from specserve.train.trainer import TrainSettings, evaluate_draft, train_draft
    from specserve.train.vocab import build_draft_vocab, vocab_of_checkpoint

    cfg = target.config
    tok = load_tokenizer(target.source)
    forced = set(cfg.eos_token_ids) | set(tok.all_special_ids) | ({tok.eos_token_id} - {None})
    vocab = vocab_of_checkpoint(args.init_draft, [s.response_ids for s in samples], cfg.vocab_size) \
        if args.init_draft else None
    if vocab is None:
        vocab = build_draft_vocab([s.response_ids for s in samples], [s.prompt_ids for s in samples],
                                  cfg.vocab_size, args.draft_vocab_size, forced)
    if vocab.ids is not None:
        logger.info("draft vocabulary: %d tokens, coverage %.4f of generated tokens", vocab.size, vocab.coverage)

    draft = build_draft(cfg, args.max_seq_len + 8, vocab, device, list(target.model.model.aux_layers))
    init_draft_from_target(draft, target.model, vocab, args.init_noise, args.seed, args.init_residual_scale)
    if args.init_draft:
        init_draft_from_checkpoint(draft, target, args.init_draft, args.max_seq_len + 8)
        logger.info("draft initialised from %s", args.init_draft)
    frozen_head = vocab.ids is not None and not args.train_draft_head
    if frozen_head:
        draft.lm_head.weight.requires_grad_(False)  # the target's rows, rebuilt from the target at load time
    head_w = target.model.lm_head.weight
    target_head = head_w if vocab.ids is None else head_w[vocab.ids.to(device)]  # [Vd, H] labels for "kl"
    to_draft = vocab.to_draft_index(cfg.vocab_size, device)
    obj = ObjectiveConfig(chain_steps=args.chain_steps, depth_decay=args.depth_decay, loss=args.loss)
    ts = TrainSettings(train_steps=args.train_steps, batch_size=args.batch_size, lr=args.lr,
                       batch_tokens=args.batch_tokens, warmup_steps=args.warmup_steps,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
                       log_every=args.log_every, time_budget_s=args.train_time_budget)
    train_idx, val_idx = split_validation(len(seqs), args.val_fraction, args.seed)
    result = train_draft(draft, *_subset(train_idx, seqs, prompt_lens, store), to_draft, target_head, obj, ts,
                         device)
    val_loss, val_top1 = [], []
    if val_idx:
        val_loss, val_top1 = evaluate_draft(draft, *_subset(val_idx, seqs, prompt_lens, store), to_draft,
                                            target_head, obj, args.batch_size, device, args.batch_tokens)
        logger.info("validation (%d sequences): loss %s top1 %s", len(val_idx), [round(x, 4) for x in val_loss],
                    [round(x, 3) for x in val_top1])
    write_draft_checkpoint(draft, cfg, args.output, getattr(torch, args.save_dtype), include_head=not frozen_head)
    logger.info("draft checkpoint written to %s", args.output)
    return {
        "train": {"steps": result.steps, "batch_size": args.batch_size, "batch_tokens": args.batch_tokens,
                  "lr": args.lr,
                  "max_seq_len": args.max_seq_len,
                  "initial_loss": [round(x, 5) for x in result.initial_loss],
                  "final_loss": [round(x, 5) for x in result.final_loss],
                  "top1": [round(x, 4) for x in result.final_top1],
                  "val_sequences": len(val_idx), "val_loss": [round(x, 5) for x in val_loss],
                  "val_top1": [round(x, 4) for x in val_top1],
                  "time_s": round(result.time_s, 2), "device": str(device)},
        "draft_vocab": {"size": vocab.size, "coverage": round(vocab.coverage, 5)},
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    if args.chain_steps < 1 or args.train_steps < 0 or args.batch_size < 1:
        raise SystemExit("--chain-steps and --batch-size must be >= 1, --train-steps >= 0")
    if args.max_seq_len <= _MIN_RESPONSE_ROOM + 2:
        raise SystemExit(f"--max-seq-len must be > {_MIN_RESPONSE_ROOM + 2}")
    eval_steps = [int(x) for x in args.eval_num_steps.split(",") if x.strip()]
    from specserve.defaults import embedded_model_path
    from specserve.engine.engine import resolve_device
    from specserve.train.acceptance import measure_acceptance
    from specserve.train.export import write_report

    t_start = time.perf_counter()
    os.makedirs(args.output, exist_ok=True)
    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    model_path = args.model_path or embedded_model_path()

    samples, data_info = self_distill(args, model_path)  # 1. the target's own responses (engine)
    if args.generate_only:
        write_report(args.output, {"target": model_path, "data": data_info})
        logger.info("self-distilled data: %s", os.path.join(args.output, "selfdistill"))
        return 0
    if args.greedy_only:
        samples = [s for s in samples if not s.sampled]
        if not samples:
            raise SystemExit("--greedy-only: the data has no greedy responses")
        data_info["trained_sequences"] = len(samples)
        data_info["trained_response_tokens"] = sum(len(s.response_ids) for s in samples)
    target, seqs, prompt_lens, store, hidden_s = target_states(args, model_path, samples, device)  # 2.
    sections = train_head(args, target, samples, seqs, prompt_lens, store, device)  # 3. vocab, train, checkpoint
    sections["train"]["hidden_time_s"] = round(hidden_s, 2)
    del target, store
    _release_cuda()
    report = {
        "target": model_path,
        "draft": {"path": os.path.abspath(args.output), "chain_steps": args.chain_steps, "loss": args.loss,
                  "save_dtype": args.save_dtype},
        "data": data_info,
        **sections,
        "held_out": {},
    }
    write_report(args.output, report)  # written now too, so a failed evaluation leaves the training report

    if args.held_out and eval_steps:  # 4. held-out acceptance through the engine
        report["held_out"] = measure_acceptance(
            model_path, args.output, args.held_out, eval_steps, args.eval_prompts_per_file,
            args.eval_max_new_tokens, engine_kwargs(args), seed=args.seed)
    report["total_time_s"] = round(time.perf_counter() - t_start, 2)
    write_report(args.output, report)
    logger.info("report: %s", os.path.join(args.output, "report.json"))
    return 0
