"""Logit rules: penalties, logit bias and a grammar, applied to the target's logits wherever a request samples.

A request's rules (`RowRules`, from its SamplingParams) change the target's distribution at every position it
samples: its first token after prefill, each decode or plain step, and every position of a speculative step's
verify. At verify position j (the token after the committed output and drafts d1..dj) the rules see those drafts as
output: a frequency or presence penalty counts them, a repetition penalty treats them as seen, the grammar is
advanced over them (engine/grammar.py). So the target's distribution at each verified position is exactly the one
plain decoding would sample from once the drafts before it are accepted, and speculation stays lossless with the
rules on: greedy speculation gives plain greedy's tokens, sampled speculation plain sampling's distribution.

The order, per position: repetition penalty, frequency and presence penalties, logit bias, grammar mask (forbidden
tokens to -inf). Temperature and the top-k / top-p / min-p filters follow (layers/sampler.py).

The adjuster also reads back log-probabilities for the rows that return them (`record_logprobs`): those of the
distribution after the rules and the request's temperature (1 for greedy rows), before the top-k / top-p / min-p
filters (vLLM's "processed" logprobs; a filter would turn most of them into -inf), at each emitted position. A
speculative step's accepted positions are verify positions whose logits equal plain decoding's, so the logprobs
are the same with and without speculation (up to float rounding).

A batch whose rows carry rules (or return logprobs) runs its steps phase by phase (the rules need the host between
the draft and the verify forward, and the grammar needs the host's read of every step), synchronously:
engine/decode_plan.py. Rows without rules in such a batch are left unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.grammar import GrammarState
from specserve.engine.sampling_params import SamplingParams


@dataclass
class RowRules:
    """One request's logit rules; `grammar` is set once the grammar is compiled (engine/grammar.py)."""

    sampling: SamplingParams
    grammar: GrammarState | None = None

    def commit(self, token: int) -> None:
        """The request's next output token, read back by the host."""
        if self.grammar is not None:
            self.grammar.commit(token)


