"""The speculative worker: the one owner of speculation (docs/architecture.md).

It owns the draft model, the draft's caches (its own pools on the shared page table), the draft runners (draft
decode, draft extend, the draft's prefill), the draft state (d1, draft hidden, token history, context lookup) and
the spec step, whole-step graph included. The scheduler's steps (engine/steps.py) call it with host lists of the
running rows; it borrows the target's verify runner and the target's last-token row state from the model runner.

Per step, for the whole running batch:

    draft decode (N-1 steps, one graph) -> target verify (N+1 tokens, one graph) -> accept (device, no sync)
    -> draft extend (fixed width N+1, one graph) -> one host sync to read the accepted tokens.

Batches that fit the captured sizes, greedy, sampled or mixed, run all of it as one graph (spec_step.SpecStepGraph,
`spec_step_graph`); larger ones run the phases' own graphs (`phases`) with the glue in between (spec_step_device).

With adaptive speculation (engine/adaptive_spec.py) the worker also takes plain steps (speculative/plain_step.py):
the target alone over the last token (its width-1 verify pass, features kept), plain sampling: a plain engine's
step, as one graph (`plain_step_graph`). The draft runs no forward in a plain step, so that a plain step costs what a
plain engine's does; it lags one position per plain step, the target's features and the sampled token kept for it
(speculative/draft_lag.py), and catches up over all of them in one prefill forward before the next speculative step
(`catch_up`): the same draft KV, d1 and draft hidden state as if it had followed every plain step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.batch import CacheKind, ForwardMode
from specserve.graphs.padding import ExtendBatch
from specserve.graphs.phase_runners import PlainVerifyRunner, RunnerContext, TargetVerifyRunner, replay_phase
from specserve.graphs.prefill import PrefillRunner
from specserve.graphs.step_hidden import StepHidden
from specserve.kvcache.caches import ModelCaches
from specserve.kvcache.state_pool import StatePool
from specserve.layers.sampler import SamplingBatch
from specserve.speculative.draft_lag import DraftLag
from specserve.speculative.draft_runners import DraftDecodeRunner, DraftExtendRunner
from specserve.speculative.draft_state import DRAFT_CANDIDATES, DraftChooser, DraftState
from specserve.speculative.plain_step import PlainStepContext, PlainStepGraph, plain_step_device
from specserve.speculative.spec_step import LogitAdjust, SpecPhases, SpecStepGraph, spec_step_device


@dataclass
class SpecStepResult:
    accept_len: list[int]  # accepted drafts per request (0..N)
    tokens: list[list[int]]  # the accept_len + 1 new tokens per request

    @staticmethod
    def parse(res: list[list[int]]) -> SpecStepResult:
        """A step's output rows [accept_len, verified N + 1 tokens] read back."""
        return SpecStepResult([r[0] for r in res], [r[1:r[0] + 2] for r in res])


@dataclass(kw_only=True)
class WorkerSettings:
    num_steps: int  # N draft tokens per step
    capture_bs: list[int]
    use_graphs: bool
    spec_step_graph: bool  # the greedy step as one graph (--disable-spec-step-graph turns it off)
    ngram_lookup: bool
    lookup_confidence: float
    prefill_graph_tokens: int  # largest prefill batch run as a graph (0: eager)
    prefill_graph_rows: int
    prefill_graph_attended: int | None = None  # PrefillRunner max_attended (MLA: token rows walk whole prefixes)
    kind_dtypes: dict = field(default_factory=dict)  # cache kinds kept in another dtype (fp8 indexer keys)
    # sampled rows' drafts drawn from the head's own distribution in the one-graph step (verified with
    # min(1, p/q) and the residual max(0, p - q)); False: the head's argmax (a one-hot draft)
    draft_sampling: bool = False
    # where each step keeps the target's hidden states (--enable-return-hidden-states; None: nowhere)
    step_hidden: StepHidden | None = None


