"""One streaming request per backend: payload building, SSE decoding and per-chunk timing.

Backends: "specserve"/"sglang" (native POST /generate: every event carries the cumulative text and meta_info),
"openai" (POST /v1/completions: deltas in choices[0].text), "openai-chat" (POST /v1/chat/completions: deltas in
choices[0].delta.content). Output token counts come from what the server reports (meta_info / usage), never from
counting chunks: with speculation one chunk carries several tokens. So do prompt tokens the server's prefix cache
gave (meta_info.cached_tokens, usage.prompt_tokens_details.cached_tokens), when it reports them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from specserve.bench.datasets import BenchRequest

# Keys of --extra-request-body that the native backend moves into "sampling_params", so the same JSON works for
# every backend.
NATIVE_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                        "max_new_tokens", "skip_special_tokens", "frequency_penalty", "presence_penalty")


@dataclass
class RequestOutput:
    """What one request measured. Times are seconds (time.perf_counter clock)."""

    success: bool = False
    error: str = ""
    text: str = ""
    start_time: float = 0.0  # when the request was sent
    ttft: float = 0.0  # first content chunk - start (latency when no chunk carried content)
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    latency: float = 0.0  # end of stream - start
    prompt_len: int = 0  # server-reported when available, else our own count
    output_len: int | None = None  # server-reported completion tokens; None when the server did not say
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache gave; None when it did not say
    accept_length: float | None = None  # speculative accept length of this request (tokens per verify step)
    verify_ct: int | None = None  # number of verify steps behind accept_length
    finish_reason: str | None = None


class StreamError(RuntimeError):
    """The server sent an error object inside an otherwise successful (HTTP 200) stream."""


class SSEDecoder:
    """Bytes in, `data:` payloads out. Splits lines itself: aiohttp's line iterator refuses lines over 64 KiB, and the
    native backend's cumulative text grows past that on long outputs."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if line.startswith("data:"):
                out.append(line[5:].strip())
            # blank lines end an event; ":" comments, "event:" and "id:" lines carry nothing we need
        return out


class _Timer:
    """TTFT and ITL from the arrival times of content-bearing chunks."""

    def __init__(self, out: RequestOutput):
        self.out = out
        self._last: float | None = None

    def content(self, now: float) -> None:
        if self._last is None:
            self.out.ttft = now - self.out.start_time
        else:
            self.out.itl.append(now - self._last)
        self._last = now

    def finish(self, now: float) -> None:
        self.out.latency = now - self.out.start_time
        if self._last is None:
            self.out.ttft = self.out.latency


def _raise_on_error(ev: dict) -> None:
    err = ev.get("error")
    if err:
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise StreamError(str(msg))


class NativeStream:
    """SGLang-style /generate events: {"text": cumulative, "meta_info": {prompt_tokens, completion_tokens,
    cached_tokens?, finish_reason, spec_accept_length?, spec_verify_ct?}}."""

    def __init__(self, out: RequestOutput):
        self.out = out
        self.timer = _Timer(out)
        self.events = 0

    def feed(self, ev: dict, now: float) -> None:
        _raise_on_error(ev)
        self.events += 1
        meta = ev.get("meta_info") or {}
        text = ev.get("text", "")
        n = meta.get("completion_tokens")
        # A chunk is content when the token count grew (text can stay empty: an incomplete UTF-8 sequence).
        grew = n > (self.out.output_len or 0) if n is not None else len(text) > len(self.out.text)
        if grew:
            self.timer.content(now)
        self.out.text = text
        if n is not None:
            self.out.output_len = int(n)
        if meta.get("prompt_tokens") is not None:
            self.out.prompt_len = int(meta["prompt_tokens"])
        if meta.get("cached_tokens") is not None:
            self.out.cached_tokens = int(meta["cached_tokens"])
        if meta.get("spec_accept_length") is not None:
            self.out.accept_length = float(meta["spec_accept_length"])
        if meta.get("spec_verify_ct") is not None:
            self.out.verify_ct = int(meta["spec_verify_ct"])
        fr = meta.get("finish_reason")
        if fr:
            self.out.finish_reason = fr.get("type") if isinstance(fr, dict) else str(fr)

    def finish(self, now: float) -> None:
        self.timer.finish(now)
        if self.out.accept_length is None and self.out.verify_ct and self.out.output_len is not None:
            # servers that report only the verify count (SGLang): tokens per verify step
            self.out.accept_length = self.out.output_len / self.out.verify_ct


