"""The device side of a speculative step (docs/architecture.md), and the graph that captures all of it as one.

`spec_step_device` is the step from the running rows' page-table rows and committed lengths to the accepted tokens:

    draft decode (N-1 chained steps) -> target verify (N+1 tokens) -> accept -> recurrent-state commit
    -> token history -> draft extend (fixed width N+1) -> per-row state (next d1, draft hidden, last token)

Its phases are the worker's `SpecPhases`, each run through a `PhaseCall` (graphs/phase_runners.py). The worker
(speculative/worker.py) passes `replay_phase`, so every phase replays its own graph with the host glue in between
(any batch, any sampling).

`SpecStepGraph` captures the same function once more, end to end, with each phase inlined (`inline_phase`), as one
graph per padded batch size. A step then costs the host one small input copy, one replay and the one output copy
that reads the accepted tokens: no host work between the phases, and the GPU starts on the step as soon as the
inputs land. It uses the phase runners' own attention backends (and their graph metadata buffers) and their padding
contract (graphs/padding.py stage_step). Three sets of graphs: greedy batches (argmax acceptance), and batches with
sampled rows (rejection sampling with per-row temperature, top-k, top-p, min-p and seeds as static graph inputs;
greedy rows of a mixed batch stay greedy), with and without the top-k / top-p / min-p filter (layers/sampler.py,
per verified position; skipped when no row filters). All three share one graph memory pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.graphs.padding import LiveInputs
from specserve.graphs.phase_runners import PhaseCall, PhaseRunner, TargetVerifyRunner, inline_phase
from specserve.graphs.step_graph import StepGraph
from specserve.graphs.step_hidden import StepHidden
from specserve.kvcache.state_pool import StatePool
from specserve.layers.sampler import GREEDY, SamplingBatch, probs_from_logits
from specserve.speculative.accept import one_hot_dist, verify_greedy, verify_sampling, verify_sampling_q
from specserve.speculative.draft_runners import DraftDecodeRunner, DraftExtendRunner
from specserve.speculative.draft_state import DraftState

# A batch's logit rules (engine/logit_rules.py LogitAdjuster): (logits [bs, W, V], the drafts between the W
# positions [bs, W - 1] or None) -> adjusted logits [bs, W, V]. May read the drafts on the host (not graph-safe).
LogitAdjust = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass
class SpecPhases:
    """The phase runners of a speculative step, in the order it runs them."""

    draft_decode: DraftDecodeRunner | None  # the N - 1 chained draft steps (None when N = 1)
    target_verify: TargetVerifyRunner  # the target over [last token, d1..dN] (the model runner's)
    draft_extend: DraftExtendRunner  # the draft over the N + 1 verified positions

    def all(self) -> list[PhaseRunner]:
        """Every phase runner of the step, in the order it runs them."""
        return [r for r in (self.draft_decode, self.target_verify, self.draft_extend) if r is not None]

    def draft_runners(self) -> list[PhaseRunner]:
        """The draft's runners (the worker captures them; the target's verify runner is the model runner's)."""
        return [r for r in (self.draft_decode, self.draft_extend) if r is not None]


class SpecStepWorker(Protocol):
    """What a speculative step reads and writes of its worker (speculative/worker.py SpecWorker): a protocol, so that
    this module, which the worker imports, need not import it."""

    num_steps: int  # N
    state: DraftState  # per-row d1, draft hidden state, token history, d1's distribution
    last_token: torch.Tensor  # [rows] the target's newest token per row (shared with the model runner)
    target_state: StatePool | None  # the target's recurrent state (None without recurrent layers)
    phases: SpecPhases
    step_hidden: StepHidden | None  # where verify's hidden states are kept (--enable-return-hidden-states)