class SpecWorker:
    def __init__(self, draft: torch.nn.Module, target_ctx: RunnerContext, target_verify: TargetVerifyRunner,
                 last_token: torch.Tensor, target_state: StatePool | None, num_slots: int, kv_dtype: torch.dtype,
                 make_backends: Callable[[ModelCaches], Callable[[], dict]], settings: WorkerSettings,
                 plain_verify: PlainVerifyRunner | None = None):
        """draft: the MTP/EAGLE model; target_ctx, target_verify: the target's runner context and verify runner
        (owned by the model runner); last_token [rows]: the target's per-row newest token (shared); target_state:
        the target's recurrent-state pool (None without recurrent layers), whose current slots the accept commit
        sets; num_slots: token slots of each draft pool (sized with the target's from one budget);
        make_backends(caches): the backend factory over a set of caches; plain_verify: the target's width-1 verify
        runner (owned by the model runner) for plain steps, or None when the worker always speculates."""
        self.draft = draft
        self.num_steps = settings.num_steps
        self.device = target_ctx.device
        self.last_token = last_token
        self.target_state = target_state
        self.step_hidden = settings.step_hidden
        specs = draft.cache_specs()
        if any(spec.kind is CacheKind.RECURRENT for spec in specs):
            raise ValueError("draft models with recurrent layers are not supported (the MTP block is attention)")
        self.caches = ModelCaches(specs, num_slots, kv_dtype, self.device, kind_dtypes=settings.kind_dtypes)
        rows = target_ctx.req_to_token.table.shape[0]
        row_width = target_ctx.req_to_token.width
        # a spec step writes its N + 1 verified tokens at S+1..S+N+1: one column beyond the page-table row
        # candidates of a sampled draft's distribution (None: drafts are deterministic)
        k = min(DRAFT_CANDIDATES, draft.draft_vocab_size()) if settings.draft_sampling else None
        self.state = DraftState.allocate(rows, target_ctx.hidden_size, target_ctx.dtype, self.device,
                                         row_width + 1 if settings.ngram_lookup else None, k)
        self.chooser = DraftChooser(draft, self.state.tokens, settings.lookup_confidence, k or DRAFT_CANDIDATES)
        self.ctx = RunnerContext(draft, target_ctx.req_to_token, make_backends(self.caches), self.device,
                                 target_ctx.hidden_size, target_ctx.dtype, target_ctx.mrope,
                                 target_ctx.graph_max_seq_len)
        n = settings.num_steps
        capture_bs, use_graphs = settings.capture_bs, settings.use_graphs
        self.phases = SpecPhases(
            draft_decode=DraftDecodeRunner(self.ctx, self.chooser, n - 1, capture_bs, use_graphs) if n > 1 else None,
            target_verify=target_verify,
            draft_extend=DraftExtendRunner(self.ctx, self.chooser, n + 1, capture_bs, use_graphs))
        self.spec_step_graph = SpecStepGraph(self, capture_bs, use_graphs) if settings.spec_step_graph else None
        self.plain_step_ctx: PlainStepContext | None = None  # None: this worker always speculates
        self.lag: DraftLag | None = None  # the draft's pending positions after plain steps
        # catch-up forwards (before a spec step, or forced by a full lag) and the positions they extended over
        self.catch_ups = {"before_spec": 0, "forced": 0, "positions": 0}
        # this step's catch-ups: (seconds, rows, positions); on CUDA, each catch-up's start and end events, read
        # when the step is (take_catch_up), so that timing a catch-up costs no host sync
        self._caught: tuple[float, int, int] | None = None
        self._caught_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.time_catch_ups = False  # set by a scheduler whose adaptive speculation takes them (take_catch_up)
        self.plain_step_graph: PlainStepGraph | None = None
        if plain_verify is not None:
            self.lag = DraftLag.allocate(rows, draft.feature_size, target_ctx.dtype, self.device)
            self.plain_step_ctx = PlainStepContext(self.state, last_token, target_state, plain_verify, self.lag,
                                                   settings.step_hidden)
            if settings.spec_step_graph:
                self.plain_step_graph = PlainStepGraph(self.plain_step_ctx, capture_bs, use_graphs)
        self.prefill = PrefillRunner(self.ctx, ForwardMode.DRAFT_EXTEND, settings.prefill_graph_tokens,
                                     settings.prefill_graph_rows, use_graphs, hidden_width=draft.feature_size,
                                     max_attended=settings.prefill_graph_attended)

    # ------------------------------------------------------------------ graphs
    def graph_runners(self) -> list:
        """The runners this worker captures (the target's verify runner is the model runner's to capture)."""
        steps = [g for g in (self.spec_step_graph, self.plain_step_graph) if g is not None]
        return self.phases.draft_runners() + steps + [self.prefill]

    # ------------------------------------------------------------------ prefill
    def record_tokens(self, rows: torch.Tensor, cols: torch.Tensor, tokens: torch.Tensor) -> None:
        """Context lookup's token history: tokens [T] at (rows, cols) [T] (a no-op when lookup is off)."""
        if self.state.tokens is not None:
            self.state.tokens[rows, cols] = tokens

    def prefill_draft(self, batch: ExtendBatch, shifted: torch.Tensor, target_hidden: torch.Tensor,
                      final_idx: torch.Tensor | None, final_rows: torch.Tensor | None,
                      final_pos: torch.Tensor | None, input_embeds: torch.Tensor | None = None) -> None:
        """Draft extend over a prefill batch's positions: input at position p is (target features at p, token p+1)
        (`shifted` [T]: each chunk shifted left by one, its next prompt token or t0 appended), which fills the draft
        KV; for final chunks (token index final_idx [F] of rows final_rows [F] whose committed tokens end at
        final_pos [F]) it sets d1 and the draft hidden state. The rows' lag starts over (a new sequence, or the
        catch-up's own positions). input_embeds [T, H]: the draft's input embeddings of a batch with image requests
        (the image tokens' rows from the vision encoder, engine/steps.py image_embeds), None for text."""
        if self.lag is not None:
            self.lag.clear(batch.rows)
        dh = self.prefill.run(ExtendBatch(shifted, batch.positions, batch.out_cache_loc, batch.rows, batch.seq_lens,
                                          batch.extend_lens, target_hidden, input_embeds))  # [T, H]
        if final_idx is None:
            return
        last = dh[final_idx]
        # d1 after a prompt is the head's argmax (one-hot): prefill does not carry the rows' sampling
        self.state.set_d1(final_rows, self.chooser.draft_tokens(last, self.chooser.history_rows(final_rows),
                                                                final_pos), None)
        self.state.draft_hidden[final_rows] = self.draft.chained(last).to(self.state.draft_hidden.dtype)

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def step(self, rows_host: list[int], seq_lens_host: list[int], pos0_host: list[int],
             sampling: SamplingBatch, adjust: LogitAdjust | None = None) -> SpecStepResult:
        """One speculative step for the running rows (page-table rows, committed lengths S, rope positions of S);
        rows that plain steps left the draft behind on catch up first. adjust: the rows' logit rules
        (engine/logit_rules.py), applied to the verify logits along the draft path (phase by phase)."""
        self.catch_up(rows_host, seq_lens_host, pos0_host, "before_spec")
        graph = self.spec_step_graph
        if graph is not None and adjust is None and graph.covers(len(rows_host), sampling):
            out = graph.run(rows_host, seq_lens_host, pos0_host, sampling)
        else:
            rows, seq_lens, pos0 = _step_inputs(rows_host, seq_lens_host, pos0_host, self.device)
            accept_len, verified = spec_step_device(self, replay_phase, rows, seq_lens, pos0, max(seq_lens_host),
                                                    sampling, adjust=adjust)
            out = torch.cat((accept_len[:, None], verified), dim=1)
        # the one host sync of the step: accept lengths and verified tokens in one copy
        return SpecStepResult.parse(out.tolist())

    def can_launch(self, rows_host: list[int], sampling: SamplingBatch) -> bool:
        """Whether a step for these rows can be launched without reading anything back first (launch): it runs as
        the one graph, and no row lags behind (a catch-up needs the host's S)."""
        graph = self.spec_step_graph
        return (graph is not None and graph.covers(len(rows_host), sampling)
                and (self.lag is None or not self.lag.lagging(rows_host)))

    @torch.inference_mode()
    def launch(self, rows_host: list[int], seq_lens_host: list[int], pos0_host: list[int], sampling: SamplingBatch,
               cont: list[bool]) -> torch.Tensor:
        """The one-graph step of `step` for rows that can_launch, left on the device: -> [bs, 1 + N + 1] (accept
        lengths, verified tokens; the graph's output: copy it before the next step). Rows flagged in cont take S and
        its rope position from their previous one-graph step on the device (their seq_lens_host: a bound,
        S + N + 1)."""
        return self.spec_step_graph.run(rows_host, seq_lens_host, pos0_host, sampling, cont)

    def can_launch_plain(self, rows_host: list[int], sampling: SamplingBatch) -> bool:
        """Whether a plain step for these rows can be launched without reading anything back first (launch_plain):
        it runs as the one graph, and no row's lag is full (a forced catch-up needs the host's S)."""
        graph = self.plain_step_graph
        return (graph is not None and graph.covers(len(rows_host), sampling) and self.plain_step_ctx is not None
                and not self.plain_step_ctx.lag.full(rows_host))

    @torch.inference_mode()
    def launch_plain(self, rows_host: list[int], seq_lens_host: list[int], pos0_host: list[int],
                     sampling: SamplingBatch) -> torch.Tensor:
        """The one-graph plain step of `plain_step` for rows that can_launch_plain, left on the device: -> tokens
        [bs] (the graph's output: copy it before the next step). The draft lags one more position."""
        tokens = self.plain_step_graph.run(rows_host, seq_lens_host, pos0_host, sampling)
        self.plain_step_ctx.lag.advance(rows_host)
        return tokens

    @torch.inference_mode()
    def plain_step(self, rows_host: list[int], seq_lens_host: list[int], pos0_host: list[int],
                   sampling: SamplingBatch, adjust: LogitAdjust | None = None) -> SpecStepResult:
        """One plain step for the running rows (accept_len 0, one token each): the token is the one plain decoding
        samples (same noise), so a plain step is lossless by construction. The draft lags one more position (a row
        at the lag's capacity catches up first). adjust: the rows' logit rules (phase by phase)."""
        ctx = self.plain_step_ctx
        if ctx is None:
            raise RuntimeError("plain steps need the target's width-1 runner (adaptive speculation is off)")
        if ctx.lag.full(rows_host):
            self.catch_up(rows_host, seq_lens_host, pos0_host, "forced")
        if adjust is None and self.can_launch_plain(rows_host, sampling):
            tokens = self.launch_plain(rows_host, seq_lens_host, pos0_host, sampling)  # [bs]
        else:
            rows, seq_lens, pos0 = _step_inputs(rows_host, seq_lens_host, pos0_host, self.device)
            tokens = plain_step_device(ctx, replay_phase, rows, seq_lens, pos0, max(seq_lens_host), sampling,
                                       adjust)
            ctx.lag.advance(rows_host)
        new_tokens = tokens.tolist()  # the step's one host sync
        return SpecStepResult([0] * len(new_tokens), [[t] for t in new_tokens])

    @torch.inference_mode()
    def catch_up(self, rows_host: list[int], seq_lens_host: list[int], pos0_host: list[int], why: str = "before_spec"
                 ) -> None:
        """The draft's extend over the positions plain steps left it behind on, for the rows that lag (page-table
        rows, committed lengths S, rope positions of S): a row L behind gets positions S-L..S-1, each with the
        target's features kept there and the token that followed, in one prefill forward (the worker's prefill
        runner: graphs up to its size). That fills the draft KV there and sets d1 and the draft hidden state from
        the last one, as a prefill of the same tokens would (d1 the head's argmax, one-hot)."""
        lag = self.lag
        picked = [] if lag is None else lag.lagging(rows_host)
        if not picked:
            return
        t0 = time.perf_counter()
        events = None
        if self.device.type == "cuda" and self.time_catch_ups:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        rows = [rows_host[i] for i in picked]
        lens = [lag.pending[r] for r in rows]
        self.catch_ups[why] += 1
        self.catch_ups["positions"] += sum(lens)
        for group in catch_up_groups(lens, self.prefill.max_tokens, self.prefill.max_rows):
            self._catch_up_rows([picked[j] for j in group], [lens[j] for j in group], rows_host, seq_lens_host,
                                pos0_host)
        # timed apart for adaptive speculation (take_catch_up): by events on CUDA (no sync), by the clock on a CPU
        # (which computes as it launches)
        secs = 0.0
        if events is not None:
            events[1].record()
            self._caught_events.append(events)
        else:
            secs = time.perf_counter() - t0
        prev = self._caught or (0.0, 0, 0)
        self._caught = (prev[0] + secs, prev[1] + len(rows), prev[2] + sum(lens))

    def _catch_up_rows(self, picked: list[int], lens: list[int], rows_host: list[int], seq_lens_host: list[int],
                       pos0_host: list[int]) -> None:
        """One prefill forward of the draft over the lagging positions of the rows picked (indices into the step's
        rows), lens[j] positions each."""
        lag = self.lag
        rows = [rows_host[i] for i in picked]
        ends = [seq_lens_host[i] for i in picked]
        flat_rows, seq_idx, pos = [], [], []
        for i, r, n in zip(picked, rows, lens):
            flat_rows += [r] * n
            seq_idx += range(seq_lens_host[i] - n, seq_lens_host[i])
            pos += range(pos0_host[i] - n, pos0_host[i])
        idx = torch.tensor([flat_rows, seq_idx, pos], dtype=torch.int64).to(self.device, non_blocking=True)
        flat_r, col = idx[0], idx[1] % lag.capacity
        ids = lag.tokens[flat_r, col]  # [T]
        hidden = lag.hidden[flat_r, col]  # [T, F]
        out_loc = self.ctx.req_to_token.table[flat_r, idx[1]]
        tail = torch.tensor([rows, ends], dtype=torch.int64).to(self.device, non_blocking=True)
        final_idx = torch.cumsum(torch.tensor(lens, device=self.device), 0) - 1
        self.prefill_draft(ExtendBatch(ids, idx[2], out_loc, rows, ends, lens, hidden), ids, hidden, final_idx,
                           tail[0], tail[1])

    def take_catch_up(self) -> tuple[float, int, int] | None:
        """The catch-ups run since the last call, as (seconds, rows, positions) summed; None if none ran."""
        caught, self._caught = self._caught, None
        if caught is not None and self._caught_events:  # the step was read: its catch-ups' events are done
            self._caught_events[-1][1].synchronize()  # (a no-op then; a wait if a caller reads before the step)
            secs = sum(a.elapsed_time(b) for a, b in self._caught_events) / 1e3
            caught = (caught[0] + secs, caught[1], caught[2])
        self._caught_events = []
        return caught


def catch_up_groups(lens: list[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """The lagging rows (lens[j] positions each) in consecutive groups of at most max_tokens positions and max_rows
    rows, so that each catch-up forward fits the draft's largest prefill graph (a row longer than max_tokens goes
    alone); without prefill graphs (max_tokens 0) one group, one eager forward. -> groups of indices into lens, in
    order."""
    if max_tokens <= 0:
        return [list(range(len(lens)))] if lens else []
    groups: list[list[int]] = []
    total = 0
    for j, n in enumerate(lens):
        if groups and total + n <= max_tokens and len(groups[-1]) < max(1, max_rows):
            groups[-1].append(j)
            total += n
        else:
            groups.append([j])
            total = n
    return groups


def _step_inputs(rows_host: list[int], seq_lens_host: list[int], pos0_host: list[int],
                 dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's page-table rows, committed lengths S and rope positions of S [bs] each, on the device in one copy."""
    rows, seq_lens, pos0 = torch.tensor([rows_host, seq_lens_host, pos0_host], dtype=torch.int64).to(
        dev, non_blocking=True)
    return rows, seq_lens, pos0
