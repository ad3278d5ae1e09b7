"""Continuous-batching scheduler: admission by KV budget, chunked prefill, decode steps, retraction.

Policy, per step: if a prompt is waiting (or half prefilled) and fits, run one prefill batch of at most
`--chunked-prefill-size` tokens; otherwise run one decode step for every running request, of the kind and in the
way engine/decode_plan.py decides. When the pool cannot hold the next step, the newest running requests are retracted
(KV freed, re-queued at the front with their outputs kept, re-prefilled later). Nothing is dropped and the engine
never crashes on memory. Admission is growth-aware (engine/admission.py), so that retraction stays the exception.

The names of the steps and their parts (decode step, speculative step, plain step, phase, step graph, S) are
defined once, in engine/decode_plan.py's glossary; the scheduler's invariant is the comment above `Scheduler`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from specserve.engine.adaptive_spec import AdaptiveSpeculation
from specserve.engine.admission import Admission
from specserve.engine.decode_plan import DecodePlan, StepKind, plan_decode, step_kind
from specserve.engine.hidden_states import record_hidden
from specserve.engine.model_runner import ModelRunner
from specserve.engine.overlap import InFlightDecode, TokenReadback
from specserve.engine.request import Req, ReqState
from specserve.engine.steps import (
    Chunk,
    launch_decode,
    launch_prefill,
    prefill_reads_logits,
    run_decode,
    run_plain_step,
    run_prefill,
    run_spec_step,
)
from specserve.engine.stop import StopChecker
from specserve.engine.tp_ranks import TPLeader, decode_message, prefill_message
from specserve.kvcache.prefix_stats import PrefixCacheStats
from specserve.layers.sampler import SamplingBatch
from specserve.speculative.worker import SpecStepResult

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    num_overlapped_steps: int = 0  # decode steps launched before the previous one's tokens were read
    num_overlapped_prefills: int = 0  # prefills launched so (overlap schedule), their t0 read with the next step
    num_retractions: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    spec_plain_steps: int = 0  # plain steps a speculating engine took (adaptive speculation)
    finished: int = 0
    recent_accept: deque = field(default_factory=lambda: deque(maxlen=256))

    @property
    def spec_accept_length(self) -> float:
        if not self.spec_verify_ct:
            return 0.0
        return (self.spec_accepted_drafts + self.spec_verify_ct) / self.spec_verify_ct


@dataclass
class OverlapBatch:
    """The running requests an overlapped decode step takes (those the step in flight cannot finish by length),
    with, for a speculating engine's step, their page-table rows and sampling."""

    reqs: list[Req]
    rows: list[int] = field(default_factory=list)
    sampling: SamplingBatch | None = None


