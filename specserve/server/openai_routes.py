"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (streaming SSE and not).

Usage is on every answer (`usage` of the response, or the last stream chunk with stream_options.include_usage), with
`prompt_tokens_details: {cached_tokens}` (prompt tokens the prefix cache gave, summed like prompt_tokens over the
choices); with speculation it also has `spec: {accept_length, verify_ct}`. finish_reason is "stop", "length" or
"abort", and "tool_calls" for a chat answer that stopped after calling tools.

Chat requests to a vision-language model may carry images (`image_url` content parts: data URLs, or local files
under --allowed-local-media-path): the template writes a placeholder per image, TokenizerManager.chat_images decodes
and preprocesses them on an image worker thread and expands the placeholders, and the engine gets the preprocessed
pixels (usage.prompt_tokens counts the expanded prompt).
Chat requests may carry tools (server/chat_tools.py: messages and tools for the template, tool_choice); the answer
becomes the assistant message, tool calls and reasoning_content included, in server/chat_output.py.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from specserve.server.access import owner_of
from specserve.server.chat_output import ChatOutput, finish_with_tools
from specserve.server.chat_tools import plan_tools, template_messages
from specserve.server.errors import APIError, bad_request, client_left
from specserve.server.info_view import shown_path
from specserve.server.logprobs_format import chat_logprobs, completion_logprobs
from specserve.server.parsers.reasoning import THINK_END
from specserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensUsageInfo,
    SpecUsageInfo,
    UsageInfo,
)
from specserve.server.streaming import SSE_DONE, ClientGone, merge_streams, run_all, sse, sse_response, until_disconnect
from specserve.server.tokenizer_manager import GenChunk, GenRequest, TokenizerManager

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API


def finish_reason(reason: dict | None) -> str | None:
    return None if reason is None else _FINISH.get(reason.get("type"), "abort")


def usage(chunks: list[GenChunk], spec_enabled: bool) -> dict:
    """The usage of the choices' last chunks: every choice counts its prompt (and the tokens the cache gave it)."""
    prompt = sum(c.meta["prompt_tokens"] for c in chunks)
    completion = sum(c.meta["completion_tokens"] for c in chunks)
    cached = sum(c.meta.get("cached_tokens", 0) for c in chunks)
    out = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                    prompt_tokens_details=PromptTokensUsageInfo(cached_tokens=cached))
    if spec_enabled:
        verify = sum(c.meta["spec_verify_ct"] for c in chunks)
        tokens = sum(c.meta["spec_accept_length"] * c.meta["spec_verify_ct"] for c in chunks)
        out.spec = SpecUsageInfo(accept_length=tokens / verify if verify else 0.0, verify_ct=verify)
    return out.model_dump(exclude_none=True)


def choice_count(tm: TokenizerManager, body) -> int:
    """n, checked: 1..--max-n; with n > 1 no client rid (each choice is a request of its own)."""
    n = tm.caps.check_n(body.n)
    if n > 1 and body.rid is not None:
        raise bad_request("rid can only be given with n = 1", param="rid")
    return n


def choice_sampling(sampling: dict, n: int) -> list[dict]:
    """The n choices' sampling parameters: each its own seed stream (seed, seed + 1, ... when a seed is given; else
    each request draws its own), the rest shared."""
    if n == 1:
        return [sampling]
    seed = sampling.get("seed")
    return [{**sampling, **({"seed": (seed + i) % (1 << 63)} if seed is not None else {})} for i in range(n)]


def _refuse_unsupported(body, *, chat: bool) -> None:
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    else:
        if body.echo and body.logprobs is not None and body.stream:
            raise bad_request("echo with logprobs (the prompt's logprobs) is not supported in a stream", param="echo")
        if body.best_of not in (None, 1):
            raise bad_request("best_of must be 1", param="best_of")
        if body.suffix:
            raise bad_request("suffix (insertion) is not supported", param="suffix")


