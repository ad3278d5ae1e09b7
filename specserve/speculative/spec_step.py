"""The device side of a speculative step (DESIGN §1), and the runner that captures all of it as one CUDA graph.

`spec_step_device` is the step from the running rows' page-table rows and sequence lengths to the accepted tokens:

    draft decode (N-1 chained steps) -> target verify (N+1 tokens) -> accept -> recurrent-state commit
    -> token history -> draft extend (fixed width N+1) -> per-row state (next d1, draft hidden, last token)

Each phase goes through `phase(name, live)`. The worker (speculative/worker.py) passes the phase runners' `run`,
so every phase replays its own graph with the host glue in between (any batch, any sampling).

`SpecStepRunner` captures the same function once more, end to end, with each phase's `forward_phase` inlined, as
one graph per padded batch size. A step then costs the host one small input copy, one replay and the one output
copy that reads the accepted tokens: no host work between the phases, and the GPU starts on the step as soon as the
inputs land. It uses the phase runners' own attention backends (and their graph metadata buffers) and their padding
contract (graphs/padding.py stage_step). Three sets of graphs: greedy batches (argmax acceptance), and batches with
sampled rows (rejection sampling with per-row temperature, top-k, top-p, min-p and seeds as static graph inputs;
greedy rows of a mixed batch stay greedy), with and without the top-k / top-p / min-p filter (layers/sampler.py,
per verified position; skipped when no row filters). All three share one graph memory pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specserve.graphs.padding import LiveInputs
from specserve.graphs.step_graph import StepGraphRunner
from specserve.layers.sampler import GREEDY, SamplingBatch, probs_from_logits, sample
from specserve.speculative.accept import one_hot_dist, verify_greedy, verify_sampling, verify_sampling_q

if TYPE_CHECKING:
    from specserve.speculative.worker import PlainStepView, SpecWorker

PhaseFn = Callable[[str, LiveInputs], dict[str, torch.Tensor]]


def spec_step_device(w: SpecWorker, phase: PhaseFn, rows: torch.Tensor, s: torch.Tensor, pos0: torch.Tensor,
                     max_s: int, sb: SamplingBatch, draft_sb: SamplingBatch | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step for page-table rows [bs] whose committed sequences have length S = s [bs] (the last
    token, not yet in the KV, sits at index S); pos0 [bs] is the rope position of index S; max_s bounds s.

    Returns (accept_len [bs] in 0..N, verified [bs, N+1]): the tokens at S+1..S+accept_len+1 are new. No host
    sync. N >= 1 (the plain step with no drafts is plain_step_device).

    draft_sb: sb again when the draft phases run inline (the one-graph step) and draw sampled rows' drafts from the
    head's distribution (--speculative-draft-sampling sample); None: deterministic drafts. With sampled drafting on
    (the row state keeps d1's distribution) a sampled batch verifies with the draft distributions (one-hot where a
    draft was deterministic: the phases' own graphs, context lookup, prefill)."""
    n = w.num_steps
    bs = rows.shape[0]
    dev = rows.device
    row_state = w.state
    q_mode = row_state.sampled_drafting and not sb.all_greedy

    # 1. draft decode: d2..dN from (g, d1) at sequence indices S .. S+N-2
    d1 = row_state.draft_token[rows]  # [bs]
    if n > 1:
        live = LiveInputs(bs, d1, pos0, rows, s + 1, max_s + n - 1, hidden=row_state.draft_hidden[rows],
                          draft_sampling=draft_sb)
        dd = phase("draft_decode", live)
        more = dd["tokens"]  # [bs, N-1]
        drafts = torch.cat((d1[:, None], more), dim=1)  # [bs, N]
    else:
        drafts = d1[:, None]  # [bs, 1]

    # 2. target verify over [last, d1..dN] at sequence indices S..S+N
    width = n + 1
    offs = torch.arange(width, device=dev)
    verify_ids = torch.cat((w.last_token[rows][:, None], drafts), dim=1).reshape(-1)  # [bs * (N + 1)]
    verify_pos = (pos0[:, None] + offs[None, :]).reshape(-1)
    out = phase("target_verify", LiveInputs(bs, verify_ids, verify_pos, rows, s + width, max_s + width))
    logits, hidden = out["logits"], out["hidden"]  # [bs, width, V], [bs, width, F]

    # 3. accept
    if sb.all_greedy:
        accept_len, verified = verify_greedy(drafts, logits)
    else:
        probs = probs_from_logits(logits.reshape(bs * width, -1), sb.repeat(width)).view(bs, width, -1)
        if q_mode:  # the distributions the drafts were drawn from: d1's kept from the last step, then the loop's
            q_ids, q_probs = [row_state.q_ids[rows][:, None]], [row_state.q_probs[rows][:, None]]  # [bs, 1, K]
            if n > 1:
                more_ids, more_probs = ((dd["q_ids"], dd["q_probs"]) if "q_ids" in dd
                                        else one_hot_dist(more, row_state.q_ids.shape[1]))  # [bs, N-1, K]
                q_ids.append(more_ids)
                q_probs.append(more_probs)
            accept_len, verified = verify_sampling_q(drafts, probs, torch.cat(q_ids, dim=1), torch.cat(q_probs, dim=1),
                                                     sb.seeds, s)
        else:
            accept_len, verified = verify_sampling(drafts, probs, sb.seeds, s)

    if w.target_state is not None:  # the accept commit: the state after the last accepted token is current
        w.target_state.commit(w.target_state.row_state[rows], accept_len)

    if row_state.tokens is not None:  # token history for context lookup: verified tokens at S+1..S+N+1
        row_state.tokens[rows[:, None], s[:, None] + 1 + offs[None, :]] = verified

    # 4. draft extend over the same N+1 positions with the verified tokens, row accept_len -> next d1, g
    live = LiveInputs(bs, verified.reshape(-1), verify_pos, rows, s + width, max_s + width, accept_len=accept_len,
                      hidden=hidden.reshape(bs * width, -1), draft_sampling=draft_sb)
    ext = phase("draft_extend", live)
    if q_mode:
        row_state.set_d1(rows, ext["tokens"], (ext["q_ids"], ext["q_probs"]) if "q_ids" in ext else None)
    else:
        row_state.draft_token[rows] = ext["tokens"]
    row_state.draft_hidden[rows] = ext["hidden"].to(row_state.draft_hidden.dtype)
    w.last_token[rows] = verified[torch.arange(bs, device=dev), accept_len]
    return accept_len, verified


