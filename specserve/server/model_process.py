"""The model process: one EngineCore and its loop, fed by the HTTP process over a pipe.

Loop turn: take the inbox (block on it when there is no work, so an idle engine sleeps in `recv`, never spins),
queue new requests and apply aborts, run one scheduler step when there is work, then send one StepOutput with the
token deltas of every request that changed and a snapshot of the counters. A closed inbox means the HTTP process
is gone: the loop ends. Any crash is reported as EngineFailed before the process exits non-zero, so the HTTP side
can answer 503 instead of hanging.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from specserve.server.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineInfo,
    EngineReady,
    EngineStats,
    FlushCache,
    FlushCacheResult,
    RequestDelta,
    RequestRejected,
    Shutdown,
    StepOutput,
)
from specserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


def run_model_process(args: ServerArgs, inbox: Connection, outbox: Connection) -> None:
    """Entry point of the spawned process."""
    # Ctrl+C reaches the whole process group; the HTTP process decides how to shut down and tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s engine %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    try:
        from specserve.engine.engine import EngineCore

        core = EngineCore(args)
        outbox.send(EngineReady(_engine_info(core)))
        EngineLoop(core, inbox, outbox).run()
    except (EOFError, BrokenPipeError):
        logger.info("HTTP process went away; engine exits")
    except BaseException as e:  # report every crash (incl. KeyboardInterrupt, MemoryError) before dying
        text = "".join(traceback.format_exception(e))
        logger.error("engine failed:\n%s", text)
        try:
            outbox.send(EngineFailed(text))
        except (OSError, EOFError):
            logger.error("could not report the failure: the HTTP process is gone")
        sys.exit(1)


def _engine_info(core) -> EngineInfo:
    mr = core.model_runner
    target = mr.target
    vision = getattr(target, "visual", None) is not None and core.tp_leader is None
    image_token_id = getattr(target, "image_token_id", None) if vision else None
    return EngineInfo(
        model_path=core.model_path,
        architecture=core.model_config.architecture,
        context_len=core.context_len,
        vocab_size=core.model_config.vocab_size,
        max_total_tokens=mr.max_total_tokens,
        max_running=mr.max_running,
        page_size=mr.allocator.page_size,
        capacity_pages=mr.allocator.capacity_pages,
        initial_free_pages=core.scheduler.initial_free_pages,
        default_sampling=dict(core.default_sampling), default_max_tokens=core.default_max_tokens,
        spec_enabled=core.args.spec_enabled,
        spec_algorithm=core.args.speculative_algorithm if core.args.spec_enabled else None,
        spec_num_steps=core.args.num_draft_steps,
        draft_model_path=core.args.speculative_draft_model_path if core.args.spec_enabled else None,
        spec_ngram_lookup=core.args.spec_enabled and core.args.speculative_ngram_lookup,
        overlap_schedule=core.scheduler.overlap,
        draft_quantization=(core.args.speculative_draft_model_quantization
                            if core.args.speculative_draft_model_quantization != "none" else None),
        load_time=core.load_time,
        pid=os.getpid(),
        prefix_cache=mr.kv.prefix_cache is not None,
        image_token_id=image_token_id,
        image_folder=core.model_folder if image_token_id is not None else None,
    )


class EngineLoop:
    def __init__(self, core, inbox: Connection, outbox: Connection):
        self.core = core
        self.sched = core.scheduler
        self.inbox = inbox
        self.outbox = outbox

    def run(self) -> None:
        while True:
            msgs = self._take_inbox(block=not self.sched.has_work)
            out = StepOutput()
            stop = False
            for m in msgs:
                if isinstance(m, AddRequest):
                    self._add(m, out)
                elif isinstance(m, AbortRequest):
                    self.sched.abort(m.rid)
                elif isinstance(m, FlushCache):
                    out.flushed.append(self._flush(m))
                elif isinstance(m, Shutdown):
                    stop = True
                else:
                    raise TypeError(f"unknown message {type(m).__name__}")
            if stop:
                self._abort_all()
                logger.info("engine shutting down")
                return
            # step() also collects requests that finished without a forward (aborted, or max_new_tokens 0), so it
            # runs after any message even when no work is left (it is cheap when idle).
            if msgs or self.sched.has_work:
                for req in self.sched.step():
                    if (req.finished_reason or {}).get("status_code") == 400 and not req.output_ids:
                        # refused before any work (a grammar that does not compile): a 400 like make_request's
                        out.rejected.append(RequestRejected(req.rid, req.finished_reason["message"]))
                    else:
                        out.deltas.append(self._delta(req))
            out.stats = self._stats()
            self.outbox.send(out)

    def _take_inbox(self, block: bool) -> list:
        msgs = [self.inbox.recv()] if block else []
        while self.inbox.poll():
            msgs.append(self.inbox.recv())
        return msgs

    def _add(self, m: AddRequest, out: StepOutput) -> None:
        try:
            req = self.core.make_request(m.input_ids, m.sampling, rid=m.rid,
                                         return_hidden_states=m.return_hidden_states, reasoning_end=m.reasoning_end,
                                         return_logprob=m.return_logprob, top_logprobs_num=m.top_logprobs_num,
                                         logprob_start_len=m.logprob_start_len, images=m.images)
            self.sched.add_request(req)
        except ValueError as e:
            out.rejected.append(RequestRejected(m.rid, str(e)))

    def _flush(self, m: FlushCache) -> FlushCacheResult:
        """Between steps, in message order (a request queued before the flush makes it refuse)."""
        ok = self.sched.flush_cache()
        if ok:
            logger.info("prefix cache flushed")
        return FlushCacheResult(m.id, ok, self.sched.num_running, len(self.sched.waiting) + len(self.sched.compiling))

    def _delta(self, req) -> RequestDelta:
        sent = req.sent_output_len
        new = req.output_ids[sent:]
        req.sent_output_len = len(req.output_ids)
        hidden = self.core.hidden_states(req) if req.return_hidden_states and req.finished else None
        delta = RequestDelta(req.rid, list(new), req.finished_reason, req.spec_verify_ct, req.spec_accepted_drafts,
                             hidden, cached_tokens=req.cached_tokens)
        if req.return_logprob:
            delta.logprobs = req.output_logprobs[sent:]
            delta.top_logprobs = req.output_top_logprobs[sent:] if req.top_logprobs_num else None
            if req.finished and req.logprob_start_len >= 0:
                delta.input_logprobs, delta.input_top_logprobs = req.input_logprobs, req.input_top_logprobs
        return delta

    def _abort_all(self) -> None:
        for rid in list(self.sched.reqs):
            self.sched.abort(rid)
        self.sched.step()  # collect the aborted requests so their bookkeeping is released

    def _stats(self) -> EngineStats:
        s = self.sched.stats
        recent = list(s.recent_accept)
        cache = self.sched.prefix_cache_stats()
        stats = EngineStats(
            num_running=self.sched.num_running,
            num_waiting=len(self.sched.waiting),
            free_pages=self.core.model_runner.kv.available_pages,  # free + cached pages nobody uses
            num_generated_tokens=s.num_generated_tokens,
            num_prompt_tokens=s.num_prompt_tokens,
            num_finished=s.finished,
            num_retractions=s.num_retractions,
            num_prefill_steps=s.num_prefill_steps,
            num_decode_steps=s.num_decode_steps,
            spec_verify_ct=s.spec_verify_ct,
            spec_accepted_drafts=s.spec_accepted_drafts,
            recent_accept_length=sum(recent) / len(recent) if recent else 0.0,
            spec_plain_steps=s.spec_plain_steps,
            num_overlapped_steps=s.num_overlapped_steps,
            num_overlapped_prefills=s.num_overlapped_prefills,
            spec_adaptive=self._adaptive_summary(),
        )
        if cache is not None:
            stats.prefix_cache = cache
        return stats

    def _adaptive_summary(self) -> dict | None:
        """Adaptive speculation's step counts and estimates, with the draft's catch-ups after plain steps."""
        if self.sched.adaptive is None:
            return None
        return {**self.sched.adaptive.summary(), "draft_catch_ups": dict(self.core.model_runner.spec.catch_ups)}