# The scheduler's invariant, true between two step() calls:
# - A running request's seq_len (S) counts its committed tokens, whose KV is written (the draft's: but for the
#   positions plain steps left it behind on, speculative/draft_lag.py); output_ids holds every token the host has
#   read, no more. With no step in flight, the model runner's last_token row holds the token at index S.
# - At most one step is in flight (self._inflight, under the overlap schedule only), its output copy queued; the
#   device is then ahead of the host. A decode or plain step in flight has already advanced its requests' seq_len
#   by one (their tokens unread); a speculative step in flight has not (its accept lengths are unread; its rows'
#   next S waits on the device, SpecStepGraph.row_s); a prefill in flight has made its final chunks' requests
#   running, their t0 unread. A request that a token read later finishes drops the tokens of steps launched since.
# - A running request holds the pages of its committed tokens and of the step in flight; each step reserves its own
#   pages before it runs, and only a synchronous step (every token read) may retract a request to find them.
class Scheduler:
    def __init__(self, model_runner: ModelRunner, stop_checker: StopChecker, chunked_prefill_size: int,
                 overlap: bool | None = None):
        """overlap: launch each decode step before reading the previous one's output (engine/overlap.py); None: on
        a GPU unless --disable-overlap-schedule, on a CPU (which computes as it launches: nothing to hide) with
        --enable-overlap-schedule, and on one rank only (a tensor-parallel engine steps synchronously)."""
        self.model_runner = model_runner
        self.stop = stop_checker
        self.n = model_runner.num_steps  # N drafts a speculative step (0: a plain engine)
        self.waiting: deque[Req] = deque()
        self.prefilling: Req | None = None  # at most one request is half prefilled
        self.compiling: list[Req] = []  # requests whose grammar compiles (engine/grammar.py), queued once it has
        self.running: list[Req] = []
        # a prefill step was the last step: running requests decode next, so a long prompt's chunks (or a burst of
        # new prompts) pause them by at most one prefill step (--chunked-prefill-size tokens) at a time
        self.decode_owed = False
        self.reqs: dict[str, Req] = {}
        self.stats = SchedulerStats()
        spec = model_runner.spec
        # speculate or take a plain step, per step (engine/adaptive_spec.py); any object with choose_plain(bs) and
        # record(bs, plain, seconds, tokens_per_request, catch_up, steady) may stand in (tests force patterns)
        self.adaptive = (AdaptiveSpeculation(max_period=spec.lag.capacity)
                         if spec is not None and model_runner.adaptive_spec else None)
        # batches with logit rules step phase by phase with the host between draft and verify, and their drafts
        # fare differently under a grammar: their costs and accept rates are learnt apart
        self.adaptive_ruled = (AdaptiveSpeculation(max_period=spec.lag.capacity)
                               if self.adaptive is not None else None)
        if self.adaptive is not None:
            spec.time_catch_ups = True
        # rank 0 of a tensor-parallel engine: each step is broadcast to the other ranks first (engine/tp_ranks.py)
        self.tp_leader: TPLeader | None = None
        self.initial_free_pages = model_runner.allocator.num_free_pages
        self.admission = Admission(model_runner, self.n,
                                   chunked_prefill_size if chunked_prefill_size > 0 else model_runner.context_len,
                                   model_runner.args.schedule_conservativeness)
        self._touched: dict[str, Req] = {}  # requests changed since the last step() returned
        if overlap is None:
            args = model_runner.args
            overlap = ((model_runner.device.type == "cuda" or args.enable_overlap_schedule)
                       and not args.disable_overlap_schedule and args.tp_size == 1)
        self.overlap = overlap
        self._readback = (TokenReadback(model_runner.max_running * (self.n + 2), model_runner.device) if overlap
                          else None)
        self._inflight: InFlightDecode | None = None
        self._last_read = 0.0  # when the last speculative step's output was read
        self._sync_kind: bool | None = None  # the last decode step's kind (plain: True) if it ran synchronously

    # ------------------------------------------------------------------ queue
    def add_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        req.prefill_len = len(req.origin_input_ids)
        self.reqs[req.rid] = req
        if req.sampling.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        if req.grammar_future is not None:
            self.compiling.append(req)
            return
        self.waiting.append(req)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue; one that does not compile finishes
        with the reason (status_code 400: the HTTP process answers it as a bad request)."""
        if not self.compiling:
            return
        if not (self.waiting or self.running or self.prefilling or self._inflight):
            # nothing else to do: wait a moment for a compile rather than spin
            wait_futures([r.grammar_future for r in self.compiling], timeout=0.01, return_when=FIRST_COMPLETED)
        for req in [r for r in self.compiling if r.grammar_future.done()]:
            self.compiling.remove(req)
            future, req.grammar_future = req.grammar_future, None
            try:
                req.rules.grammar = future.result()
            except ValueError as e:
                self._finish(req, {"type": "abort", "message": str(e), "status_code": 400})
                continue
            self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return None
        self._finish(req, {"type": "abort", "message": "aborted"})
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling or self._inflight or self.compiling)

    @property
    def in_flight(self) -> bool:
        """Whether a launched step (the overlap schedule's) awaits its read: its tokens come with the next step()."""
        return self._inflight is not None

    @property
    def num_running(self) -> int:
        return len(self.running) + (1 if self.prefilling else 0)

    @property
    def _overlapping(self) -> bool:
        """Whether steps launch before the step in flight is read (one rank: a tensor-parallel leader broadcasts
        each step first)."""
        return self.overlap and self.tp_leader is None

    # ------------------------------------------------------------------ step
    def step(self) -> list[Req]:
        """Run one forward step; returns the requests that changed (new tokens or finished). Under the overlap
        schedule a step's tokens come with the next step() (engine/overlap.py)."""
        self._admit_compiled()
        # prefill and decode alternate while requests run (the longest decode pause is one prefill step's tokens)
        chunks = [] if self.decode_owed and self.running else self._schedule_prefill()
        self.decode_owed = bool(chunks)
        if chunks and self._overlapping and not prefill_reads_logits(chunks):
            # launched before the step in flight is read, which is read at once after (its tokens are not held
            # through a chunked prefill); the prefill's t0 come with the next step
            self._launch_prefill(chunks)
        elif chunks:
            self._drain()
            self._run_prefill(chunks)
        elif self.running:
            self._decode()
        elif self._inflight is not None:
            self._drain()
        out = list(self._touched.values())
        self._touched = {}
        for r in out:
            if r.finished:
                self.reqs.pop(r.rid, None)
        return out

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> list[Chunk]:
        chunks, self.prefilling = self.admission.schedule(self.waiting, self.prefilling, self.running)
        return chunks

    def _run_prefill(self, chunks: list[Chunk]) -> None:
        if self.tp_leader is not None:
            self.tp_leader.send(prefill_message(self.model_runner, chunks))
        t0s = run_prefill(self.model_runner, chunks)
        now = time.perf_counter()
        for req, tok in zip(self._prefilled(chunks), [t for t in t0s if t is not None]):
            if req.first_token_time is None:
                req.first_token_time = now
            self._append(req, [tok])

    def _launch_prefill(self, chunks: list[Chunk]) -> None:
        """The overlap schedule's prefill: launched and its requests advanced (_prefilled), then the step in flight
        read; the prefill stays in flight until the next step reads its t0."""
        prev = self._inflight
        t0 = launch_prefill(self.model_runner, chunks)
        final = self._prefilled(chunks)
        self._inflight = None
        if t0 is not None:
            self._inflight = InFlightDecode(final, self._readback.start(t0), prefill=True,
                                            launched=time.perf_counter())
        if prev is not None:
            self.stats.num_overlapped_prefills += 1
            prev.steady = False  # read after the prefill's launch: its time holds the prefill's host work
            self._apply(prev)

    def _prefilled(self, chunks: list[Chunk]) -> list[Req]:
        """A prefill step's bookkeeping: each chunk's request advanced to its end; those whose prompt is done join
        the running ones (returned, in chunk order: the order of their t0)."""
        self.stats.num_prefill_steps += 1
        final = []
        draft = self.n > 0
        for c in chunks:
            c.req.seq_len = c.end
            self.stats.num_prompt_tokens += c.end - c.start
            # the chunk's full pages to the prefix cache (a final chunk's last position: its draft entry is made
            # with t0, unread, so that page waits for the request's end)
            self.model_runner.kv.cache_prefix(c.req.kv, c.req.cache_ids, c.end - (draft and c.is_final), c.end)
            if c.is_final:
                c.req.state = ReqState.RUNNING
                self.running.append(c.req)
                final.append(c.req)
        return final

    # ------------------------------------------------------------------ decode
    def _decode(self) -> None:
        """One decode step for the running requests: its kind and whether it overlaps as plan_decode decides
        (engine/decode_plan.py), then the plan followed."""
        ruled = any(r.needs_host_logits for r in self.running)  # (one pass over the batch a step)
        adaptive = self._adaptive_for(ruled)
        plain = adaptive is not None and adaptive.choose_plain(len(self.running))  # once a step
        plan, batch = self._plan(step_kind(self.n > 0, plain), ruled)
        if plan.overlapped and not self._launch(plan.kind, batch):
            plan = plan.fall_back("the step's pages need a retraction, which needs every token read")
        if plan.overlapped:
            self.admission.after_decode_step(retracted=False)
        else:
            self._step_synchronously(plan.kind)

    def _plan(self, kind: StepKind, ruled: bool) -> tuple[DecodePlan, OverlapBatch | None]:
        """plan_decode over this step's facts, and the batch an overlapped launch would take. ruled: a running
        request carries logit rules or returns logprobs."""
        if not self._overlapping:
            return plan_decode(kind, overlap=False), None
        if ruled:
            return plan_decode(kind, overlap=True, ruled=True), None
        if self.model_runner.step_hidden is not None and any(r.return_hidden_states for r in self.running):
            return plan_decode(kind, overlap=True, reads_hidden=True), None
        prev = self._inflight
        spec_in_flight = prev is not None and prev.spec
        pending = set(prev.reqs) if prev is not None else set()
        reqs = [r for r in self.running if not self._ends_by_length(r, 1 if r in pending else 0)]
        if kind is StepKind.DECODE:
            return plan_decode(kind, overlap=True), OverlapBatch(reqs)
        if spec_in_flight:  # rows the speculative step in flight may bring within reach of the context wait for it
            reqs = [r for r in reqs if r not in pending
                    or len(r.origin_input_ids) + len(r.output_ids) + self.n < self.model_runner.context_len]
        batch = OverlapBatch(reqs)
        one_graph = False
        if reqs:
            spec = self.model_runner.spec
            batch.rows, batch.sampling = [r.kv.row for r in reqs], self.model_runner.decode_sampling.get(reqs)
            one_graph = (spec.can_launch_plain if kind is StepKind.PLAIN else spec.can_launch)(batch.rows,
                                                                                               batch.sampling)
        return plan_decode(kind, overlap=True, batch=bool(reqs), spec_in_flight=spec_in_flight,
                           one_graph=one_graph), batch

    def _launch(self, kind: StepKind, batch: OverlapBatch) -> bool:
        """An overlapped plan followed: the step's pages reserved, the step launched for the batch, then the step in
        flight (if any) read and applied. False (nothing done) when the pages need a retraction."""
        prev = self._inflight
        reqs = batch.reqs
        if not reqs:  # (a plain engine's: every running request ends with the step in flight)
            self._inflight = None
        elif kind is StepKind.DECODE:
            if not self.model_runner.kv.ensure([r.kv for r in reqs], [r.seq_len + 1 for r in reqs]):
                return False
            tokens = self._readback.start(launch_decode(self.model_runner, reqs))
            for r in reqs:
                r.seq_len += 1
            self._inflight = InFlightDecode(reqs, tokens)
        elif not self._launch_spec(kind, batch, prev):
            return False
        if self._inflight is not None and self._inflight is not prev:
            self.stats.num_decode_steps += 1
            self.stats.num_overlapped_steps += prev is not None
            # steady (adaptive speculation averages only such steps' times): launched behind a decode step of its kind
            self._inflight.steady = prev is not None and not prev.prefill and prev.spec == self._inflight.spec
        self._sync_kind = None
        if prev is not None:
            self._apply(prev)
        return True

    def _launch_spec(self, kind: StepKind, batch: OverlapBatch, prev: InFlightDecode | None) -> bool:
        """A speculating engine's step (SPEC or PLAIN) as one graph, without a read first: a speculative step (rows
        continuing from the speculative step in flight take their S from the device) or a plain step (after a plain
        step or none: every S is the host's). False when its pages need a retraction."""
        spec = self.model_runner.spec
        reqs, width = batch.reqs, self.n + 1
        in_flight = set(prev.reqs) if prev is not None and prev.spec else set()
        cont = [r in in_flight for r in reqs]
        seq_lens = [r.seq_len + (width if c else 0) for r, c in zip(reqs, cont)]  # continuing rows: a bound of S
        pos0 = [x + r.mrope_delta for x, r in zip(seq_lens, reqs)]
        if not self.model_runner.kv.ensure([r.kv for r in reqs], [x + width for x in seq_lens]):
            return False
        now = time.perf_counter()
        if kind is StepKind.PLAIN:
            tokens = self._readback.start(spec.launch_plain(batch.rows, seq_lens, pos0, batch.sampling))
            for r in reqs:
                r.seq_len += 1
            self.stats.spec_plain_steps += 1
            self._inflight = InFlightDecode(reqs, tokens, launched=now)
        else:
            out = spec.launch(batch.rows, seq_lens, pos0, batch.sampling, cont)
            self._inflight = InFlightDecode(reqs, self._readback.start(out), spec=True, launched=now)
        return True

    def _step_synchronously(self, kind: StepKind) -> None:
        """A synchronous plan followed: the step in flight read, pages made (retracting if need be), the step run
        and read at once."""
        self._drain()  # retraction and the synchronous steps see every token
        retracted = self.stats.num_retractions
        self._ensure_decode_capacity()
        self.admission.after_decode_step(self.stats.num_retractions > retracted)
        if not self.running:
            return
        self.stats.num_decode_steps += 1
        reqs = list(self.running)
        if kind is StepKind.DECODE:
            self._broadcast(kind, reqs)
            tokens = run_decode(self.model_runner, reqs)
            self._keep_hidden(reqs, (1 for _ in reqs))
            for req, t in zip(reqs, tokens):
                req.seq_len += 1
                self._append(req, [t])
            return
        plain = kind is StepKind.PLAIN
        t0 = time.perf_counter()
        self._broadcast(kind, reqs)
        res = (run_plain_step if plain else run_spec_step)(self.model_runner, reqs)
        now = time.perf_counter()
        adaptive = self._adaptive_for(any(r.needs_host_logits for r in reqs))  # (retraction may have changed them)
        if adaptive is not None:
            caught = self.model_runner.spec.take_catch_up()  # the draft's catch-up inside this step, timed apart
            # steady: the synchronous step before was of the same kind (not a switch, nor the end of overlapped steps)
            adaptive.record(len(reqs), plain, now - t0 - (caught[0] if caught else 0.0),
                            1 + sum(res.accept_len) / len(reqs), caught, steady=self._sync_kind == plain)
        self._sync_kind = plain
        self._last_read = now
        self._keep_hidden(reqs, (k + 1 for k in res.accept_len))
        self._apply_spec(reqs, res, plain)

    def _adaptive_for(self, ruled: bool):
        """The adaptive speculation that steers a batch: the ruled batches' own when a row carries logit rules."""
        return self.adaptive_ruled if ruled and self.adaptive_ruled is not None else self.adaptive

    def _keep_hidden(self, reqs: list[Req], counts: Iterable[int]) -> None:
        """A synchronous step's hidden states at its `counts` committed positions from each row's S, kept for the
        requests that return them (engine/hidden_states.py); called before S advances."""
        step_hidden = self.model_runner.step_hidden
        if step_hidden is None:  # the flag is off: no request returns hidden states, no loop per step
            return
        for req, count in zip(reqs, counts):
            if req.return_hidden_states and not req.finished:
                record_hidden(req, req.seq_len, step_hidden.read(req.kv.row, count))

    def _broadcast(self, kind: StepKind, reqs: list[Req]) -> None:
        """A tensor-parallel leader's step, sent to the other ranks before it runs (engine/tp_ranks.py)."""
        if self.tp_leader is not None:
            self.tp_leader.send(decode_message(self.model_runner, kind.value, reqs))

    def _apply_spec(self, reqs: list[Req], res: SpecStepResult, plain: bool) -> None:
        """A read speculative (or, plain, adaptive speculation's plain) step's tokens; requests finished meanwhile
        (under the overlap schedule: one step earlier, or aborted) drop theirs."""
        if plain:
            self.stats.spec_plain_steps += 1
        for req, k, toks in zip(reqs, res.accept_len, res.tokens):
            if req.finished:
                continue
            req.seq_len += k + 1
            if not plain:  # a plain step verifies nothing: acceptance counts speculative steps only
                req.spec_verify_ct += 1
                req.spec_accepted_drafts += k
                self.stats.spec_verify_ct += 1
                self.stats.spec_accepted_drafts += k
                self.stats.recent_accept.append(k + 1)
            self._append(req, toks)

    def _ends_by_length(self, req: Req, pending: int) -> bool:
        """Whether `req` is finished by length once its `pending` tokens in flight are read (at least)."""
        n = len(req.output_ids) + pending
        return n >= req.sampling.max_new_tokens or len(req.origin_input_ids) + n >= self.model_runner.context_len

    def _drain(self) -> None:
        """Read and apply the step in flight, if any."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._apply(prev)

    def _apply(self, step: InFlightDecode) -> None:
        """Append a read step's tokens (a prefill's: its requests' first); requests finished meanwhile (a stop token
        one step earlier, an abort) drop theirs. When nothing of the step now in flight is still running, it is let
        go unread."""
        out = step.tokens.wait()
        now = time.perf_counter()
        res = SpecStepResult.parse(out) if step.spec else None
        if self.adaptive is not None and not step.prefill:  # back to back, a step costs the time between two reads
            self.adaptive.record(len(step.reqs), not step.spec, now - max(step.launched, self._last_read),
                                 1 + sum(res.accept_len) / len(step.reqs) if res else 1.0, steady=step.steady)
        self._last_read = now  # after a prefill: the next step's cost counts from here, not from its launch
        if res is not None:
            self._apply_spec(step.reqs, res, plain=False)
        else:
            for req, t in zip(step.reqs, out):
                if req.finished:
                    continue
                if step.prefill and req.first_token_time is None:
                    req.first_token_time = now
                self._append(req, [t])
        if self._inflight is not None and all(r.finished for r in self._inflight.reqs):
            self._inflight = None

    def _ensure_decode_capacity(self) -> None:
        model_runner = self.model_runner
        while self.running:
            need = [r.seq_len + self.n + 1 for r in self.running]
            if model_runner.kv.ensure([r.kv for r in self.running], need):
                return
            # Out of pages: retract a half-prefilled request first, then the newest running ones.
            if self.prefilling is not None:
                self._retract(self.prefilling)
                continue
            if len(self.running) == 1:
                raise RuntimeError("KV pool cannot hold a single request; the pool was sized wrongly")
            self._retract(max(self.running, key=lambda r: r.arrival_time))

    def _cache_and_release(self, req: Req) -> None:
        """A request leaves the running set: its committed full pages to the prefix cache (positions whose K/V and
        draft entries are final: below S, not past the token ids it keeps, not where the draft lags), then its rows
        and own pages back."""
        kv = self.model_runner.kv
        if kv.prefix_cache is not None and req.kv.row:
            valid = min(req.seq_len, len(req.fill_ids) - (self.n > 0))
            spec = self.model_runner.spec
            if spec is not None and spec.lag is not None:
                valid -= spec.lag.pending.get(req.kv.row, 0)
            # its recurrent state is after S unless a step in flight (overlap schedule) has moved it on
            in_flight = self._inflight is not None and req in self._inflight.reqs
            kv.cache_prefix(req.kv, req.cache_ids, valid, None if in_flight else req.seq_len)
        kv.release(req.kv)

    def _retract(self, req: Req) -> None:
        self._cache_and_release(req)
        if req in self.running:
            self.running.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        req.seq_len = 0
        req.prefill_len = len(req.fill_ids)
        req.state = ReqState.WAITING
        req.retractions += 1
        self.stats.num_retractions += 1
        self.waiting.appendleft(req)
        logger.debug("retracted %s (%d tokens)", req.rid, req.prefill_len)

    # ------------------------------------------------------------------ outputs
    def _append(self, req: Req, tokens: list[int]) -> None:
        for t in tokens:
            req.output_ids.append(t)
            self.stats.num_generated_tokens += 1
            if req.rules is not None:
                req.rules.commit(t)
            reason = self.stop.check(req, self.model_runner.context_len)
            if reason is not None:
                self._finish(req, reason)
                break
        if req.return_logprob:  # logprobs of tokens a finish dropped go too
            del req.output_logprobs[len(req.output_ids):]
            del req.output_top_logprobs[len(req.output_ids):]
        self._touched[req.rid] = req

    def _finish(self, req: Req, reason: dict) -> None:
        req.finished_reason = reason
        req.finish_time = time.perf_counter()
        req.state = ReqState.FINISHED
        self._cache_and_release(req)
        if req.images is not None:  # its pixels and encoder rows are not needed again
            req.images.release()
        if req in self.running:
            self.running.remove(req)
        if self.prefilling is req:
            self.prefilling = None
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.compiling:
            self.compiling.remove(req)
            req.grammar_future.cancel()
            req.grammar_future = None
        self.stats.finished += 1
        self._touched[req.rid] = req

    # ------------------------------------------------------------------ prefix cache
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counts (None: the cache is off, --disable-radix-cache)."""
        cache = self.model_runner.kv.prefix_cache
        return None if cache is None else cache.stats()

    def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's /flush_cache): only when idle, as there; False (nothing done) while a
        request runs, waits or compiles."""
        if self.has_work:
            return False
        cache = self.model_runner.kv.prefix_cache
        if cache is not None:
            cache.flush()
        return True

    def check_idle_invariants(self) -> None:
        """When idle, every page and row is back (tests call this)."""
        if self.has_work:
            raise AssertionError("scheduler is not idle")
        free = self.model_runner.allocator.num_free_pages
        cache = self.model_runner.kv.prefix_cache
        cached = cache.cached_pages if cache is not None else 0
        if free + cached != self.initial_free_pages:
            raise AssertionError(f"KV leak: {self.initial_free_pages - free - cached} pages held by no one")
        if cache is not None and cache.evictable_pages != cached:
            raise AssertionError(f"prefix cache: {cached - cache.evictable_pages} pages still locked when idle")
        if self.model_runner.req_to_token.num_free_rows != self.model_runner.req_to_token.max_reqs:
            raise AssertionError("page-table row leak")
        state = self.model_runner.caches.state
        if state is not None and state.num_free_rows != state.max_rows:
            raise AssertionError(f"state row leak: {state.max_rows - state.num_free_rows} rows still held")