def plain_step_device(v: PlainStepView, phase: PhaseFn, rows: torch.Tensor, s: torch.Tensor, pos0: torch.Tensor,
                      max_s: int, sb: SamplingBatch) -> torch.Tensor:
    """A speculating engine's plain step (adaptive speculation) for page-table rows [bs] of committed length S = s
    [bs] (pos0 [bs]: the rope position of index S): the target's width-1 verify pass over the last token, the token
    plain decoding samples (same noise) -> tokens [bs] at index S + 1. No draft forward: the target's features at S
    and the new token are kept for the worker's catch-up (speculative/draft_lag.py). As lean as a plain engine's
    step (graphs/step_graph.py PlainStepRunner) plus the lag's two writes, the token history and the recurrent
    commit where they exist."""
    out = phase("target_verify", LiveInputs(rows.shape[0], v.last_token[rows], pos0, rows, s + 1, max_s + 1))
    tokens = sample(out["logits"][:, 0], sb, s + 1)  # [bs]
    v.last_token[rows] = tokens
    if v.target_state is not None:  # the state after S (the verify pass's slot 0) is current
        v.target_state.commit(v.target_state.row_state[rows], torch.zeros_like(rows))
    if v.state.tokens is not None:  # context lookup's token history
        v.state.tokens[rows, s + 1] = tokens
    v.lag.record(rows, s, out["hidden"][:, 0], tokens)
    return tokens


class SpecStepRunner(StepGraphRunner):
    """The speculative step as one graph per captured batch size and sampling kind (CPU: the same function run
    eagerly over the static inputs, as the phase runners' static replay; graphs/step_graph.py). Output:
    [bs, 1 + N + 1] = accept_len, verified. (PlainSpecStepRunner below is the speculating engine's plain step.)

    Each step also leaves every row's next S and rope position in `row_s` [2, page-table rows], so that the overlap
    schedule can launch a row's next step before the host has read this one's accept lengths: rows flagged as
    continuing take S from there instead of the staged inputs (engine/overlap.py)."""

    name = "spec_step"

    def __init__(self, worker: SpecWorker, capture_bs: list[int], use_graphs: bool):
        verify_ctx = worker.runners["target_verify"].ctx
        # the target's vocabulary: it is what is sampled
        super().__init__(capture_bs, use_graphs, verify_ctx.device, verify_ctx.model.config.vocab_size,
                         verify_ctx.graph_max_seq_len, worker.num_steps + 1)
        self.worker = worker
        self.row_s = torch.zeros((2, worker.ctx.req_to_token.table.shape[0]), dtype=torch.int64,
                                 device=verify_ctx.device)  # [S, rope position of S] after each row's last step

    def forward(self, inputs: torch.Tensor, max_s: int, sb: SamplingBatch = GREEDY) -> torch.Tensor:
        """inputs [4, pbs] (rows, S, rope position of S, continuing flags) -> [pbs, N + 2]; each phase's forward
        with its runner's graph-mode backends. sb: GREEDY, or the static sampling buffers' batch. max_s bounds
        the staged and the continuing rows' S alike (the graphs' bound)."""
        runners = self.worker.runners

        def phase(name: str, live: LiveInputs) -> dict[str, torch.Tensor]:
            # 1-D text positions also for mRoPE models, which read them as three equal rows (as prefill does)
            r = runners[name]
            return r.forward_phase(live, r.backends, graph_mode=True)

        draft_sb = sb if self.worker.state.sampled_drafting and not sb.all_greedy else None
        rows, cont = inputs[0], inputs[3].bool()
        s = torch.where(cont, self.row_s[0, rows], inputs[1])
        pos0 = torch.where(cont, self.row_s[1, rows], inputs[2])
        accept_len, verified = spec_step_device(self.worker, phase, rows, s, pos0, max_s, sb, draft_sb)
        self.row_s[:, rows] = torch.stack((s, pos0)) + (accept_len + 1)[None, :]  # (padded rows: the dummy row's)
        return torch.cat((accept_len[:, None], verified), dim=1)


class PlainSpecStepRunner(StepGraphRunner):
    """The speculating engine's plain step (plain_step_device) as one graph per captured batch size and sampling
    kind, over a worker's PlainStepView (the target's width-1 verify runner) -> tokens [pbs]."""

    name = "plain_spec_step"

    def __init__(self, view: PlainStepView, capture_bs: list[int], use_graphs: bool):
        ctx = view.runners["target_verify"].ctx
        super().__init__(capture_bs, use_graphs, ctx.device, ctx.model.config.vocab_size, ctx.graph_max_seq_len, 1)
        self.view = view

    def forward(self, inputs: torch.Tensor, max_s: int, sb: SamplingBatch = GREEDY) -> torch.Tensor:
        r = self.view.runners["target_verify"]
        return plain_step_device(self.view, lambda name, live: r.forward_phase(live, r.backends, graph_mode=True),
                                 inputs[0], inputs[1], inputs[2], max_s, sb)