def _sampling(body, max_new_tokens: int | None) -> dict:
    if max_new_tokens is not None and max_new_tokens < 0:
        raise bad_request(f"max_tokens must be a non-negative integer, got {max_new_tokens}", param="max_tokens")
    sp = {"max_new_tokens": max_new_tokens, "temperature": body.temperature, "top_p": body.top_p,
          "top_k": body.top_k, "min_p": body.min_p, "seed": body.seed, "stop": body.stop,
          "stop_token_ids": body.stop_token_ids, "ignore_eos": bool(body.ignore_eos),
          "skip_special_tokens": body.skip_special_tokens is not False,
          "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
          "repetition_penalty": body.repetition_penalty, "logit_bias": body.logit_bias or None,
          "regex": body.regex, "ebnf": body.ebnf}
    return {k: v for k, v in sp.items() if v is not None}


def response_format_schema(fmt: dict | None) -> str | None:
    """OpenAI's response_format -> the json_schema sampling parameter (a JSON string; None for text)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                              param="response_format")
        return json.dumps(schema)
    raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                      param="response_format")


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def openai_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    spec = tm.info.spec_enabled

    def model_card() -> dict:
        return {"id": tm.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "specserve",
                "root": shown_path(tm.shown_model_path, tm.args.show_internal_info),
                "max_model_len": tm.info.context_len}

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        """One model (the openai client's models.retrieve): this server's, under any name a request may use."""
        tm.check_model(model_id)
        return model_card()

    # ------------------------------------------------------------------ chat
    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await tm.bodies.read(request, ChatCompletionRequest)
        tm.check_model(body.model)
        _refuse_unsupported(body, chat=True)
        parser = tm.args.chat_tool_call_parser
        plan = plan_tools(body, parser)
        # (a 400 for images a model cannot take)
        messages = template_messages(body.messages, images=tm.images.takes_images)
        ids = await tm.off_loop(tm.chat_prompt_ids, messages, body.chat_template_kwargs, plan.tools)
        images = None
        if any(isinstance(m["content"], list) for m in messages):  # decoded, preprocessed, placeholders expanded
            ids, images = await tm.images.off_loop(tm.images.chat_images, body.messages, ids)
        max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_new is None:  # the model's default answer length, else all the room the context leaves
            room = max(tm.info.context_len - len(ids), 0)
            max_new = room if tm.info.default_max_tokens is None else min(tm.info.default_max_tokens, room)
        sampling = _sampling(body, max_new)
        fmt_schema = response_format_schema(body.response_format)
        if plan.json_schema is not None:  # tool_choice required or named: constrained decoding
            if fmt_schema is not None or body.regex or body.ebnf:
                raise bad_request("a forced tool call (tool_choice required or a function) cannot be combined with "
                                  "response_format, regex or ebnf", param="tool_choice")
            sampling["json_schema"] = json.dumps(plan.json_schema)
        elif fmt_schema is not None:
            if body.regex or body.ebnf:
                raise bad_request("give one of response_format, regex and ebnf", param="response_format")
            sampling["json_schema"] = fmt_schema
        output = ChatOutput.for_request(plan, parser, tm.args.reasoning_parser, body.separate_reasoning is not False,
                                        body.chat_template_kwargs, uuid.uuid4().hex[:24])
        # a grammar starts after the reasoning: the engine opens it at the reasoning parser's end marker
        thinking = output.reasoning is not None and output.reasoning.thinking
        n = choice_count(tm, body)
        tm.caps.check_prompt_count(1, n, param="n")  # (n choices of the one prompt)
        reqs = [GenRequest(ids, sp, rid=body.rid, owner=owner_of(request),
                           reasoning_end=THINK_END if thinking else None, return_logprob=bool(body.logprobs),
                           top_logprobs_num=body.top_logprobs or 0, images=images)
                for sp in choice_sampling(sampling, n)]
        await tm.precheck_all(reqs)  # every choice is checked before any is queued
        cid = f"chatcmpl-{body.rid or uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            return sse_response(_chat_events(tm, reqs, cid, created, _include_usage(body), spec, output),
                                request.url.path)
        try:
            lasts = await until_disconnect(request, run_all([tm.generate_one(r) for r in reqs]))
        except ClientGone:
            return client_left(request.url.path, f"before the answer was ready ({len(reqs)} request(s) aborted)")
        choices = []
        for i, last in enumerate(lasts):
            message = output.message(last.text)
            logprobs = None
            if body.logprobs:
                lp = last.meta["output_token_logprobs"]
                logprobs = chat_logprobs([x[1] for x in lp], [x[0] for x in lp], _top(last.meta), tm.decode_token)
            choices.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": finish_with_tools(finish_reason(last.finish_reason),
                                                               "tool_calls" in message),
                            "matched_stop": (last.finish_reason or {}).get("matched")})
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created,
                             "model": tm.served_model_name, "choices": choices, "usage": usage(lasts, spec)})

    # ------------------------------------------------------------------ completions
    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await tm.bodies.read(request, CompletionRequest)
        tm.check_model(body.model)
        _refuse_unsupported(body, chat=False)
        max_new = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        n = choice_count(tm, body)
        prompts = await tm.off_loop(_prompt_ids, tm, body.prompt, n)
        if body.rid is not None and len(prompts) > 1:
            raise bad_request("rid can only be given for a single prompt", param="rid")
        top = body.logprobs or 0
        reqs = [GenRequest(ids, sp, rid=body.rid, owner=owner_of(request), return_logprob=body.logprobs is not None,
                           top_logprobs_num=top,
                           logprob_start_len=0 if body.echo and body.logprobs is not None else -1)
                for ids in prompts for sp in choice_sampling(_sampling(body, max_new), n)]  # choice p * n + i
        await tm.precheck_all(reqs)  # all prompts are checked before any is queued
        cid = f"cmpl-{body.rid or uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            echo = [tm.decode_ids(r.input_ids) if body.echo else "" for r in reqs]
            return sse_response(_completion_events(tm, reqs, cid, created, _include_usage(body), spec, echo),
                                request.url.path)
        try:
            lasts = await until_disconnect(request, run_all([tm.generate_one(r) for r in reqs]))
        except ClientGone:
            return client_left(request.url.path, f"before the answer was ready ({len(reqs)} request(s) aborted)")
        echo = [tm.decode_ids(r.input_ids) if body.echo else "" for r in reqs]
        choices = [{"index": i, "text": echo[i] + c.text, "logprobs": _completion_lp(tm, c, len(echo[i]))
                    if body.logprobs is not None else None,
                    "finish_reason": finish_reason(c.finish_reason),
                    "matched_stop": (c.finish_reason or {}).get("matched")} for i, c in enumerate(lasts)]
        return JSONResponse({"id": cid, "object": "text_completion", "created": created,
                             "model": tm.served_model_name, "choices": choices, "usage": usage(lasts, spec)})

    return router


def _top(meta: dict) -> list | None:
    """meta_info.output_top_logprobs as [(id, logprob), ...] per position (None without)."""
    top = meta.get("output_top_logprobs")
    return None if top is None else [[(t, v) for v, t, _ in pos] for pos in top]


def _completion_lp(tm: TokenizerManager, c: GenChunk, offset: int) -> dict:
    """A finished choice's logprobs; with echo (offset > 0, the prompt's logprobs in meta_info) the prompt's
    tokens first, from text offset 0, the first of them None."""
    lp = c.meta["output_token_logprobs"]
    out = completion_logprobs([x[1] for x in lp], [x[0] for x in lp], _top(c.meta), tm.decode_token, offset)
    if "input_token_logprobs" not in c.meta:
        return out
    ilp = c.meta["input_token_logprobs"]
    itop = c.meta.get("input_top_logprobs")
    top = None if itop is None else [[] if pos is None else [(t, v) for v, t, _ in pos] for pos in itop]
    pre = completion_logprobs([x[1] for x in ilp], [x[0] for x in ilp], top, tm.decode_token, 0)
    if top is not None:
        pre["top_logprobs"][0] = None  # the first prompt token has no distribution
    return {k: pre[k] + out[k] if pre[k] is not None and out[k] is not None else out[k] for k in out}


def _prompt_ids(tm: TokenizerManager, prompt, n: int = 1) -> list[list[int]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of token-id lists; n choices each. The
    request caps are checked before anything is tokenised (text: by its length), then on the tokens."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    elif isinstance(prompt[0], int):
        tm.caps.check_prompt_count(1, n)
        tm.caps.check_prompt_tokens([prompt])
        return [list(prompt)]
    else:
        prompts = prompt
    tm.caps.check_prompt_count(len(prompts), len(prompts) * n)
    if isinstance(prompts[0], str):
        tm.caps.check_prompt_chars(prompts)
        ids = [tm.encode(p) for p in prompts]
    else:
        ids = [list(p) for p in prompts]
    tm.caps.check_prompt_tokens(ids)
    return ids


async def _chat_events(tm: TokenizerManager, reqs: list[GenRequest], cid: str, created: int, include_usage: bool,
                       spec: bool, output: ChatOutput) -> AsyncIterator[str]:
    """The chat stream of n choices (one request each), interleaved as their updates arrive, each with its own
    parser stream; a choice's last chunk carries its finish_reason."""
    def chunk(i: int, delta: dict, reason: str | None = None) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": tm.served_model_name,
               "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            out["usage"] = None
        return out

    try:
        for i in range(len(reqs)):
            yield sse(chunk(i, {"role": "assistant", "content": ""}))
        streams = [output.stream() for _ in reqs]
        lasts: dict[int, GenChunk] = {}
        async with contextlib.aclosing(merge_streams([tm.generate(r) for r in reqs])) as events:
            async for i, c in events:
                stream = streams[i]
                deltas = stream.feed(c.text_delta) if c.text_delta else []
                if c.new_logprobs:  # the update's tokens' logprobs ride on its first chunk
                    lp = chat_logprobs(c.new_ids, c.new_logprobs, c.new_top_logprobs, tm.decode_token)
                    first = chunk(i, deltas[0] if deltas else {"content": ""})
                    first["choices"][0]["logprobs"] = lp
                    yield sse(first)
                    deltas = deltas[1:]
                for delta in deltas:
                    yield sse(chunk(i, delta))
                if c.finished:
                    lasts[i] = c
                    for delta in stream.finish():
                        yield sse(chunk(i, delta))
                    yield sse(chunk(i, {}, finish_with_tools(finish_reason(c.finish_reason), stream.called)))
        if include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                       "model": tm.served_model_name, "choices": [],
                       "usage": usage([lasts[i] for i in sorted(lasts)], spec)})
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE


