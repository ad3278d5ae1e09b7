"""SGLang's native routes: /generate, /health, /health_generate, /get_model_info, /get_server_info, /metrics,
/abort_request, /flush_cache.

/generate takes "text" (a string or a list) or "input_ids" (a list of ids or a list of lists), "sampling_params"
(SGLang names; one dict or one per prompt), "stream", "rid", "return_hidden_states" (with
--enable-return-hidden-states: meta_info.hidden_states once finished), "image_data" (a vision-language model: SGLang's
images, one `<|vision_start|><|image_pad|><|vision_end|>` in the prompt per image; see _images). It answers {"text",
"output_ids", "meta_info", "usage"} (a list for a batch); streamed, every event carries the cumulative text and output
ids, then [DONE]. meta_info.cached_tokens is how many prompt tokens the prefix cache gave (0 until the engine admits
the request).

/flush_cache (GET or POST, as SGLang) empties the prefix cache when the engine is idle: 200 "Cache flushed.", or 400
(nothing flushed) while requests run or wait. The answer is plain text, as SGLang's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import specserve
from specserve.server.access import owner_of
from specserve.server.errors import APIError, bad_request, client_left
from specserve.server.image_inputs import load_generate_images
from specserve.server.info_view import shown_args, shown_path, shown_runtime
from specserve.server.openai_routes import choice_sampling
from specserve.server.protocol import AbortRequestBody, GenerateRequest
from specserve.server.streaming import SSE_DONE, ClientGone, merge_streams, run_all, sse, sse_response, until_disconnect
from specserve.server.tokenizer_manager import GenChunk, GenRequest, TokenizerManager

HEALTH_GENERATE_TIMEOUT_S = 30.0

# SGLang sampling keys we accept at their neutral value only (clients often send them explicitly).
_NEUTRAL = {"min_new_tokens": 0, "no_stop_trim": False, "spaces_between_special_tokens": True,
            "logprob_start_len": -1}  # (a request field in SGLang, not a sampling parameter)


def normalize_sgl_sampling(sp: dict) -> dict:
    """SGLang sampling_params -> our SamplingParams keys; unsupported options with non-neutral values -> 400."""
    out = {}
    for k, v in sp.items():
        if k in _NEUTRAL:
            if v is not None and v != _NEUTRAL[k]:
                raise bad_request(f"sampling_params.{k}={v!r} is not supported (only {_NEUTRAL[k]!r})",
                                  param=f"sampling_params.{k}")
            continue
        if k == "n":  # the number of samples: the route expands the prompt into n requests first
            continue
        if k == "sampling_seed":  # SGLang's name for the per-request seed
            k = "seed"
        out[k] = v
    return out


def _result(c: GenChunk) -> dict:
    prompt, completion = c.meta["prompt_tokens"], c.meta["completion_tokens"]
    return {"text": c.text, "output_ids": c.output_ids, "meta_info": c.meta,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def _prompts(tm: TokenizerManager, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The request's prompts' ids (text tokenised) and whether it is a single prompt (not a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of 'text' or 'input_ids'", param="text")
    if body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if single else body.text
        if not texts:
            raise bad_request("the 'text' list is empty", param="text")
        tm.caps.check_prompt_count(len(texts), param="text")  # the caps first: nothing is tokenised past them
        tm.caps.check_prompt_chars(texts, param="text")
        prompts = [tm.encode(t) for t in texts]
        tm.caps.check_prompt_tokens(prompts, param="text")
    else:
        ids = body.input_ids
        single = not ids or isinstance(ids[0], int)
        if not single:
            tm.caps.check_prompt_count(len(ids), param="input_ids")
        tm.caps.check_prompt_tokens([ids] if single else ids, param="input_ids")
        prompts = [list(ids)] if single else [list(x) for x in ids]
    return prompts, single


def _images(tm: TokenizerManager, body: GenerateRequest, prompts: list[list[int]],
            single: bool) -> tuple[list[list[int]], list]:
    """Each prompt's images (image_data) decoded and preprocessed, its placeholders expanded (an image worker
    thread's work); the request caps checked on the expanded prompts. Raises 400."""
    if body.image_data is None:
        return prompts, [None] * len(prompts)
    tm.images.check_takes_images("image_data")
    per_prompt = load_generate_images(body.image_data, None if single else len(prompts), tm.images.limits)
    out = [tm.images.expand_images(p, imgs, "image_data") for p, imgs in zip(prompts, per_prompt, strict=True)]
    prompts = [ids for ids, _ in out]
    tm.caps.check_prompt_tokens(prompts, param="image_data")
    return prompts, [pre for _, pre in out]


