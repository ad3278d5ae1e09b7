"""The HTTP process's side of generation: tokenise, validate, track requests, fan engine output out to them.

Every request is validated here before it is sent to the engine (same SamplingParams and prompt checks as
EngineCore.make_request), so a bad request costs no engine work and can never hold KV. The engine's step outputs
arrive on the event loop (see EngineClient) and are routed to per-request queues; a request's consumer turns
them into `GenChunk`s with incremental text. A consumer that goes away (client disconnect, cancellation) aborts
its request in the engine, which frees its KV.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from jinja2 import TemplateError

from specserve.engine.sampling_params import (
    SamplingParams,
    check_logprob_args,
    input_logprobs_meta,
    logprobs_meta,
)
from specserve.multimodal.request_images import PreprocessedImages
from specserve.server.control_tokens import ControlTokens
from specserve.server.detokenizer import IncrementalDetokenizer
from specserve.server.engine_client import EngineClient
from specserve.server.errors import APIError, bad_request, unavailable
from specserve.server.image_requests import ImageRequests
from specserve.server.logprobs_format import token_decoder
from specserve.server.messages import (
    EngineInfo,
    EngineStats,
    FlushCacheResult,
    RequestDelta,
    RequestRejected,
    StepOutput,
)
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import BodyReader
from specserve.server.request_caps import RequestCaps
from specserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

EMBEDDED_SERVED_NAME = "SmolLM2-135M-Instruct"  # the embedded default model's name (no --model-path)

# chat_template_kwargs may not set apply_chat_template's own arguments; `chat_template` would let a client run a
# template of its own on the server's tokenizer thread (a loop in it stalls every text route).
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "return_tensors", "return_dict",
                             "add_generation_prompt", "chat_template", "tools", "documents", "continue_final_message"}
_TEMPLATE_FAILED = ("the chat template could not be applied to these messages: a field it reads is missing or has "
                    "a type it cannot use (check the roles' order, content, tool calls and chat_template_kwargs)")


@dataclass
class GenRequest:
    input_ids: list[int]
    sampling: dict  # SGLang sampling names
    rid: str | None = None  # the client's own id: a label scoped to `owner` (server/access.py)
    owner: str = ""  # who sent it (access.owner_of): another owner cannot abort it by its rid
    internal: bool = False  # warm-up and health checks: kept out of the metrics
    return_hidden_states: bool = False  # meta_info.hidden_states once finished (--enable-return-hidden-states)
    reasoning_end: str | None = None  # a grammar in `sampling` applies after this marker (engine/grammar.py)
    return_logprob: bool = False  # each output token's logprob (chunks' new_logprobs; meta_info at the finish)
    top_logprobs_num: int = 0  # ... and the most likely tokens' at each position
    logprob_start_len: int = -1  # the prompt's logprobs from this token on, in meta_info at the finish
    validated: bool = False  # set by precheck_all: generate() does not validate the prompt and sampling again
    images: PreprocessedImages | None = None  # the prompt's images (input_ids is then the expanded prompt)


@dataclass
class GenChunk:
    """What a consumer sees after each engine update of its request."""

    rid: str
    text_delta: str  # new text safe to show (may be "" while a character or stop string is incomplete)
    text: str  # all text shown so far
    new_ids: list[int]
    output_ids: list[int]  # all output ids so far (a copy)
    finished: bool
    finish_reason: dict | None  # SGLang form: {"type": "stop"|"length"|"abort", ...}
    meta: dict  # prompt_tokens, completion_tokens, cached_tokens, finish_reason, spec_* (speculation), e2e_latency
    new_logprobs: list[float] | None = None  # new_ids' logprobs (a request that returns them)
    new_top_logprobs: list | None = None  # per new id [(id, logprob), ...] (top_logprobs_num > 0)


@dataclass
class _EngineGone:
    reason: str


@dataclass
class _Tracked:
    rid: str  # the server-made id the engine knows the request by
    prompt_tokens: int
    detok: IncrementalDetokenizer
    internal: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (known once the engine admitted the request)
    done: bool = False
    top_logprobs_num: int | None = None  # None: the request returns no logprobs
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)  # the prompt's ids from logprob_start_len (their logprobs')
    label: tuple[str, str] | None = None  # (owner, the client's rid) when the client named the request


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer, engine: EngineClient, info: EngineInfo, served_model_name: str,
                 metrics: ServerMetrics):
        self.args = args
        self.tokenizer = tokenizer
        self.engine = engine
        self.info = info
        self.served_model_name = served_model_name
        self.metrics = metrics
        self.stats = EngineStats(free_pages=info.initial_free_pages)
        self.reqs: dict[str, _Tracked] = {}  # by server-made id
        self.labels: dict[tuple[str, str], str] = {}  # (owner, client rid) -> server-made id
        self.accepting = True
        self.engine_exit_reason: str | None = None
        self.engine_lost = asyncio.Event()  # set when the engine process ends on its own (not at shutdown)
        self._flushes: dict[int, asyncio.Future] = {}  # /flush_cache calls waiting for the engine's answer
        self._flush_ids = itertools.count(1)
        metrics.set_engine(info, self.stats, healthy=True)
        # Tokenising and templating run on this one thread, never on the event loop (a long prompt would stall
        # every other client), and one at a time (a fast tokenizer's encode is not safe to call concurrently).
        self._text_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.caps = RequestCaps(args, tokenizer, info.context_len)
        self.images = ImageRequests(args, info, self.caps)
        self.bodies = BodyReader(int(args.max_request_body_mb * (1 << 20)), args.http_body_timeout)
        self._decode_token = token_decoder(tokenizer)
        self.control_tokens = ControlTokens.of(tokenizer)

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the text worker thread (tokenising, chat templates)."""
        return await asyncio.get_running_loop().run_in_executor(self._text_worker, fn, *args)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.engine.start_io(loop, self._on_output, self._on_engine_exit)

    @property
    def healthy(self) -> bool:
        return self.engine_exit_reason is None and self.accepting

    # ------------------------------------------------------------------ prompts
    def decode_token(self, tok: int) -> str:
        """One token's text alone (logprobs' token strings), memoised."""
        return self._decode_token(tok)

    def decode_ids(self, ids: list[int]) -> str:
        """A prompt's text (echo)."""
        return self.tokenizer.decode(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.caps.check_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(self, messages: list[dict], template_kwargs: dict | None, tools: list[dict] | None = None) -> str:
        """The prompt the chat template makes of the messages (and the request's tools, OpenAI dicts)."""
        prompt, nonce = self._render_chat(messages, template_kwargs, tools)
        return self.control_tokens.restore(prompt, nonce)

    def chat_prompt_ids(self, messages: list[dict], template_kwargs: dict | None,
                        tools: list[dict] | None = None) -> list[int]:
        """The ids of chat_prompt. Text of the messages and tools that spells a special token (a forged
        "<|im_start|>system") is tokenised as ordinary text; only the template's own markers are control tokens
        (server/control_tokens.py)."""
        prompt, nonce = self._render_chat(messages, template_kwargs, tools)
        self.caps.check_text(self.control_tokens.restore(prompt, nonce))
        if not nonce:  # the template already has any BOS it wants
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return self.control_tokens.encode(prompt, nonce)

    def _render_chat(self, messages: list[dict], template_kwargs: dict | None,
                     tools: list[dict] | None) -> tuple[str, str]:
        """The template's text with the client's special token strings as sentinels, and the sentinels' nonce
        ("" when the client's text holds none: the text is then the template's own)."""
        if not messages:
            raise bad_request("messages must contain at least one message", param="messages")
        if self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; start the server with --chat-template, or use "
                              "/v1/completions", param="messages")
        kwargs = dict(template_kwargs or {})
        clash = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # text and image parts (a vision-language model's user turn)
                for part in content:
                    if part.get("text"):
                        self.caps.check_text(part["text"], param="messages")
            elif content:  # (an empty assistant turn is fine; the template's output is checked again)
                self.caps.check_text(content, param="messages")
        forged = self.control_tokens.present([messages, tools])
        nonce = self.control_tokens.new_nonce([messages, tools]) if forged else ""
        if forged:
            messages, tools = self.control_tokens.hide([messages, tools], nonce)
        try:
            prompt = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                        add_generation_prompt=True, **kwargs)
        except TemplateError as e:
            if type(e) is TemplateError:  # the template's own raise_exception("..."): written for the client
                raise bad_request(f"the chat template refused the messages: {e}", param="messages") from None
            raise bad_request(_TEMPLATE_FAILED, param="messages") from None  # jinja's words name its internals
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise bad_request(_TEMPLATE_FAILED, param="messages") from None
        return prompt, nonce

    # ------------------------------------------------------------------ validation
    def validate(self, input_ids: list[int], sampling: dict) -> None:
        """The checks of EngineCore.make_request, done before anything reaches the engine (raises 400)."""
        try:
            sp = SamplingParams.from_dict(sampling, self.info.default_sampling)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        vocab = self.info.vocab_size
        if any(t >= vocab for t in sp.stop_token_ids):
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        if any(t >= vocab for t, _ in sp.bias_items):
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        for stop in sp.stop:
            self.caps.check_text(stop, param="stop")
        if not input_ids:
            raise bad_request("the prompt is empty", param="prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in input_ids):
            raise bad_request(f"input_ids must be integers in [0, {vocab})", param="input_ids")
        if len(input_ids) >= self.info.context_len:
            raise bad_request(
                f"the prompt has {len(input_ids)} tokens; the context length is {self.info.context_len} "
                "(the prompt must leave room for at least one new token)", param="prompt")

    @property
    def shown_model_path(self) -> str:
        """The model path the info routes show: --model-path, or the embedded default by name (not the path of an
        installed package file)."""
        return self.args.model_path if self.args.model_path is not None else f"embedded:{EMBEDDED_SERVED_NAME}"

    def check_model(self, name: str | None) -> None:
        if name is None:
            return
        if name not in (self.served_model_name, self.info.model_path, self.args.model_path):
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.served_model_name!r}",
                           param="model", code="model_not_found")

    def check_available(self) -> None:
        if self.engine_exit_reason is not None:
            raise unavailable(f"the engine is not running: {self.engine_exit_reason.splitlines()[0]}")
        if not self.accepting:
            raise unavailable("the server is shutting down")

    @property
    def num_queued(self) -> int:
        """Requests in flight here that the engine is not running yet (its running count arrives each step)."""
        return max(0, sum(1 for t in self.reqs.values() if not t.done and not t.internal) - self.stats.num_running)

    def check_queue(self, incoming: int = 1) -> None:
        """Room in the queue for `incoming` more requests (a batch's prompts and choices): 503 with Retry-After when
        the queue is full, 400 for a batch that could never fit (--max-queued-requests below the batch)."""
        limit = self.args.max_queued_requests
        if not limit:  # None or 0: no limit
            return
        if incoming > limit:
            raise bad_request(f"the request would queue {incoming} requests, more than --max-queued-requests "
                              f"{limit} allows at all")
        if self.num_queued + incoming > limit:
            raise APIError(503, f"the server is overloaded: {self.num_queued} requests are waiting "
                                f"(--max-queued-requests {limit}); retry later", headers={"Retry-After": "1"})

    async def precheck_all(self, reqs: list[GenRequest]) -> None:
        """A whole request's prompts and choices checked before any is queued, the queue's room for all of them
        included (raises APIError). The prompts and sampling parameters are validated once, off the event loop
        (a body of millions of token ids takes a while); generate() then only checks what may have changed."""
        self.check_available()
        self.check_queue(sum(1 for r in reqs if not r.internal))
        for r in reqs:
            self._check_rid(r)
        await self.bodies.run(self._validate_all, reqs)

    def _validate_all(self, reqs: list[GenRequest]) -> None:
        for r in reqs:
            self._check_request(r)
            r.validated = True

    def precheck(self, req: GenRequest) -> None:
        """Everything that can refuse a request before it is queued (raises APIError)."""
        self.check_available()
        if not req.internal:
            self.check_queue()
        self._check_rid(req)
        self._check_request(req)

    def _check_request(self, req: GenRequest) -> None:
        """The prompt and sampling checks (no state of this manager is read: safe on a worker thread)."""
        self.validate(req.input_ids, req.sampling)
        token = self.info.image_token_id
        if req.images is None and token is not None and token in req.input_ids:
            raise bad_request(f"the prompt holds {req.input_ids.count(token)} image tokens but the request carries "
                              "no images", param="prompt")
        try:
            check_logprob_args(req.return_logprob, req.top_logprobs_num, req.logprob_start_len, len(req.input_ids))
        except ValueError as e:
            raise bad_request(str(e), param="top_logprobs") from None
        if req.return_hidden_states and not self.args.enable_return_hidden_states:
            raise bad_request("this server does not return hidden states: start it with "
                              "--enable-return-hidden-states", param="return_hidden_states")

    def _check_rid(self, req: GenRequest) -> None:
        if req.rid is not None:
            try:
                req.rid.encode("utf-8")  # echoed in the response: it must be encodable
            except UnicodeEncodeError:
                raise bad_request("rid is not valid Unicode (a lone surrogate escape?)", param="rid") from None
            if (req.owner, req.rid) in self.labels:
                raise bad_request(f"request id {req.rid!r} is already in use", param="rid")

    # ------------------------------------------------------------------ generation
    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        """Yields a chunk per engine update of the request; the last one has finished=True.

        Raises APIError (400 invalid or rejected by the engine, 503 engine gone). Closing the iterator early (or
        cancelling its consumer) aborts the request in the engine."""
        if req.validated:  # (by precheck_all) only what may have changed since
            self.check_available()
            self._check_rid(req)
        else:
            self.precheck(req)
        rid = uuid.uuid4().hex  # the engine's id; the client's rid is only a label (server/access.py)
        skip = req.sampling.get("skip_special_tokens", True) is not False
        stop = req.sampling.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        t = _Tracked(rid, len(req.input_ids), IncrementalDetokenizer(self.tokenizer, skip, stop), req.internal,
                     top_logprobs_num=req.top_logprobs_num if req.return_logprob else None,
                     prompt=list(req.input_ids[max(req.logprob_start_len, 0):]) if req.return_logprob else [])
        self.reqs[rid] = t
        if req.rid is not None:
            t.label = (req.owner, req.rid)
            self.labels[t.label] = rid
        self.engine.add(rid, list(req.input_ids), dict(req.sampling), req.return_hidden_states,
                        reasoning_end=req.reasoning_end, return_logprob=req.return_logprob,
                        top_logprobs_num=req.top_logprobs_num, logprob_start_len=req.logprob_start_len,
                        images=req.images)
        limit = None if req.internal else self.args.request_timeout
        deadline = None if limit is None else t.arrival + limit
        try:
            while True:
                items = [await self._next(t, deadline)]
                while not t.queue.empty():
                    items.append(t.queue.get_nowait())
                chunk = self._apply(t, items)
                if chunk is not None:
                    yield chunk
                    if chunk.finished:
                        return
        finally:
            if not t.done:
                t.done = True
                if self.engine_exit_reason is None:
                    self.engine.abort(rid)
                self._record(t, {"type": "abort"})
            self.reqs.pop(rid, None)
            if t.label is not None:
                self.labels.pop(t.label, None)

    async def _next(self, t: _Tracked, deadline: float | None):
        """The request's next engine update; past --request-timeout the request is aborted in the engine and this
        returns its final update (finish_reason abort, "request timeout")."""
        if deadline is None:
            return await t.queue.get()
        try:
            return await asyncio.wait_for(t.queue.get(), max(deadline - time.perf_counter(), 0.0))
        except asyncio.TimeoutError:
            self.engine.abort(t.rid)
            return RequestDelta(t.rid, [], {"type": "abort", "message": "request timeout (--request-timeout "
                                            f"{self.args.request_timeout:g} s)"}, t.spec_verify_ct,
                                t.spec_accepted_drafts)

    def _apply(self, t: _Tracked, items: list) -> GenChunk | None:
        new_ids: list[int] = []
        new_lp: list[float] = []
        new_top: list = []
        reason = hidden = None
        prompt_lp = prompt_top = None
        for it in items:
            if isinstance(it, RequestRejected):
                t.done = True
                raise bad_request(it.message)
            if isinstance(it, _EngineGone):
                t.done = True
                raise unavailable(f"the engine stopped: {it.reason.splitlines()[0]}")
            new_ids.extend(it.new_ids)
            new_lp.extend(it.logprobs or [])
            new_top.extend(it.top_logprobs or [])
            t.spec_verify_ct = max(t.spec_verify_ct, it.spec_verify_ct)
            t.spec_accepted_drafts = max(t.spec_accepted_drafts, it.spec_accepted_drafts)
            t.cached_tokens = max(t.cached_tokens, it.cached_tokens)
            if it.finished_reason is not None:
                reason, hidden = it.finished_reason, it.hidden_states
                prompt_lp, prompt_top = it.input_logprobs, it.input_top_logprobs
                break  # nothing after a finish belongs to this request
        if not new_ids and reason is None:
            return None
        now = time.perf_counter()
        if new_ids and t.first_token_time is None:
            t.first_token_time = now
        if reason is not None:
            t.done = True
            delta = t.detok.finish(new_ids, reason)
        else:
            delta = t.detok.feed(new_ids)
        meta = {"id": t.label[1] if t.label else t.rid, "prompt_tokens": t.prompt_tokens,
                "completion_tokens": len(t.detok.ids), "cached_tokens": t.cached_tokens, "finish_reason": reason}
        if self.info.spec_enabled:
            meta["spec_verify_ct"] = t.spec_verify_ct
            meta["spec_accept_length"] = self._accept_len(t)
        if hidden is not None:
            meta["hidden_states"] = hidden
        if t.top_logprobs_num is not None:
            t.logprobs.extend(new_lp)
            t.top_logprobs.extend(new_top)
            if reason is not None:
                meta.update(logprobs_meta(t.detok.ids, t.logprobs, t.top_logprobs, t.top_logprobs_num))
                if prompt_lp is not None:
                    meta.update(input_logprobs_meta(t.prompt, prompt_lp, prompt_top, t.top_logprobs_num))
        if reason is not None:
            meta["e2e_latency"] = now - t.arrival
            self._record(t, reason)
        chunk = GenChunk(meta["id"], delta, t.detok.text[:t.detok.sent], new_ids, list(t.detok.ids), reason is not None,
                         reason, meta)
        if t.top_logprobs_num is not None:
            chunk.new_logprobs, chunk.new_top_logprobs = new_lp, new_top if t.top_logprobs_num else None
        return chunk

    @staticmethod
    def _accept_len(t: _Tracked) -> float:
        if not t.spec_verify_ct:
            return 0.0
        return (t.spec_accepted_drafts + t.spec_verify_ct) / t.spec_verify_ct

    def _record(self, t: _Tracked, reason: dict) -> None:
        if t.internal:
            return
        ttft = None if t.first_token_time is None else t.first_token_time - t.arrival
        self.metrics.observe_finished(reason.get("type", "abort"), t.prompt_tokens, len(t.detok.ids), ttft,
                                      time.perf_counter() - t.arrival, cached_tokens=t.cached_tokens)

    async def generate_one(self, req: GenRequest) -> GenChunk:
        """Run a request to the end; returns the last chunk, with the whole text in `text`."""
        last = None
        gen = self.generate(req)
        try:
            async for chunk in gen:
                last = chunk
        finally:
            await gen.aclose()
        if last is None or not last.finished:
            raise RuntimeError(f"request {req.rid} ended without finishing")
        return last

    # ------------------------------------------------------------------ engine events (on the event loop)
    def _on_output(self, out: StepOutput) -> None:
        self.stats = out.stats
        self.metrics.set_engine(self.info, out.stats, healthy=self.engine_exit_reason is None)
        for d in out.deltas:
            t = self.reqs.get(d.rid)
            if t is not None and not t.done:
                t.queue.put_nowait(d)
        for r in out.rejected:
            t = self.reqs.get(r.rid)
            if t is not None and not t.done:
                t.queue.put_nowait(r)
        for f in out.flushed:  # after the stats: a flushed cache shows in them once the caller hears back
            fut = self._flushes.pop(f.id, None)
            if fut is not None and not fut.done():
                fut.set_result(f)

    def _on_engine_exit(self, reason: str) -> None:
        if self.engine_exit_reason is not None:
            return
        self.engine_exit_reason = reason
        if self.accepting:
            logger.error("engine stopped: %s", reason)
            self.engine_lost.set()
        self.metrics.set_engine(self.info, self.stats, healthy=False)
        for t in self.reqs.values():
            if not t.done:
                t.queue.put_nowait(_EngineGone(reason))
        for fut in self._flushes.values():
            if not fut.done():
                fut.set_exception(unavailable(f"the engine stopped: {reason.splitlines()[0]}"))
        self._flushes.clear()

    def abort_request(self, rid: str, owner: str, message: str) -> bool:
        """/abort_request: the request `owner` named `rid`, else the request whose server-made id is `rid`; False
        if there is none in flight (another owner's rid is never matched)."""
        return self.abort(self.labels.get((owner, rid), rid), message)

    def abort(self, rid: str, message: str) -> bool:
        """Finish a request (by its server-made id) as aborted (its consumer sees finish_reason abort); False if it
        is not in flight."""
        t = self.reqs.get(rid)
        if t is None or t.done:
            return False
        if self.engine_exit_reason is None:
            self.engine.abort(rid)
        t.queue.put_nowait(RequestDelta(rid, [], {"type": "abort", "message": message}, t.spec_verify_ct,
                                        t.spec_accepted_drafts))
        return True

    def abort_all(self, message: str) -> None:
        """Stop taking requests and finish every in-flight one as aborted (graceful shutdown)."""
        self.accepting = False
        for rid in list(self.reqs):
            self.abort(rid, message)

    # ------------------------------------------------------------------ prefix cache
    async def flush_cache(self) -> FlushCacheResult:
        """Ask the engine to empty its prefix cache and wait (on the event loop, never blocking it) for its answer:
        success False when requests were running or waiting (nothing flushed). Raises APIError(503) when the engine
        is not running."""
        self.check_available()
        flush_id = next(self._flush_ids)
        fut = asyncio.get_running_loop().create_future()
        self._flushes[flush_id] = fut
        try:
            self.engine.flush_cache(flush_id)
            return await fut
        finally:
            self._flushes.pop(flush_id, None)

    def prefix_cache_info(self) -> dict:
        """/get_server_info's prefix_cache object (counts are 0 with the cache off)."""
        c = self.stats.prefix_cache
        return {"enabled": self.info.prefix_cache, "cached_pages": c.cached_pages, "evictable_pages": c.evictable_pages,
                "hit_tokens": c.hit_tokens, "query_tokens": c.query_tokens, "hit_rate": c.hit_rate,
                "state_snapshots": c.state_snapshots}

    # ------------------------------------------------------------------ health and status
    async def health_generate(self, ids: list[int], timeout: float) -> None:
        """One 1-token generation through the whole path; raises APIError(503) when it does not complete."""
        req = GenRequest(ids, {"max_new_tokens": 1, "temperature": 0.0}, internal=True)
        try:
            await asyncio.wait_for(self.generate_one(req), timeout)
        except asyncio.TimeoutError:
            raise unavailable(f"the engine did not produce a token within {timeout:.0f} s") from None

    def runtime_info(self) -> dict:
        s, i = self.stats, self.info
        used = (i.initial_free_pages - s.free_pages) * i.page_size
        total = i.initial_free_pages * i.page_size
        return {
            "engine_alive": self.engine_exit_reason is None,
            "engine_pid": i.pid,
            "num_running_reqs": s.num_running,
            "num_queue_reqs": s.num_waiting,
            "num_http_requests": len(self.reqs),
            "kv_used_tokens": used,
            "kv_total_tokens": total,
            "token_usage": used / total if total else 0.0,
            "kv_free_pages": s.free_pages,
            "kv_initial_free_pages": i.initial_free_pages,
            "kv_capacity_pages": i.capacity_pages,
            "page_size": i.page_size,
            "max_total_num_tokens": i.max_total_tokens,
            "max_running_requests": i.max_running,
            "context_length": i.context_len,
            "num_generated_tokens": s.num_generated_tokens,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_finished_reqs": s.num_finished,
            "num_retractions": s.num_retractions,
            "num_prefill_steps": s.num_prefill_steps,
            "num_decode_steps": s.num_decode_steps,
            "overlap_schedule": i.overlap_schedule,  # off: --disable-overlap-schedule, or a CPU
            "num_overlapped_steps": s.num_overlapped_steps,
            "num_overlapped_prefills": s.num_overlapped_prefills,
            "spec_enabled": i.spec_enabled,
            "speculative_algorithm": i.spec_algorithm,
            "speculative_num_steps": i.spec_num_steps,
            "speculative_draft_model_path": i.draft_model_path,
            "speculative_ngram_lookup": i.spec_ngram_lookup,
            "speculative_draft_model_quantization": i.draft_quantization,
            "spec_verify_ct": s.spec_verify_ct,
            "spec_accept_length": s.spec_accept_length,
            "avg_spec_accept_length": s.spec_accept_length,  # SGLang's name
            "spec_accept_length_recent": s.recent_accept_length,
            "spec_plain_steps": s.spec_plain_steps,  # adaptive speculation's plain steps
            "speculative_adaptive": s.spec_adaptive,  # its step counts and estimates per batch-size bucket
            "load_time": i.load_time,
            "default_sampling_params": dict(i.default_sampling),  # what a request that sets nothing gets
            "default_chat_max_tokens": i.default_max_tokens,
            "prefix_cache": self.prefix_cache_info(),
        }