class LogitAdjuster:
    """The rules of a batch's rows, applied to one step's logits (`__call__`)."""

    def __init__(self, reqs: list, vocab_size: int, device: torch.device):
        """reqs: the step's requests in row order (engine/request.py Req: origin_input_ids, output_ids, rules)."""
        self.vocab = vocab_size
        self.device = device
        self.reqs = reqs
        self.last: torch.Tensor | None = None  # the adjusted logits of the last call, kept for record_logprobs
        self.keep = any(r.return_logprob for r in reqs)
        rules = [r.rules for r in reqs]
        self.grammars = [None if x is None else x.grammar for x in rules]
        sps = [None if x is None else x.sampling for x in rules]
        bs = len(reqs)

        def col(values, dtype=torch.float32):  # [bs] on the device
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        pen = [sp is not None and sp.has_penalties for sp in sps]
        self.penalised = any(pen)
        if self.penalised:
            self.freq = col([sp.frequency_penalty if p else 0.0 for sp, p in zip(sps, pen)])
            self.pres = col([sp.presence_penalty if p else 0.0 for sp, p in zip(sps, pen)])
            self.rep = col([sp.repetition_penalty if p else 1.0 for sp, p in zip(sps, pen)])
            self.counts = self._counts([r.output_ids if p else [] for r, p in zip(reqs, pen)], bs)  # [bs, V]
            rep_rows = [p and sp.repetition_penalty != 1.0 for sp, p in zip(sps, pen)]
            self.prompt_seen = (self._counts([r.origin_input_ids if rr else [] for r, rr in zip(reqs, rep_rows)],
                                             bs) > 0) if any(rep_rows) else None  # [bs, V]
        self.bias = None
        if any(sp is not None and sp.logit_bias for sp in sps):
            rows, toks, vals = [], [], []
            for i, sp in enumerate(sps):
                for t, v in ([] if sp is None else sp.bias_items):
                    if t < vocab_size:
                        rows.append(i)
                        toks.append(t)
                        vals.append(v)
            self.bias = torch.zeros((bs, vocab_size), dtype=torch.float32)
            self.bias[rows, toks] = torch.tensor(vals, dtype=torch.float32)
            self.bias = self.bias.to(device, non_blocking=True)

    def _counts(self, seqs: list[list[int]], bs: int) -> torch.Tensor:
        """Token counts of each row's sequence [bs, V] float32, on the device."""
        rows = [i for i, s in enumerate(seqs) for _ in s]
        toks = [t for s in seqs for t in s]
        counts = torch.zeros((bs, self.vocab), dtype=torch.float32, device=self.device)
        if toks:
            idx = torch.tensor([rows, toks], dtype=torch.int64).to(self.device, non_blocking=True)
            counts.index_put_((idx[0], idx[1]), torch.ones(len(toks), device=self.device), accumulate=True)
        return counts

    @property
    def needs_drafts_on_host(self) -> bool:
        return any(g is not None for g in self.grammars)

    def __call__(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [bs, W, V] at W consecutive positions of each row; drafts [bs, W - 1]: the tokens between them (the
        draft path; None when W = 1) -> the adjusted logits [bs, W, V] float32 (a new tensor)."""
        bs, width, vocab = logits.shape
        out = logits.float()
        if self.penalised:
            counts = self.counts[:, None].expand(bs, width, vocab)  # [bs, W, V] output so far, drafts below
            if width > 1:
                seen = torch.zeros((bs, width, vocab), dtype=torch.float32, device=logits.device)
                seen[:, 1:].scatter_(2, drafts[:, :, None], 1.0)  # draft j is output at positions j + 1 ..
                counts = counts + seen.cumsum(dim=1)
            if self.prompt_seen is not None:
                hit = (counts > 0) | self.prompt_seen[:, None]
                rep = self.rep[:, None, None]
                out = torch.where(hit, torch.where(out > 0, out / rep, out * rep), out)
            out = out - self.freq[:, None, None] * counts - self.pres[:, None, None] * (counts > 0).float()
        if self.bias is not None:
            out = out + self.bias[:, None]
        if self.needs_drafts_on_host:
            out = out.masked_fill(~self._allowed(bs, width, drafts), float("-inf"))
        if self.keep:
            self.last = out
        return out

    def record_logprobs(self, tokens: list[list[int]]) -> None:
        """The step's emitted tokens per row (the first len(tokens[i]) of the last call's positions) -> appended to
        the rows' output_logprobs (and output_top_logprobs) for the requests that return them. One host sync."""
        want = [i for i, r in enumerate(self.reqs) if r.return_logprob and not r.finished and tokens[i]]
        if not want or self.last is None:
            return
        rows = [i for i in want for _ in tokens[i]]
        pos = [j for i in want for j in range(len(tokens[i]))]
        toks = [t for i in want for t in tokens[i]]
        temps = [_temperature(self.reqs[i].sampling) for i in want for _ in tokens[i]]
        idx = torch.tensor([rows, pos, toks], dtype=torch.int64).to(self.device, non_blocking=True)
        temp = torch.tensor(temps, dtype=torch.float32).to(self.device, non_blocking=True)
        lp = torch.log_softmax(self.last[idx[0], idx[1]] / temp[:, None], dim=-1)  # [T, V]
        chosen = lp.gather(1, idx[2][:, None])[:, 0].tolist()
        k = max(self.reqs[i].top_logprobs_num for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k else (None, None)
        top_v, top_i = (top_v.tolist(), top_i.tolist()) if k else ([], [])
        at = 0
        for i in want:
            r = self.reqs[i]
            for _ in tokens[i]:
                r.output_logprobs.append(chosen[at])
                if r.top_logprobs_num:
                    n = r.top_logprobs_num
                    r.output_top_logprobs.append(list(zip(top_i[at][:n], top_v[at][:n])))
                at += 1

    def _allowed(self, bs: int, width: int, drafts: torch.Tensor | None) -> torch.Tensor:
        """The grammar rows' allowed tokens [bs, W, V] bool (rows without a grammar: all)."""
        words = (self.vocab + 31) // 32
        mask = torch.full((bs, width, words), -1, dtype=torch.int32)
        path = drafts.tolist() if drafts is not None else [[] for _ in range(bs)]  # a host sync (grammar rows)
        for i, g in enumerate(self.grammars):
            if g is not None:
                g.fill(mask[i], path[i])
        mask = mask.to(self.device, non_blocking=True)
        bits = torch.arange(32, dtype=torch.int32, device=self.device)
        allowed = ((mask[..., None] >> bits) & 1).bool()  # [bs, W, words, 32]
        return allowed.reshape(bs, width, words * 32)[..., :self.vocab]


def _temperature(sp: SamplingParams) -> float:
    return 1.0 if sp.is_greedy else float(sp.temperature)


def logit_adjuster(reqs: list, vocab_size: int, device: torch.device) -> LogitAdjuster | None:
    """The adjuster of a step's requests, or None when no row carries rules or returns logprobs (the step then
    runs as before)."""
    if not any(r.needs_host_logits for r in reqs):
        return None
    return LogitAdjuster(reqs, vocab_size, device)
