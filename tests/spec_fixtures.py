"""Test doubles and builders for speculative-decoding tests.

`OracleDraft` stands in for an MTP head that knows the target's greedy continuation (with deliberate mistakes),
so the spec step's accept paths (0..N accepted, bonus tokens) are all exercised with high acceptance; a random MTP
head accepts almost nothing. It keys its answers by (page-table row, sequence index), which is deterministic
when one batch of prompts is admitted together (rows 1..B in submission order).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.batch import ForwardBatch
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker
from specserve.models.loader import ModelSource, load_mtp_draft, load_target
from specserve.models.token_map import load_token_map
from specserve.server_args import ServerArgs


class OracleDraft(nn.Module):
    def __init__(self, hidden_size: int, sequences: dict[int, list[int]], wrong_every: int | None, vocab: int):
        super().__init__()
        width = max(len(s) for s in sequences.values()) + 64
        table = torch.zeros((max(sequences) + 1, width), dtype=torch.int64)
        for row, seq in sequences.items():
            table[row, :len(seq)] = torch.tensor(seq)
            # Deliberate mistakes at a fixed pattern of indices (differs per row), so acceptance is partial.
            if wrong_every:
                for i in range(row % wrong_every, width, wrong_every):
                    table[row, i] = (table[row, i] + 1) % vocab
        self.register_buffer("table", table)
        self.hidden_size = hidden_size
        self.aux_layers: list[int] = []  # reads the target's final hidden state only
        self.feature_size = hidden_size
        self.vocab = vocab
        self.calls = 0
        self.logit_calls = 0  # draft_candidates calls (sampled drafting)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.calls += 1
        t = fb.input_ids.shape[0]
        if fb.width is not None:
            rows = fb.req_pool_indices.repeat_interleave(fb.width)
        elif fb.extend_lens is not None:  # a prefill graph: the lengths stay on the device (they cover all t)
            rows = fb.req_pool_indices.repeat_interleave(fb.extend_lens, output_size=t)
        else:
            lens = torch.tensor(fb.extend_lens_cpu, device=fb.input_ids.device)
            rows = fb.req_pool_indices.repeat_interleave(lens)
        pos = fb.positions if fb.positions.dim() == 1 else fb.positions[0]
        h = torch.zeros((t, self.hidden_size), dtype=torch.float32, device=fb.input_ids.device)
        h[:, 0] = rows.float()
        h[:, 1] = pos.float()
        return h

    def set_chain_prenorm(self, prenorm: bool) -> None:
        assert not prenorm, "the oracle drafter chains nothing"

    def chained(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden[:, 0].long().clamp(0, self.table.shape[0] - 1)
        idx = (hidden[:, 1].long() + 2).clamp(0, self.table.shape[1] - 1)  # draft at p predicts index p + 2
        return self.table[rows, idx]

    def draft_vocab_size(self) -> int:
        return self.vocab

    def draft_candidates(self, hidden: torch.Tensor, k: int):
        """A soft oracle for sampled drafting: logit 2 on the oracle's token, 0 elsewhere (at temperature 1 and
        V = 12 the oracle's token gets q = 0.40, so drafts are often other tokens) -> its k best, as MTPDraftModel's."""
        self.logit_calls += 1
        tokens = self.draft_tokens(hidden)
        logits = torch.zeros((tokens.shape[0], self.vocab), dtype=torch.float32, device=tokens.device)
        logits.scatter_(1, tokens[:, None] % self.vocab, 2.0)
        vals, ids = logits.topk(k, dim=-1)
        return vals, ids, torch.logsumexp(logits, dim=-1)

    def cache_specs(self) -> list:
        return []  # the oracle attends to nothing, so it keeps no cache

    def draft_tokens_and_confidence(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An unsure oracle: with context lookup on, every n-gram continuation found overrides it."""
        tokens = self.draft_tokens(hidden)
        return tokens, torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)


def run_greedy(sched: Scheduler, prompts: list[list[int]], new: int, hidden=lambda i: False) -> list[Req]:
    """Greedy requests (ignore_eos) for `prompts` run to the end; the KV pool must be back where it started.
    hidden(i): request i returns hidden states."""
    reqs = [Req(f"r{i}", p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True), seed=i,
                return_hidden_states=hidden(i)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    return reqs


def build_scheduler(path: str, draft: nn.Module | None = None, draft_path: str | None = None,
                    device: str = "cpu", dtype: torch.dtype = torch.float32, **kw):
    """ModelRunner + Scheduler for a checkpoint, with an explicit draft module (or one loaded from draft_path /
    the target's own MTP layer when kw has speculative_algorithm). Graphs are captured on CUDA."""
    args = ServerArgs(model_path=path, **kw)
    dev = torch.device(device)
    t = load_target(ModelSource.resolve(path), dtype, dev, 600)
    if draft is None and args.spec_enabled:
        token_map = (load_token_map(args.speculative_token_map, t.config.vocab_size)
                     if args.speculative_token_map else None)
        draft = load_mtp_draft(t, draft_path, dtype, dev, 600, token_map)
    elif draft is not None:
        draft = draft.to(dev)
    ctx = args.context_length or t.config.max_position_embeddings
    mr = ModelRunner(args, t.model, t.config, draft, dev, dtype, ctx)
    mr.capture_graphs()
    return Scheduler(mr, StopChecker(None, {2}), args.chunked_prefill_size), t


class ForcedSteps:
    """Stands in for the scheduler's adaptive-speculation policy (engine/adaptive_spec.py): plain (True) or
    speculative (False) steps in the given repeating pattern; `recorded` keeps what the scheduler reported."""

    def __init__(self, pattern: list[bool]):
        self.pattern, self.i, self.recorded, self.caught, self.steady = pattern, 0, [], [], []

    def choose_plain(self, bs: int) -> bool:
        self.i += 1
        return self.pattern[(self.i - 1) % len(self.pattern)]

    def record(self, bs: int, plain: bool, seconds: float, tokens_per_request: float,
               catch_up: tuple[float, int, int] | None = None, steady: bool = True) -> None:
        self.recorded.append((bs, plain, tokens_per_request))
        self.caught.append(catch_up)
        self.steady.append(steady)