class OpenAIStream:
    """OpenAI SSE chunks: text deltas in choices[0].text (completions) or choices[0].delta.content (chat); usage
    (with optional "prompt_tokens_details": {cached_tokens} and "spec": {accept_length, verify_ct}) in the last chunk
    when stream_options.include_usage."""

    def __init__(self, out: RequestOutput, chat: bool):
        self.out = out
        self.chat = chat
        self.timer = _Timer(out)
        self.events = 0
        self._parts: list[str] = []

    def feed(self, ev: dict, now: float) -> None:
        _raise_on_error(ev)
        self.events += 1
        for choice in ev.get("choices") or []:
            if self.chat:
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            else:
                piece = choice.get("text") or ""
            if piece:
                self.timer.content(now)
                self._parts.append(piece)
            if choice.get("finish_reason"):
                self.out.finish_reason = choice["finish_reason"]
        usage = ev.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self.out.output_len = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.out.prompt_len = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.out.cached_tokens = int(details["cached_tokens"])
            spec = usage.get("spec") or {}
            if spec.get("accept_length") is not None:
                self.out.accept_length = float(spec["accept_length"])
            if spec.get("verify_ct") is not None:
                self.out.verify_ct = int(spec["verify_ct"])
        self.out.text = "".join(self._parts)

    def finish(self, now: float) -> None:
        self.timer.finish(now)


@dataclass
class Backend:
    name: str
    path: str  # route under the base URL
    kind: str  # "native" | "completions" | "chat"

    def payload(self, req: BenchRequest, model: str | None, ignore_eos: bool, extra: dict) -> dict:
        if self.kind == "native":
            sp = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}
            body: dict = {"stream": True, "sampling_params": sp}
            if req.prompt_ids is not None:
                body["input_ids"] = req.prompt_ids  # exact prompt length, no re-tokenization
            else:
                body["text"] = req.prompt
            if req.image_data:
                body["image_data"] = req.image_data
            for k, v in extra.items():
                if k == "sampling_params":
                    sp.update(v)
                elif k in NATIVE_SAMPLING_KEYS:
                    sp[k] = v
                else:
                    body[k] = v
            return body
        body = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.kind == "chat":
            body["messages"] = req.chat_messages()
        else:
            body["prompt"] = req.prompt
        if ignore_eos:
            body["ignore_eos"] = True  # an extension that SGLang, vLLM and specserve accept
        body.update(extra)
        return body

    def new_stream(self, out: RequestOutput) -> NativeStream | OpenAIStream:
        return NativeStream(out) if self.kind == "native" else OpenAIStream(out, chat=self.kind == "chat")


BACKENDS = {
    "specserve": Backend("specserve", "/generate", "native"),
    "sglang": Backend("sglang", "/generate", "native"),
    "openai": Backend("openai", "/v1/completions", "completions"),
    "openai-chat": Backend("openai-chat", "/v1/chat/completions", "chat"),
}

# Errors a single request may meet; each is recorded on that request, never fatal to the run.
REQUEST_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, StreamError, ValueError, KeyError, TypeError,
                  AttributeError, UnicodeDecodeError)


async def send_request(session: aiohttp.ClientSession, backend: Backend, url: str, req: BenchRequest,
                       model: str | None, ignore_eos: bool, extra: dict, headers: dict | None = None
                       ) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    body = backend.payload(req, model, ignore_eos, extra)
    stream = backend.new_stream(out)
    out.start_time = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            decoder = SSEDecoder()
            done = False
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                for data in decoder.feed(chunk):
                    if data == "[DONE]":
                        done = True
                        break
                    stream.feed(json.loads(data), now)
                if done:
                    break
        stream.finish(time.perf_counter())
        if stream.events == 0:
            raise StreamError("the response held no SSE 'data:' event (does the server stream this route?)")
        out.success = True
    except REQUEST_ERRORS as e:
        out.error = f"{type(e).__name__}: {e}"
    return out