async def _completion_events(tm: TokenizerManager, reqs: list[GenRequest], cid: str, created: int,
                             include_usage: bool, spec: bool, echo: list[str]) -> AsyncIterator[str]:
    def chunk(index: int, text: str, reason: str | None = None, c: GenChunk | None = None) -> dict:
        lp = None
        if c is not None and c.new_logprobs is not None:
            lp = completion_logprobs(c.new_ids, c.new_logprobs, c.new_top_logprobs, tm.decode_token,
                                     len(echo[index]) + len(c.text) - len(c.text_delta))
        out = {"id": cid, "object": "text_completion", "created": created, "model": tm.served_model_name,
               "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}]}
        if include_usage:
            out["usage"] = None
        return out

    lasts: dict[int, GenChunk] = {}
    try:
        for i, text in enumerate(echo):
            if text:
                yield sse(chunk(i, text))
        async with contextlib.aclosing(merge_streams([tm.generate(r) for r in reqs])) as events:
            async for i, c in events:
                if c.finished:
                    lasts[i] = c
                    yield sse(chunk(i, c.text_delta, finish_reason(c.finish_reason), c))
                elif c.text_delta or c.new_logprobs:
                    yield sse(chunk(i, c.text_delta, c=c))
        if include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": tm.served_model_name,
                       "choices": [], "usage": usage([lasts[i] for i in sorted(lasts)], spec)})
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE
