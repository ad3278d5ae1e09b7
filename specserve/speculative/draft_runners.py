"""The draft's phase runners (docs/architecture.md), over the same base as the target's (graphs/phase_runners.py): the
whole N - 1 step draft-decode loop as one function, and the draft extend over the N + 1 verified positions."""

from __future__ import annotations

import torch

from specserve.batch import ForwardMode
from specserve.graphs.phase_runners import PhaseRunner, RunnerContext
from specserve.speculative.draft_state import DraftChooser
from specserve.speculative.ngram import history_tail


class DraftDecodeRunner(PhaseRunner):
    """The whole N - 1 step draft loop in one function (one graph): chained through the draft's own hidden state,
    positions (all mRoPE rows) and sequence lengths advancing by one per step -> tokens [bs, N-1]."""

    name = "draft_decode"
    mode = ForwardMode.DRAFT_DECODE
    needs_hidden = True

    def __init__(self, ctx: RunnerContext, chooser: DraftChooser, num_steps: int, capture_bs, use_graphs):
        self.num_steps = num_steps  # N - 1 forwards
        self.chooser = chooser
        super().__init__(ctx, 1, capture_bs, use_graphs)

    def forward_phase(self, t, backends, graph_mode):
        ids, hidden = t.input_ids, t.hidden
        last = t.seq_lens - 1  # committed tokens end at S (the input is d1 at S+1)
        hist = self.chooser.history_rows(t.req_pool_indices)  # gathered once for all N - 1 steps
        pattern = None
        if hist is not None:
            p2, p1, _ = history_tail(hist, last)
            pattern = (p2, p1, ids)  # (x_{S-1}, x_S, d1): the next draft continues it
        sampling = t.draft_sampling
        tokens, dists = [], []
        for i in range(self.num_steps):
            fb = self.make_batch(self.mode, t, ids, t.positions + i, t.seq_lens + i, hidden, backends, graph_mode,
                                 t.max_seq_len)
            out = self.ctx.model(fb)
            if sampling is None:
                ids = self.chooser.draft_tokens(out, hist, last, pattern)
            else:  # the draft at sequence index S + 2 + i, drawn from the head's distribution
                ids, dist = self.chooser.sample_drafts(out, hist, last, sampling, t.seq_lens + 1 + i, pattern)
                dists.append(dist)
            hidden = self.ctx.model.chained(out)  # [bs, H] into the next step
            if pattern is not None:
                pattern = (pattern[1], pattern[2], ids)
            tokens.append(ids)
        res = {"tokens": torch.stack(tokens, dim=1)}
        if dists:  # [bs, N-1, K] each
            res["q_ids"] = torch.stack([d[0] for d in dists], dim=1)
            res["q_probs"] = torch.stack([d[1] for d in dists], dim=1)
        return res


class DraftExtendRunner(PhaseRunner):
    """Draft over the N + 1 verified positions at fixed width (rejected rows included: they are overwritten
    later), then the row of the last accepted token -> next d1 [bs] and its hidden state [bs, H]."""

    name = "draft_extend"
    mode = ForwardMode.DRAFT_EXTEND
    needs_hidden = True
    hidden_from_target = True

    def __init__(self, ctx: RunnerContext, chooser: DraftChooser, width: int, capture_bs, use_graphs):
        self.chooser = chooser
        super().__init__(ctx, width, capture_bs, use_graphs)

    def forward_phase(self, t, backends, graph_mode):
        fb = self.make_batch(self.mode, t, t.input_ids, t.positions, t.seq_lens, t.hidden, backends, graph_mode,
                             t.max_seq_len)
        out = self.ctx.model(fb).view(t.batch_size, self.width, -1)
        sel = out[torch.arange(t.batch_size, device=out.device), t.accept_len]  # [bs, H] (or [normed | pre-norm])
        # committed tokens now end at S + accept_len + 1 (seq_lens = S + width here; the history holds them)
        last = t.seq_lens - self.width + t.accept_len + 1
        hist = self.chooser.history_rows(t.req_pool_indices)
        if t.draft_sampling is None:
            return {"tokens": self.chooser.draft_tokens(sel, hist, last), "hidden": self.ctx.model.chained(sel)}
        # the next d1, at sequence index last + 1
        tokens, (q_ids, q_probs) = self.chooser.sample_drafts(sel, hist, last, t.draft_sampling, last + 1)
        return {"tokens": tokens, "q_ids": q_ids, "q_probs": q_probs, "hidden": self.ctx.model.chained(sel)}