def _requests(tm: TokenizerManager, body: GenerateRequest, owner: str = "",
              prepared: tuple[list[list[int]], bool, list] | None = None) -> tuple[list[GenRequest], bool]:
    """The request's GenRequests (one per prompt and choice) and whether it is a single prompt. prepared: (prompts,
    single, each prompt's images) from _prompts and _images; None: the prompts of a request without images."""
    if prepared is None:
        prepared = (*_prompts(tm, body), None)
    prompts, single, images = prepared
    n = len(prompts)
    images = images or [None] * n
    sps = body.sampling_params
    if isinstance(sps, list):
        if len(sps) != n:
            raise bad_request(f"sampling_params has {len(sps)} entries for {n} prompts", param="sampling_params")
    else:
        sps = [sps or {}] * n
    # each choice is a request of its own: the choices of all prompts stay within the prompt cap
    tm.caps.check_prompt_count(n, sum(tm.caps.check_n(sp.get("n", 1), param="sampling_params.n") for sp in sps),
                          param="sampling_params.n")
    rids = body.rid
    if isinstance(rids, str):
        if n != 1:
            raise bad_request("give one rid per prompt (a list) for a batch", param="rid")
        rids = [rids]
    elif isinstance(rids, list):
        if len(rids) != n or len(set(rids)) != n:
            raise bad_request(f"rid must be a list of {n} distinct ids", param="rid")
    else:
        rids = [None] * n
    start = [-1 if s is None else s for s in _per_prompt(body.logprob_start_len, n, "logprob_start_len", -1)]
    logprob = [bool(x) for x in _per_prompt(body.return_logprob, n, "return_logprob", False)]
    top = [x or 0 for x in _per_prompt(body.top_logprobs_num, n, "top_logprobs_num", 0)]
    hidden = [bool(x) for x in _per_prompt(body.return_hidden_states, n, "return_hidden_states", False)]
    reqs = []
    for p, im, sp, r, h, lp, k, st in zip(prompts, images, sps, rids, hidden, logprob, top, start, strict=True):
        sp = dict(sp)
        n = tm.caps.check_n(sp.pop("n", 1), param="sampling_params.n")
        if n > 1 and r is not None:
            raise bad_request("rid can only be given with n = 1", param="rid")
        single = single and n == 1  # SGLang: n samples of one prompt come back as a list
        reqs += [GenRequest(p, s, rid=r, owner=owner, return_hidden_states=h, return_logprob=lp, top_logprobs_num=k,
                            logprob_start_len=st if lp else -1, images=im)
                 for s in choice_sampling(normalize_sgl_sampling(sp), n)]
    return reqs, single


def _per_prompt(value, n: int, name: str, default) -> list:
    """A /generate option given once for all prompts or as a list of one per prompt."""
    if isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value
    return [default if value is None else value] * n


def native_router(tm: TokenizerManager, probe_ids: list[int]) -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        body: GenerateRequest = await tm.bodies.read(request, GenerateRequest)
        tm.check_model(body.model)
        prompts, single = await tm.off_loop(_prompts, tm, body)
        images: list = [None] * len(prompts)
        if body.image_data is not None:  # decoded and preprocessed off the event loop, placeholders expanded
            prompts, images = await tm.images.off_loop(_images, tm, body, prompts, single)
        reqs, single = await tm.off_loop(_requests, tm, body, owner_of(request), (prompts, single, images))
        await tm.precheck_all(reqs)  # all prompts are checked before any is queued
        if body.stream:
            return sse_response(_generate_events(tm, reqs), request.url.path)
        try:
            lasts = await until_disconnect(request, run_all([tm.generate_one(r) for r in reqs]))
        except ClientGone:
            return client_left(request.url.path, f"before the answer was ready ({len(reqs)} request(s) aborted)")
        results = [_result(c) for c in lasts]
        return JSONResponse(results[0] if single else results)

    @router.get("/health")
    async def health() -> Response:
        tm.check_available()
        return Response(status_code=200)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        tm.check_available()
        await tm.health_generate(probe_ids, HEALTH_GENERATE_TIMEOUT_S)
        return Response(status_code=200)

    @router.get("/get_model_info")
    async def get_model_info() -> dict:
        show = tm.args.show_internal_info
        return {"model_path": shown_path(tm.shown_model_path, show),
                "tokenizer_path": shown_path(tm.args.tokenizer_path or tm.shown_model_path, show),
                "is_generation": True, "served_model_name": tm.served_model_name,
                "architecture": tm.info.architecture, "context_length": tm.info.context_len}

    @router.get("/get_server_info")
    async def get_server_info() -> dict:
        args = shown_args(tm.args)
        args["model_path"] = shown_path(tm.shown_model_path, tm.args.show_internal_info)
        runtime = shown_runtime(tm.runtime_info(), tm.args.show_internal_info)
        return {**args, "version": specserve.__version__, "served_model_name": tm.served_model_name, **runtime,
                "internal_states": [runtime]}

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(tm.metrics.render(), media_type=tm.metrics.content_type)

    @router.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        body = await tm.bodies.read(request, AbortRequestBody)
        return {"aborted": tm.abort_request(body.rid, owner_of(request), "aborted by /abort_request")}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        res = await tm.flush_cache()
        if res.success:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(f"Cache not flushed: {res.num_running} requests are running and {res.num_waiting} "
                                 "waiting. The prefix cache can only be flushed when the server is idle.\n",
                                 status_code=400)

    return router


async def _generate_events(tm: TokenizerManager, reqs: list[GenRequest]) -> AsyncIterator[str]:
    try:
        async with contextlib.aclosing(merge_streams([tm.generate(r) for r in reqs])) as events:
            async for i, c in events:
                event = _result(c) if c.finished else {"text": c.text, "output_ids": c.output_ids,
                                                       "meta_info": c.meta}
                if len(reqs) > 1:
                    event["index"] = i
                yield sse(event)
    except APIError as e:
        yield sse(e.body())
    yield SSE_DONE
