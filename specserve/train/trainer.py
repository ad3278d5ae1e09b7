"""The optimisation loop: AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on CUDA (float32
master weights), length-grouped batches, a progress bar with the per-depth loss and top-1 accuracy."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specserve.models.mtp import MTPDraftModel
from specserve.train.hidden import (
    HiddenStore,
    LiveTargetStates,
    length_batches,
    pad_ids,
    pad_multiple,
    round_up,
)
from specserve.train.objective import ObjectiveConfig, TrainBatch, chained_loss

logger = logging.getLogger(__name__)

TargetStates = HiddenStore | LiveTargetStates

_CALIBRATE_FIRST, _REFIT_EVERY = 10, 50  # a time budget fits the number of steps at step 10, then every 50


@dataclass
class TrainSettings:
    train_steps: int = 1000
    batch_size: int = 16  # sequences per step (when batch_tokens is 0)
    batch_tokens: int = 0  # > 0: padded tokens per step (B * max length) instead of a fixed sequence count
    lr: float = 3e-4
    warmup_steps: int | None = None  # default: 5% of the steps (at most 200)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 20
    time_budget_s: float | None = None  # cap: timed steps shrink train_steps to fit (schedule too)


@dataclass
class TrainResult:
    steps: int
    time_s: float
    initial_loss: list[float]  # per depth, first logging window
    final_loss: list[float]  # per depth, mean over the last ~10% of steps
    final_top1: list[float]
    loss_history: list[float] = field(default_factory=list)  # weighted loss per step


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def batch_indices(lengths: list[int], batch_size: int, seed: int, batch_tokens: int = 0,
                  multiple: int = 1) -> Iterator[list[int]]:
    """Endless batches: each epoch shuffles, sorts windows of sequences by length (less padding), cuts them into
    batches of `batch_size` sequences, or of at most `batch_tokens` padded tokens when that is > 0 (lengths
    rounded up to `multiple`, as make_batch pads them; a sequence longer than that is a batch of its own), and
    shuffles the batches again."""
    rng = random.Random(seed)
    n = len(lengths)
    bs = min(batch_size, n)
    window = max(bs * 32, 1024) if batch_tokens > 0 else bs * 32
    while True:
        order = list(range(n))
        rng.shuffle(order)
        batches = []
        for w in range(0, n, window):
            chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
            if batch_tokens > 0:
                groups = length_batches([round_up(lengths[i], multiple) for i in chunk], batch_tokens)
                batches.extend([chunk[j] for j in g] for g in groups)
            else:
                batches.extend(chunk[j:j + bs] for j in range(0, len(chunk), bs))
        rng.shuffle(batches)
        yield from batches


def make_batch(idx: list[int], ids: list[list[int]], prompt_lens: list[int], store: TargetStates,
               device: torch.device, hidden_dtype: torch.dtype, multiple: int = 1) -> TrainBatch:
    """Sequences idx, right-padded to a length that is a multiple of `multiple` (the padding is never a label)."""
    tok, lens = pad_ids([ids[i] for i in idx], device, multiple)  # [B, L], [B]
    hidden, top1 = store.batch(idx, tok)  # [B, L, F], [B, L]
    return TrainBatch(
        ids=tok,
        lens=lens,
        prompt_lens=torch.tensor([prompt_lens[i] for i in idx], dtype=torch.int64).to(device),
        hidden=hidden.to(device=device, dtype=hidden_dtype, non_blocking=True),
        top1=top1.to(device, non_blocking=True),
    )


@torch.no_grad()
def evaluate_draft(draft: MTPDraftModel, ids: list[list[int]], prompt_lens: list[int], store: TargetStates,
                   to_draft: torch.Tensor, target_head: torch.Tensor, obj: ObjectiveConfig, batch_size: int,
                   device: torch.device, batch_tokens: int = 0) -> tuple[list[float], list[float]]:
    """Per-depth loss and top-1 accuracy over held-back sequences (position-weighted), with the training objective;
    batches as in training (`batch_size` sequences, or `batch_tokens` padded tokens when > 0)."""
    was_training = draft.training
    draft.eval()
    amp = device.type == "cuda"
    k = obj.chain_steps
    loss_sum, top1_sum, count = (torch.zeros(k, device=device) for _ in range(3))
    multiple = pad_multiple(device)
    if batch_tokens > 0:
        groups = length_batches([round_up(len(s), multiple) for s in ids], batch_tokens)
    else:
        groups = [list(range(s, min(s + batch_size, len(ids)))) for s in range(0, len(ids), batch_size)]
    for idx in groups:
        batch = make_batch(idx, ids, prompt_lens, store, device, torch.bfloat16 if amp else torch.float32, multiple)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = chained_loss(draft, batch, to_draft, target_head, obj)
        loss_sum += out.depth_loss * out.depth_count
        top1_sum += out.depth_top1 * out.depth_count
        count += out.depth_count
    draft.train(was_training)
    count = count.clamp(min=1)
    return (loss_sum / count).tolist(), (top1_sum / count).tolist()


def _check_gradients(draft: MTPDraftModel) -> None:
    """Every trainable parameter must get a gradient. A kernel without autograd support (e.g. a forward-only
    fused op on this device) would cut the graph silently and train only the layers after it."""
    missing = [n for n, p in draft.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise RuntimeError(f"no gradient reached {', '.join(missing)}: an op on this device does not support "
                           "autograd")


def train_draft(draft: MTPDraftModel, ids: list[list[int]], prompt_lens: list[int], store: TargetStates,
                to_draft: torch.Tensor, target_head: torch.Tensor, obj: ObjectiveConfig, ts: TrainSettings,
                device: torch.device) -> TrainResult:
    """Train `draft` in place on sequences `ids` (prompt + response, already cut to the max length)."""
    params = [p for p in draft.parameters() if p.requires_grad]
    # fused AdamW is a CUDA feature; on CPU the default (foreach) implementation is used
    opt = torch.optim.AdamW(params, lr=ts.lr, betas=(0.9, 0.95), weight_decay=ts.weight_decay,
                            fused=device.type == "cuda")
    warmup = ts.warmup_steps if ts.warmup_steps is not None else min(200, max(1, ts.train_steps // 20))
    total = [ts.train_steps]  # may shrink once under a time budget; the schedule reads it
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total[0], warmup, ts.min_lr_ratio))
    amp = device.type == "cuda"
    hidden_dtype = torch.bfloat16 if amp else torch.float32
    multiple = pad_multiple(device)
    batches = batch_indices([len(s) for s in ids], ts.batch_size, ts.seed, ts.batch_tokens, multiple)
    k = obj.chain_steps
    win_loss, win_top1, win_n = torch.zeros(k, device=device), torch.zeros(k, device=device), 0
    depth_hist: list[tuple[torch.Tensor, torch.Tensor]] = []
    initial: list[float] | None = None
    history: list[float] = []
    draft.train()
    t0 = t_cal = time.perf_counter()
    bar = tqdm(total=ts.train_steps, desc="Training MTP head", unit="step", disable=None)
    step = -1
    while step + 1 < total[0]:
        step += 1
        bar.update(1)
        refit = step == _CALIBRATE_FIRST or (step > _CALIBRATE_FIRST and step % _REFIT_EVERY == 0)
        if ts.time_budget_s and refit:
            # Fit the steps to the budget after a few steps, then again and again from the steps since the first
            # fit (the first steps run slower: allocator warm-up, autotuning; batch shapes vary), so the schedule
            # ends at the budget.
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == _CALIBRATE_FIRST:
                per_step, t_cal = (now - t0) / step, now
            else:
                per_step = (now - t_cal) / (step - _CALIBRATE_FIRST)
            fit = step + int((ts.time_budget_s - (now - t0)) / per_step)
            new_total = max(20, step + 1, min(ts.train_steps, fit))
            if new_total != total[0] and (step == _CALIBRATE_FIRST or abs(new_total - total[0]) > 0.02 * total[0]):
                total[0] = new_total
                bar.total = total[0]
                logger.info("%.3f s/step: %d steps fit the %.0f s budget", per_step, total[0], ts.time_budget_s)
        batch = make_batch(next(batches), ids, prompt_lens, store, device, hidden_dtype, multiple)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = chained_loss(draft, batch, to_draft, target_head, obj)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if step == 0:
            _check_gradients(draft)
        if ts.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, ts.grad_clip)
        opt.step()
        sched.step()
        history.append(out.loss.detach())
        win_loss += out.depth_loss
        win_top1 += out.depth_top1
        win_n += 1
        depth_hist.append((out.depth_loss.detach(), out.depth_top1.detach()))
        if win_n == ts.log_every or step == total[0] - 1:
            wl, wt = (win_loss / win_n).tolist(), (win_top1 / win_n).tolist()  # one host sync per window
            if initial is None:
                initial = wl
            bar.set_postfix(loss=" ".join(f"{x:.3f}" for x in wl), top1=" ".join(f"{x:.2f}" for x in wt))
            logger.info("step %d/%d lr %.2e loss %s top1 %s", step + 1, total[0], sched.get_last_lr()[0],
                        [round(x, 4) for x in wl], [round(x, 3) for x in wt])
            win_loss.zero_()
            win_top1.zero_()
            win_n = 0
    bar.close()
    draft.eval()
    tail = depth_hist[-max(1, len(depth_hist) // 10):]  # the last ~10% of the steps
    return TrainResult(
        steps=len(depth_hist), time_s=time.perf_counter() - t0, initial_loss=initial or [],
        final_loss=(sum(t[0] for t in tail) / len(tail)).tolist(),
        final_top1=(sum(t[1] for t in tail) / len(tail)).tolist(),
        loss_history=[float(x) for x in history],
    )