def spec_step_device(worker: SpecStepWorker, call: PhaseCall, rows: torch.Tensor, seq_lens: torch.Tensor,
                     pos0: torch.Tensor, max_seq_len: int, sampling: SamplingBatch,
                     draft_sampling: SamplingBatch | None = None, adjust: LogitAdjust | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step for page-table rows [bs] whose committed sequences have length S = seq_lens [bs] (the
    last token, not yet in the KV, sits at index S); pos0 [bs] is the rope position of index S; max_seq_len bounds
    seq_lens.

    Returns (accept_len [bs] in 0..N, verified [bs, N+1]): the tokens at S+1..S+accept_len+1 are new. No host
    sync. N >= 1 (the plain step with no drafts is speculative/plain_step.py plain_step_device).

    draft_sampling: `sampling` again when the draft phases run inline (the one-graph step) and draw sampled rows'
    drafts from the head's distribution (--speculative-draft-sampling sample); None: deterministic drafts. With
    sampled drafting on (the row state keeps d1's distribution) a sampled batch verifies with the draft
    distributions (one-hot where a draft was deterministic: the phases' own graphs, context lookup, prefill).

    adjust: the rows' logit rules, applied to the verify logits along the draft path before acceptance, so each
    verified position samples the distribution plain decoding would (engine/logit_rules.py); it may sync with the
    host (a grammar walks the drafts there), so it is given only outside the one-step graph."""
    n = worker.num_steps
    phases = worker.phases
    bs = rows.shape[0]
    dev = rows.device
    row_state = worker.state
    q_mode = row_state.sampled_drafting and not sampling.all_greedy

    # 1. draft decode: d2..dN from (g, d1) at sequence indices S .. S+N-2
    d1 = row_state.draft_token[rows]  # [bs]
    if phases.draft_decode is not None:
        live = LiveInputs(bs, d1, pos0, rows, seq_lens + 1, max_seq_len + n - 1,
                          hidden=row_state.draft_hidden[rows], draft_sampling=draft_sampling)
        draft_out = call(phases.draft_decode, live)
        more = draft_out["tokens"]  # [bs, N-1]
        drafts = torch.cat((d1[:, None], more), dim=1)  # [bs, N]
    else:
        drafts = d1[:, None]  # [bs, 1]

    # 2. target verify over [last, d1..dN] at sequence indices S..S+N
    width = n + 1
    offs = torch.arange(width, device=dev)
    verify_ids = torch.cat((worker.last_token[rows][:, None], drafts), dim=1).reshape(-1)  # [bs * (N + 1)]
    verify_pos = (pos0[:, None] + offs[None, :]).reshape(-1)
    out = call(phases.target_verify, LiveInputs(bs, verify_ids, verify_pos, rows, seq_lens + width,
                                                max_seq_len + width))
    logits, hidden = out["logits"], out["hidden"]  # [bs, width, V], [bs, width, F]
    if worker.step_hidden is not None:
        worker.step_hidden.write(rows, hidden)
    if adjust is not None:
        logits = adjust(logits, drafts)

    # 3. accept
    if sampling.all_greedy:
        accept_len, verified = verify_greedy(drafts, logits)
    else:
        probs = probs_from_logits(logits.reshape(bs * width, -1), sampling.repeat(width)).view(bs, width, -1)
        if q_mode:  # the distributions the drafts were drawn from: d1's kept from the last step, then the loop's
            q_ids, q_probs = [row_state.q_ids[rows][:, None]], [row_state.q_probs[rows][:, None]]  # [bs, 1, K]
            if phases.draft_decode is not None:
                more_ids, more_probs = ((draft_out["q_ids"], draft_out["q_probs"]) if "q_ids" in draft_out
                                        else one_hot_dist(more, row_state.q_ids.shape[1]))  # [bs, N-1, K]
                q_ids.append(more_ids)
                q_probs.append(more_probs)
            accept_len, verified = verify_sampling_q(drafts, probs, torch.cat(q_ids, dim=1), torch.cat(q_probs, dim=1),
                                                     sampling.seeds, seq_lens)
        else:
            accept_len, verified = verify_sampling(drafts, probs, sampling.seeds, seq_lens)

    if worker.target_state is not None:  # the accept commit: the state after the last accepted token is current
        worker.target_state.commit(worker.target_state.row_state[rows], accept_len)

    if row_state.tokens is not None:  # token history for context lookup: verified tokens at S+1..S+N+1
        row_state.tokens[rows[:, None], seq_lens[:, None] + 1 + offs[None, :]] = verified

    # 4. draft extend over the same N+1 positions with the verified tokens, row accept_len -> next d1, g
    live = LiveInputs(bs, verified.reshape(-1), verify_pos, rows, seq_lens + width, max_seq_len + width,
                      accept_len=accept_len, hidden=hidden.reshape(bs * width, -1), draft_sampling=draft_sampling)
    ext = call(phases.draft_extend, live)
    if q_mode:
        row_state.set_d1(rows, ext["tokens"], (ext["q_ids"], ext["q_probs"]) if "q_ids" in ext else None)
    else:
        row_state.draft_token[rows] = ext["tokens"]
    row_state.draft_hidden[rows] = ext["hidden"].to(row_state.draft_hidden.dtype)
    worker.last_token[rows] = verified[torch.arange(bs, device=dev), accept_len]
    return accept_len, verified


class SpecStepGraph(StepGraph):
    """The speculative step as one graph per captured batch size and sampling kind (CPU: the same function run
    eagerly over the static inputs, as the phase runners' static replay; graphs/step_graph.py). Output:
    [bs, 1 + N + 1] = accept_len, verified.

    Each step also leaves every row's next S and rope position in `row_s` [2, page-table rows], so that the overlap
    schedule can launch a row's next step before the host has read this one's accept lengths: rows flagged as
    continuing take S from there instead of the staged inputs (engine/overlap.py)."""

    name = "spec_step"

    def __init__(self, worker: SpecStepWorker, capture_bs: list[int], use_graphs: bool):
        verify_ctx = worker.phases.target_verify.ctx
        # the target's vocabulary: it is what is sampled
        super().__init__(capture_bs, use_graphs, verify_ctx.device, verify_ctx.model.config.vocab_size,
                         verify_ctx.graph_max_seq_len, worker.num_steps + 1)
        self.worker = worker
        self.row_s = torch.zeros((2, verify_ctx.req_to_token.table.shape[0]), dtype=torch.int64,
                                 device=verify_ctx.device)  # [S, rope position of S] after each row's last step

    def forward(self, inputs: torch.Tensor, max_seq_len: int, sampling: SamplingBatch = GREEDY) -> torch.Tensor:
        """inputs [4, pbs] (rows, S, rope position of S, continuing flags) -> [pbs, N + 2]; each phase's forward
        inlined with its runner's graph-mode backends (1-D text positions also for mRoPE models, which read them as
        three equal rows, as prefill does). sampling: GREEDY, or the static sampling buffers' batch. max_seq_len
        bounds the staged and the continuing rows' S alike (the graphs' bound)."""
        draft_sampling = sampling if self.worker.state.sampled_drafting and not sampling.all_greedy else None
        rows, cont = inputs[0], inputs[3].bool()
        seq_lens = torch.where(cont, self.row_s[0, rows], inputs[1])
        pos0 = torch.where(cont, self.row_s[1, rows], inputs[2])
        accept_len, verified = spec_step_device(self.worker, inline_phase, rows, seq_lens, pos0, max_seq_len,
                                                sampling, draft_sampling)
        self.row_s[:, rows] = torch.stack((seq_lens, pos0)) + (accept_len + 1)[None, :]  # (padded rows: the dummy's)
        return torch.cat((accept_len[:, None], verified), dim=1)
