"""Admission of prompts into a running batch: which waiting (or half-prefilled) prompts get the next prefill step,
in chunks of at most `--chunked-prefill-size` tokens, and how much room the running requests keep.

Admission is growth-aware, so that retraction stays the exception: a new prompt is admitted only if the free pages
also cover what the running requests (and the ones admitted with it) are still expected to produce, estimated as
`new_token_ratio` x their remaining max_new_tokens. The ratio starts high, decays a little with every decode step
in which nothing had to be retracted (requests usually stop before their limit), and jumps back up after a
retraction (the estimate was too low), as SGLang's scheduler does. `--schedule-conservativeness` scales the ratio
(0: reserve only the next step). A request that finds nothing running is always admitted when its prompt fits: a
growth estimate must never keep the engine idle.

With the prefix cache on, a new request first takes the longest cached prefix of its tokens (kvcache/radix_cache.py,
locked at once so that making room for it cannot evict it) and prefills from there; the pages it counts against
are the free ones plus the cached ones nobody uses (evicted on demand). A request that shares more than its cached
prefix with a request prefilled in the same step (the n choices of one prompt, a burst of prompts with a common
system prompt) waits one step for that request's pages to be cached rather than computing them again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req, ReqState
from specserve.engine.steps import Chunk

INIT_NEW_TOKEN_RATIO = 0.7  # share of their remaining max_new_tokens that running requests are expected to produce
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per decode step without a retraction
RETRACT_RATIO_STEP = 0.2  # added after a retraction


@dataclass
class Admission:
    model_runner: ModelRunner
    num_steps: int  # N: a step may add N + 1 positions
    chunk_budget: int  # prompt tokens a prefill step takes at most
    conservativeness: float

    def __post_init__(self) -> None:
        self.new_token_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * self.conservativeness)

    def after_decode_step(self, retracted: bool) -> None:
        c = self.conservativeness
        if retracted:
            self.new_token_ratio = min(1.0, self.new_token_ratio + RETRACT_RATIO_STEP * c)
        else:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO * c, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY * c)

    def expected_pages(self, req: Req, seq_len: int | None = None) -> int:
        """Pages beyond those it holds that `req` is expected to need from now on: its next step (N + 2 positions)
        and new_token_ratio of its remaining max_new_tokens (bounded by the context). seq_len: its length once
        admitted (default its current one)."""
        seq_len = req.seq_len if seq_len is None else seq_len
        left = max(req.sampling.max_new_tokens - len(req.output_ids), 0)
        left = min(left, max(self.model_runner.context_len - seq_len, 0))
        want = seq_len + self.num_steps + 2 + int(self.new_token_ratio * left)
        return self.model_runner.kv.pages_needed(req.kv, want)

    def _cache_limit(self, req: Req) -> int:
        """How much of req's tokens the prefix cache may give: all but the last (whose logits give the first
        token); none of a prompt whose hidden states are returned; not past the prompt logprobs still owed (the
        logits before them must be computed)."""
        if req.return_hidden_states:
            return 0
        limit = len(req.fill_ids) - 1
        if req.input_logprobs_pending:
            limit = min(limit, max(req.logprob_start_len + len(req.input_logprobs) - 1, 0))
        return limit

    def _shares_with(self, req: Req, chunks: list[Chunk], cached: int) -> bool:
        """Whether req shares a page beyond its cached prefix with one a request of this step prefills."""
        ps = self.model_runner.page_size
        tokens = req.cache_ids
        limit = self._cache_limit(req)
        for c in chunks:
            other = c.req.cache_ids
            n = min(limit, c.end)
            if n < ps or other[:ps] != tokens[:ps]:
                continue
            i = ps
            while i < n and other[i] == tokens[i]:
                i += 1
            if i // ps * ps > max(cached, c.start):  # a page this chunk computes that req could take
                return True
        return False

    def _unmatch(self, req: Req, new: bool) -> None:
        """A new request that is not admitted after all gives its cached prefix back."""
        if new and req.kv.node is not None:
            self.model_runner.kv.release(req.kv)
            req.seq_len = 0

    def schedule(self, waiting: deque[Req], prefilling: Req | None,
                 running: list[Req]) -> tuple[list[Chunk], Req | None]:
        """The next prefill step's chunks (the half-prefilled request first, then waiting ones in FIFO order), with
        their KV ensured and new requests given a page-table row and taken off `waiting`; and the request left half
        prefilled after it (None: none). At most max_running requests run, the half-prefilled one counted."""
        model_runner = self.model_runner
        budget = self.chunk_budget
        chunks: list[Chunk] = []
        candidates: list[Req] = []
        if prefilling is not None:
            candidates.append(prefilling)
        candidates.extend(waiting)
        if not candidates:
            return chunks, prefilling  # (the common decode step: no per-request work here)
        # Keep pages back for the next step of every running request and for the tokens they are still expected to
        # produce, so admitted prompts do not force running requests out later.
        reserve = sum(self.expected_pages(r) for r in running)
        for req in candidates:
            if budget <= 0:
                break
            new = req.state == ReqState.WAITING
            if new and len(running) + (prefilling is not None) + len(chunks) >= model_runner.max_running:
                break
            cached = 0
            if new and model_runner.kv.prefix_cache is not None:
                cached = model_runner.kv.match_prefix(req.kv, req.cache_ids, self._cache_limit(req))
                req.seq_len = cached
                if self._shares_with(req, chunks, cached):
                    self._unmatch(req, new)
                    break  # FIFO: the requests behind it wait too (one step)
            start = req.seq_len
            end = min(req.prefill_len, start + budget)
            final = end == req.prefill_len
            need_positions = end + (self.num_steps + 1 if final else 0)
            extra = model_runner.kv.pages_needed(req.kv, need_positions)
            alone = not running and not chunks  # nothing else would run: admit if the prompt fits
            growth = self.expected_pages(req, end) - extra if final and not alone else 0  # beyond its prompt
            if extra + growth + reserve > model_runner.kv.available_pages:
                # A new request: FIFO, later ones wait behind it. The half-prefilled one: decodes run meanwhile
                # (they may finish and free pages).
                self._unmatch(req, new)
                break
            if new:
                if not model_runner.kv.assign_row(req.kv):
                    self._unmatch(req, new)
                    break
                if req.retractions == 0:
                    req.cached_tokens = cached
                if model_runner.kv.prefix_cache is not None:
                    model_runner.kv.prefix_cache.count(len(req.fill_ids), cached)
                waiting.remove(req)
                req.state = ReqState.PREFILLING
            ok = model_runner.kv.ensure([req.kv], [need_positions])
            assert ok
            chunks.append(Chunk(req, start, end, cached))
            reserve += growth
            budget -= end - start
            if not final:
                return chunks, req
            if prefilling is req:
                prefilling = None
        return chunks, prefilling
