"""Request models for the OpenAI routes and SGLang's native /generate, the OpenAI usage object, and the body
parser.

Types are strict (a string where a number belongs is a 400, not silently converted); value ranges are left to
SamplingParams so a message reads the same on every route. Unknown fields are ignored, as OpenAI-compatible servers
commonly do, so clients that send extra options keep working; options we cannot honour are refused explicitly by
the routes (logprobs, n > 1, ...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect, Request

from specserve.server.errors import APIError, ClientLeft, bad_request, validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it (checked by server/chat_tools.py)


class ToolCallItem(_Strict):
    """One call of an earlier assistant turn."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # an assistant turn's thinking (templates that keep it read it)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _OpenAISampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (SGLang/vLLM)
    min_p: float | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = False  # extension
    skip_special_tokens: bool | None = True  # extension
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = None  # extension (SGLang/vLLM)
    regex: str | None = None  # extension (SGLang): the output matches this regular expression
    ebnf: str | None = None  # extension (SGLang): the output matches this EBNF grammar
    user: str | None = None
    rid: str | None = None  # extension: a request id (SGLang)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    separate_reasoning: bool | None = True  # extension (SGLang): reasoning_content apart from content
    response_format: dict | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class GenerateRequest(_Strict):
    """SGLang's native /generate body."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool | None = False
    rid: str | list[str] | None = None
    model: str | None = None
    return_logprob: bool | list[bool] | None = False
    top_logprobs_num: int | list[int] | None = 0
    logprob_start_len: int | list[int] | None = -1  # the prompt's logprobs (>= 0) are not supported yet
    return_hidden_states: bool | list[bool] | None = False  # needs --enable-return-hidden-states
    # SGLang's images: one prompt's image (a string) or images (a list); for a batch, one entry per prompt (None, a
    # string or a list). Checked in multimodal/image_inputs.py generate_image_refs.
    image_data: Any = None


class AbortRequestBody(_Strict):
    rid: str


class PromptTokensUsageInfo(BaseModel):
    """OpenAI's usage.prompt_tokens_details (SGLang's PromptTokensUsageInfo)."""

    cached_tokens: int = 0  # prompt tokens the prefix cache gave (not prefilled again)


class SpecUsageInfo(BaseModel):
    """usage.spec (an extension): speculative decoding's tokens per verify step and its verify count."""

    accept_length: float
    verify_ct: int


class UsageInfo(BaseModel):
    """The usage object of an OpenAI answer (or of the last stream chunk with stream_options.include_usage)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensUsageInfo | None = None
    spec: SpecUsageInfo | None = None  # only from a speculating server


def is_json_content_type(value: str) -> bool:
    """application/json, or a structured syntax suffix (application/problem+json), any parameters after ';'."""
    kind = value.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class BodyReader:
    """Reads and parses the JSON bodies of the routes, off the event loop.

    Refused before anything is buffered: a Content-Type other than JSON (415: a web page can only send text/plain
    or form bodies to another origin without a CORS preflight, so requiring JSON keeps pages in a browser on the
    host from posting to the server), a declared or streamed size over the limit (413), a body that has not arrived
    within the timeout (408). Parsing and validation run on worker threads: json.loads and pydantic hold the GIL
    while they run, so the loop still waits for one body's C-level parse (bounded by the body limit; BENCHMARKS.md
    "Event loop"), but Python-level checks over millions of token ids yield it every few ms, as a thread does."""

    def __init__(self, limit: int, timeout_s: float):
        self.limit = limit  # bytes
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="body")

    async def run(self, fn: Callable, *args) -> Any:
        """fn(*args) on a body thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def read(self, request: Request, model: type[BaseModel]) -> Any:
        """The body of a JSON route, parsed and validated into `model` (raises APIError or ClientLeft)."""
        ctype = request.headers.get("content-type")
        if ctype is None or not is_json_content_type(ctype):
            raise APIError(415, f"the request body must be JSON with the header 'Content-Type: application/json' "
                                f"(got {'no Content-Type' if ctype is None else repr(ctype[:100])})")
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._read(request)
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s (--http-body-timeout)",
                           headers={"Connection": "close"}) from None
        except ClientDisconnect:
            raise ClientLeft() from None
        return await self.run(parse_body, raw, model)

    async def _read(self, request: Request) -> bytes:
        too_big = APIError(413, f"the request body exceeds {self.limit} bytes (--max-request-body-mb)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> model, or an APIError(400) saying what is wrong."""
    if not raw:
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits (Python's int-parsing limit)
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
