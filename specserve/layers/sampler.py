"""Batched sampling on the device: temperature, top-k, top-p, min-p, per-request seeds; no host sync.

Randomness is counter-based: the uniform noise for (seed, position, salt) is a hash, so a request's sample does
not depend on which other requests share its batch, on retraction/re-prefill, or on the device. Sampling uses
the exponential race (argmax p / E, E ~ Exp(1)), which draws exactly from p.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.kernels import ops
from specserve.kernels.availability import triton_kernels
from specserve.kernels.noise import SALT_SAMPLE, uniform_noise

logger = logging.getLogger(__name__)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors. Rows are requests (or request x verify position)."""

    temperature: torch.Tensor | None  # [bs] float32; 0 for greedy rows (tensors are None when all_greedy)
    top_p: torch.Tensor | None  # [bs]
    top_k: torch.Tensor | None  # [bs] int64; vocab size where disabled
    min_p: torch.Tensor | None  # [bs]
    seeds: torch.Tensor | None  # [bs] int64
    greedy: torch.Tensor | None  # [bs] bool
    all_greedy: bool
    need_filter: bool  # any top-k / top-p / min-p active

    @staticmethod
    def build(params: list, seeds: list[int], vocab_size: int, device: torch.device) -> SamplingBatch:
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            # Greedy batches only take an argmax: no per-row tensors, no host-to-device copies on the hot path.
            return GREEDY
        temps = [0.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        need_filter = any(p.top_p < 1.0 or 0 < p.top_k < vocab_size or p.min_p > 0 for p, g in
                          zip(params, greedy) if not g)

        def t(x, dt):
            return torch.tensor(x, dtype=dt).to(device, non_blocking=True)

        return SamplingBatch(
            temperature=t(temps, torch.float32),
            top_p=t([p.top_p for p in params], torch.float32),
            top_k=t(top_k, torch.int64),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t(seeds, torch.int64),
            greedy=t(greedy, torch.bool),
            all_greedy=False,
            need_filter=need_filter,
        )

    def repeat(self, n: int) -> SamplingBatch:
        """Each row repeated n times (verify: one row per request x position)."""
        r = lambda x: x[:, None].expand(-1, n).reshape(-1)  # [bs] -> [bs * n]; no host sync (graph-safe)
        return SamplingBatch(r(self.temperature), r(self.top_p), r(self.top_k), r(self.min_p), r(self.seeds),
                             r(self.greedy), self.all_greedy, self.need_filter)


GREEDY = SamplingBatch(None, None, None, None, None, None, all_greedy=True, need_filter=False)  # an all-greedy batch


def probs_from_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits [R, V] float32 -> the distribution each row samples from [R, V] (greedy rows: one-hot argmax).
    CUDA tensors: the sort-free Triton kernel (kernels/triton_sample.py); otherwise the reference below."""
    if logits.is_cuda and (tk := sampling_kernels(logits.device)) is not None:
        return tk.probs_triton(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, sb.need_filter)
    return probs_reference(logits, sb)


def probs_reference(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """probs_from_logits in torch: softmax, then the filter over a sort of each row."""
    temp = torch.where(sb.greedy, torch.ones_like(sb.temperature), sb.temperature)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if sb.need_filter:
        probs = _filter(probs, sb)
    onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(sb.greedy[:, None], onehot, probs)


def _filter(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    out = torch.zeros_like(probs).scatter_(1, idx, filter_sorted(sorted_p, sb))
    return out / out.sum(dim=-1, keepdim=True)


def filter_sorted(sorted_p: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Each row's top-k, top-p and min-p over probabilities in descending order [R, C] -> the same with the dropped
    ones zeroed (not renormalised); the most likely always survives, ties at the boundary survive together. Also a
    sampled draft's rule over its candidates (speculative/draft_state.py candidate_probs)."""
    ranks = torch.arange(sorted_p.shape[-1], device=sorted_p.device)[None, :]
    # Equal probabilities share one fate: each is judged at its group's first rank (the tokens strictly more
    # likely), so the rule does not depend on how a sort orders ties (common with bfloat16 logits), and it is the
    # one the sort-free kernel applies (kernels/triton_sample.py).
    new = torch.ones_like(sorted_p, dtype=torch.bool)
    new[:, 1:] = sorted_p[:, 1:] != sorted_p[:, :-1]
    first = torch.where(new, ranks, 0).cummax(dim=-1).values  # [R, C] rank of the group's first member
    drop = first >= sb.top_k[:, None]
    above = (sorted_p.cumsum(dim=-1) - sorted_p).gather(-1, first)  # mass strictly more likely
    # keep the smallest prefix reaching top_p; top_p 1 keeps all (a cumsum may round past 1.0 before the tail)
    drop |= (above > sb.top_p[:, None]) & (sb.top_p[:, None] < 1.0)
    drop |= sorted_p < sb.min_p[:, None] * sorted_p[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return sorted_p.masked_fill(drop, 0.0)


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      salt: int = SALT_SAMPLE) -> torch.Tensor:
    """Exponential race: argmax(p / E). probs [R, V]; seeds, positions [R] -> [R] int64."""
    u = uniform_noise(seeds, positions, salt, probs.shape[-1])
    return (probs / -torch.log(u)).argmax(dim=-1)


def sample(logits: torch.Tensor, sb: SamplingBatch, positions: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """logits [bs, V] -> token ids [bs]; positions: the sequence index each new token will take. masked: the logits
    may hold -inf (a grammar's mask, engine/logit_rules.py): the fused sampling kernel assumes finite logits (with
    -inf under top-p it drew a forbidden token on an H100), so such rows go through probs_from_logits, whose kernel
    handles them (check_sampling_kernels), and the same draw (sample_from_probs)."""
    if sb.all_greedy:
        return logits.argmax(dim=-1) if masked else ops.row_top1(logits)[0]
    if masked:
        return sample_from_probs(probs_from_logits(logits, sb), sb.seeds, positions)
    if logits.is_cuda and (tk := sampling_kernels(logits.device)) is not None:
        return tk.sample_triton(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, sb.seeds, positions,
                                sb.need_filter)
    return sample_from_probs(probs_reference(logits, sb), sb.seeds, positions)


_KERNELS_OK: dict[torch.device, bool] = {}  # per device: the sort-free kernels passed check_sampling_kernels


def sampling_kernels(device: torch.device):
    """The Triton kernel module for sampling on `device`, or None: the torch reference then runs. The kernels are
    checked against the reference once per device before first use (check_sampling_kernels; the model runner does
    it before capturing graphs)."""
    tk = triton_kernels()
    if tk is None:
        return None
    ok = _KERNELS_OK.get(_device_key(device))
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return tk  # a capture without a check first (the model runner checks before its captures)
        ok = check_sampling_kernels(device)
    return tk if ok else None


def check_sampling_kernels(device: torch.device, tk=None) -> bool:
    """Run the sort-free sampling kernels once on `device` against the reference (rows mixing greedy, temperature,
    top-k, top-p and min-p over bfloat16-rounded logits: the kept sets, the distributions and the drawn tokens);
    on any failure log it and let this process sample with the reference. Returns whether they passed. tk: the
    kernel module (default: the process's Triton kernels)."""
    tk = tk if tk is not None else triton_kernels()
    if tk is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        rows, vocab = 6, 5003
        x = (torch.randn((rows, vocab), generator=g) * 4).to(torch.bfloat16).float().to(device)
        f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
        sb = SamplingBatch(f([0.0, 1.0, 0.7, 0.8, 1.2, 0.9]), f([1.0, 1.0, 0.95, 1.0, 0.5, 0.9]),
                           torch.tensor([vocab, vocab, vocab, 40, vocab, 100], device=device),
                           f([0.0, 0.0, 0.0, 0.0, 0.0, 0.05]), torch.arange(rows, device=device) + 1,
                           torch.tensor([True] + [False] * 5, device=device), all_greedy=False, need_filter=True)
        pos = torch.arange(rows, device=device) + 7
        want_p = probs_reference(x, sb)
        got_p = tk.probs_triton(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, True)
        got_t = tk.sample_triton(x, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, sb.seeds, pos, True)
        want_t = sample_from_probs(want_p, sb.seeds, pos)
        # a grammar's mask: most logits -inf (the probs kernel must keep them out, filters and all)
        xm = x.masked_fill(torch.rand(x.shape, generator=g).to(device) < 0.97, float("-inf"))
        xm[:, 0] = x[:, 0]  # at least one allowed token a row
        want_m = probs_reference(xm, sb)
        got_m = tk.probs_triton(xm, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.greedy, True)
        ok = (torch.equal(got_p > 0, want_p > 0) and torch.allclose(got_p, want_p, atol=1e-5, rtol=1e-4)
              and torch.equal(got_t, want_t) and torch.equal(got_m > 0, want_m > 0)
              and torch.allclose(got_m, want_m, atol=1e-5, rtol=1e-4))
        err = "" if ok else f"tokens {got_t.tolist()} vs {want_t.tolist()}"
    except Exception as e:  # a kernel that does not compile on this device or Triton: the reference serves
        ok, err = False, repr(e)
    _KERNELS_OK[_device_key(device)] = ok
    if not ok:
        logger.error("the Triton sampling kernels disagree with the reference on %s (%s); sampling with torch", device,
                     err)
    return ok


def _device_key(device: torch.device) -> torch.device:
    """cuda and cuda:0 (the current device) are one device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
