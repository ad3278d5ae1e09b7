"""`specserve soak`: a seeded mix of valid, aborted and malformed requests against a live server, then checks that
it answered each correctly, that greedy answers repeat when re-run alone, and that it ends idle with every KV page
back. Example:
    specserve soak --base-url http://127.0.0.1:30000 --num-requests 500 --concurrency 12 --seed 1 --server-pid PID

Prompts are ASCII letters and spaces, whose character count bounds their token count (tokenizers do not split ASCII
below one token per character; the BOS and the chat template are measured), so prompt + max tokens always fit the
context and an `ignore_eos` request without stop strings must return exactly its max tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields

import aiohttp

from specserve.bench import target
from specserve.bench.backends import REQUEST_ERRORS, NativeStream, OpenAIStream, RequestOutput, SSEDecoder
from specserve.server_args import CommandParser

ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "generate": "/generate"}
VALID_KINDS = tuple(f"{r}{s}" for r in ROUTES for s in ("", "_stream"))
KINDS = (*VALID_KINDS, "abort", "bad")
JSON_HEADERS = {"Content-Type": "application/json"}
ALPHABET = string.ascii_lowercase + " " * 5  # words of about five letters
IDLE_KEYS = ("num_running_reqs", "num_queue_reqs", "num_http_requests", "kv_free_pages", "kv_initial_free_pages")
STOPS = ("e", "th", ". ", "q")  # frequent and rare substrings, so some requests stop early and some never do


@dataclass
class SoakRequest:
    index: int
    kind: str  # one of KINDS
    route: str
    body: dict | None = None  # None: `raw` bytes are sent instead (malformed JSON)
    raw: bytes | None = None
    stream: bool = False
    greedy: bool = False
    max_tokens: int = 0
    exact: bool = False  # ignore_eos, no stop string: exactly max_tokens completion tokens are due
    stop: list[str] = field(default_factory=list)
    abort: str | float | None = None  # "first" (close after the first chunk) or seconds to wait before closing
    bad: str = ""  # which malformed input

    def describe(self) -> dict:
        payload = self.raw.decode("utf-8", "replace") if self.raw is not None else json.dumps(self.body)
        tag = self.bad or (f"abort:{self.abort}" if self.kind == "abort" else "greedy" if self.greedy else "sampled")
        return {"index": self.index, "kind": self.kind, "what": tag, "route": self.route, "body": payload[:2000]}


@dataclass
class Outcome:
    status: int = 0
    error: str = ""  # transport / stream error
    text: str = ""
    tokens: int | None = None  # server-reported completion tokens; None when the answer did not say
    finish: str | None = None
    done: bool = False  # non-streaming: a body parsed; streaming: [DONE] seen
    closed_early: bool = False
    body: str = ""  # the body of a non-200 answer


# ---------------------------------------------------------------------- the mix (pure, seeded)
def _prompt(rng: random.Random, n_chars: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n_chars)).strip() or "a"


def _prompt_chars(rng: random.Random, room: int) -> int:
    """Short prompts, mid-length ones, and ones near the room the context leaves (those fill a small KV pool)."""
    u = rng.random()
    if u < 0.4 or room <= 16:
        return rng.randint(1, min(16, room))
    if u < 0.75:
        return rng.randint(16, room)
    return rng.randint(max(16, int(room * 0.85)), room)


def _body(route: str, model: str, prompt: str, sp: dict, stream: bool, usage: bool) -> dict:
    if route == "/generate":
        keys = {"max_tokens": "max_new_tokens"}
        return {"text": prompt, "stream": stream, "sampling_params": {keys.get(k, k): v for k, v in sp.items()}}
    body = {"model": model, "stream": stream, **sp}
    body["messages" if route == ROUTES["chat"] else "prompt"] = (
        [{"role": "user", "content": prompt}] if route == ROUTES["chat"] else prompt)
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


def _valid(rng: random.Random, i: int, kind: str, model: str, room: int, max_new: int) -> SoakRequest:
    route, stream, greedy = ROUTES[kind.removesuffix("_stream")], kind.endswith("_stream"), rng.random() < 0.6
    n = rng.randint(1, max_new)
    sp: dict = {"max_tokens": n, "temperature": 0.0 if greedy else 0.8}
    if not greedy:
        sp["seed"] = rng.randint(0, 2**31 - 1)
    sp["ignore_eos"] = rng.random() < (0.85 if greedy else 0.3)
    stop = [rng.choice(STOPS)] if rng.random() < 0.15 else []
    if stop:
        sp["stop"] = stop
    usage = rng.random() < 0.8  # some OpenAI streams without a usage chunk: their count is unknown, their end is not
    body = _body(route, model, _prompt(rng, _prompt_chars(rng, room - n)), sp, stream, usage)
    return SoakRequest(i, kind, route, body, stream=stream, greedy=greedy, max_tokens=n,
                       exact=sp["ignore_eos"] and not stop, stop=stop)


def _abort(rng: random.Random, i: int, model: str, room: int, max_new: int) -> SoakRequest:
    route = rng.choice(list(ROUTES.values()))
    sp = {"max_tokens": max_new, "temperature": 0.0, "ignore_eos": True}  # long enough to be running when closed
    body = _body(route, model, _prompt(rng, _prompt_chars(rng, room - max_new)), sp, True, True)
    when = "first" if rng.random() < 0.5 else round(rng.uniform(0.0, 0.2), 3)
    return SoakRequest(i, "abort", route, body, stream=True, max_tokens=max_new, abort=when)


def _bad_inputs(model: str) -> list[tuple[str, str, dict | bytes]]:
    """(name, route, body): each must get a 4xx with an OpenAI-shaped error, never a 5xx."""
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    comp = {"model": model, "prompt": "hi", "max_tokens": 4}
    return [
        ("malformed_json", ROUTES["chat"], b'{"model": "x", "messages": ['),
        ("malformed_json", ROUTES["generate"], b"{not json"),
        ("wrong_type", ROUTES["chat"], {**chat, "max_tokens": "4"}),
        ("wrong_type", ROUTES["chat"], {**chat, "messages": "hi"}),
        ("wrong_type", ROUTES["generate"], {"text": "hi", "sampling_params": {"temperature": "hot"}}),
        ("negative_max_tokens", ROUTES["completion"], {**comp, "max_tokens": -1}),
        ("negative_max_tokens", ROUTES["completion"], {**comp, "max_tokens": -3, "stream": True}),
        ("negative_max_tokens", ROUTES["generate"], {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
        ("unknown_model", ROUTES["chat"], {**chat, "model": "no-such-model"}),
        ("unknown_model", ROUTES["completion"], {**comp, "model": "no-such-model", "stream": True}),
        ("empty_prompt", ROUTES["completion"], {**comp, "prompt": ""}),
        ("empty_prompt", ROUTES["chat"], {**chat, "messages": []}),
        ("empty_prompt", ROUTES["generate"], {"text": ""}),
        ("bad_token_ids", ROUTES["generate"], {"input_ids": [1, 2, 10**9]}),
        ("bad_token_ids", ROUTES["generate"], {"input_ids": [-1, 5], "stream": True}),
        ("bad_token_ids", ROUTES["completion"], {**comp, "prompt": [5, 10**9]}),
    ]


def _bad(rng: random.Random, i: int, model: str) -> SoakRequest:
    name, route, body = rng.choice(_bad_inputs(model))
    raw = isinstance(body, bytes)
    return SoakRequest(i, "bad", route, None if raw else body, raw=body if raw else None, bad=name)


def make_mix(n: int, seed: int, model: str, context_len: int, max_new_tokens: int = 32, abort_fraction: float = 0.1,
             bad_fraction: float = 0.05, overhead: int = 32) -> list[SoakRequest]:
    """n requests drawn from `seed` alone. overhead: tokens a prompt costs beyond its text (BOS, chat template)."""
    rng = random.Random(seed)
    room = max(2, context_len - 1 - overhead)  # prompt chars + max tokens must stay under the context
    max_new = max(1, min(max_new_tokens, room // 2))

    def draw(i: int) -> SoakRequest:
        u = rng.random()
        if u < bad_fraction:
            return _bad(rng, i, model)
        if u < bad_fraction + abort_fraction:
            return _abort(rng, i, model, room, max_new)
        return _valid(rng, i, rng.choice(VALID_KINDS), model, room, max_new)

    return [draw(i) for i in range(n)]


# ---------------------------------------------------------------------- sending
def _parse_whole(route: str, j: dict, out: Outcome) -> None:
    if route == ROUTES["generate"]:
        meta = j["meta_info"]
        out.text, out.tokens, out.finish = j["text"], meta["completion_tokens"], meta["finish_reason"]["type"]
    else:
        c = j["choices"][0]
        out.text = c["message"]["content"] if route == ROUTES["chat"] else c["text"]
        out.tokens, out.finish = j["usage"]["completion_tokens"], c["finish_reason"]
    out.done = True


async def _read_stream(resp: aiohttp.ClientResponse, req: SoakRequest, out: Outcome) -> None:
    ro = RequestOutput()
    parser = NativeStream(ro) if req.route == ROUTES["generate"] else OpenAIStream(ro, req.route == ROUTES["chat"])
    decoder = SSEDecoder()
    try:
        async for chunk in resp.content.iter_any():
            for data in decoder.feed(chunk):
                if data == "[DONE]":
                    out.done = True
                    return
                parser.feed(json.loads(data), time.perf_counter())
                if req.abort == "first":
                    out.closed_early = True
                    return
    finally:
        out.text, out.tokens, out.finish = ro.text, ro.output_len, ro.finish_reason


async def send(session: aiohttp.ClientSession, base: str, req: SoakRequest) -> Outcome:
    out = Outcome()
    kw = {"data": req.raw, "headers": JSON_HEADERS} if req.raw is not None else {"json": req.body}
    try:
        async with session.post(base + req.route, **kw) as resp:
            out.status = resp.status
            if resp.status != 200 or not req.stream:
                out.body = await resp.text()
                if resp.status == 200:
                    _parse_whole(req.route, json.loads(out.body), out)
                return out
            reading = _read_stream(resp, req, out)
            if isinstance(req.abort, float):
                try:
                    await asyncio.wait_for(reading, req.abort)
                except asyncio.TimeoutError:
                    out.closed_early = True
            else:
                await reading
            if out.closed_early:
                resp.close()  # drop the connection itself, as a client that goes away does
    except REQUEST_ERRORS as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


# ---------------------------------------------------------------------- checks
def _openai_error(body: str) -> bool:
    try:
        err = json.loads(body)["error"]
        return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
    except (ValueError, KeyError, TypeError):
        return False


def check(req: SoakRequest, out: Outcome) -> str | None:
    """What is wrong with the answer to req, or None."""
    if out.status >= 500:
        return f"HTTP {out.status}: {out.body[:300]}"
    if req.kind == "bad":
        if not 400 <= out.status < 500:
            return f"a bad input got HTTP {out.status}, not a 4xx: {out.body[:300]}"
        return None if _openai_error(out.body) else f"a 4xx without an OpenAI-shaped error body: {out.body[:300]}"
    if out.error and not (req.kind == "abort" and out.status == 200):
        return out.error
    if out.status != 200:
        return f"HTTP {out.status}: {out.body[:300]}"
    if req.kind == "abort":
        return None  # anything up to the close is fine; what matters is the idle check afterwards
    if not out.done:
        return "the stream ended without [DONE]"
    if out.finish not in ("stop", "length"):
        return f"finish_reason {out.finish!r}"
    if out.tokens is None and (req.route == ROUTES["generate"] or "stream_options" in req.body):
        return "the answer reported no completion token count"
    if out.tokens is not None and (out.tokens != req.max_tokens if req.exact else out.tokens > req.max_tokens):
        return f"{out.tokens} completion tokens, {'expected' if req.exact else 'max'} {req.max_tokens}"
    if req.exact and out.finish != "length":
        return f"finish_reason {out.finish!r} with ignore_eos and no stop string"
    if any(s in out.text for s in req.stop):
        return f"the text holds a stop string {req.stop}: {out.text[-80:]!r}"
    return None


# ---------------------------------------------------------------------- server state
async def get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


def read_rss_kb(pid: int | None) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError, TypeError):
        return None  # gone, or not on this machine


def child_pid(pid: int | None) -> int | None:
    """The engine process among the children of the server process `pid` (Linux /proc; multiprocessing's resource
    tracker is a child too), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
        for k in kids:
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"resource_tracker" not in f.read():
                    return k
    except (OSError, ValueError, TypeError):
        pass
    return None


async def wait_idle(session: aiohttp.ClientSession, base: str, timeout: float) -> tuple[bool, dict]:
    """Poll until nothing runs, queues or is tracked and every KV page is back."""
    deadline = time.monotonic() + timeout
    while True:
        info = await get_json(session, base + "/get_server_info")
        idle = all(info[k] == 0 for k in IDLE_KEYS[:3]) and info["kv_free_pages"] == info["kv_initial_free_pages"]
        if idle or time.monotonic() > deadline:
            return idle, info
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------- the run
@dataclass
class SoakConfig:
    base_url: str = "http://127.0.0.1:30000"
    num_requests: int = field(default=200, metadata={"help": "requests in the mixed run"})
    concurrency: int = field(default=8, metadata={"help": "requests in flight at most"})
    seed: int = field(default=1, metadata={"help": "draws the whole mix"})
    abort_fraction: float = field(default=0.1, metadata={"help": "streams closed after the first chunk or a delay"})
    bad_fraction: float = field(default=0.05, metadata={"help": "malformed requests (each must get a 4xx)"})
    max_new_tokens: int = 32
    server_pid: int | None = field(default=None, metadata={"help": "report VmRSS of this process and its engine"})
    determinism_samples: int = field(default=8, metadata={"help": "greedy requests re-run alone at the end"})
    idle_timeout: float = 30.0  # seconds for the server to be idle with every page back
    request_timeout: float = 300.0  # a hang shows up as a failed request, not as a soak that never ends


async def _overhead(session: aiohttp.ClientSession, base: str, model: str) -> int:
    """Prompt tokens beyond the text itself, measured on a one-character chat prompt: the template's, plus a BOS."""
    body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with session.post(base + ROUTES["chat"], json=body) as resp:
        return 2 + ((await resp.json())["usage"]["prompt_tokens"] if resp.status == 200 else 32)


async def _mixed_run(session, base: str, reqs: list[SoakRequest], cfg: SoakConfig, pids: dict, rss: dict
                     ) -> list[Outcome]:
    sem, done, warm_at = asyncio.Semaphore(cfg.concurrency), 0, max(1, len(reqs) // 10)

    async def one(r: SoakRequest) -> Outcome:
        nonlocal done
        async with sem:
            o = await send(session, base, r)
        done += 1
        if done == warm_at:  # memory after warm-up: lazy allocations and caches are in place by now
            for k, p in pids.items():
                rss[k]["warm"] = read_rss_kb(p)
        return o

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def _rerun_greedy(session, base: str, pairs: list[tuple[SoakRequest, Outcome]], cfg: SoakConfig
                        ) -> tuple[int, list[dict]]:
    """A sample of the passed greedy requests, re-run one at a time: batching and retraction must not change them."""
    greedy = [(r, o) for r, o in pairs if r.greedy and r.kind in VALID_KINDS and o.done and check(r, o) is None]
    sample = random.Random(cfg.seed + 1).sample(greedy, min(cfg.determinism_samples, len(greedy)))
    failures = []
    for r, o in sample:
        again = await send(session, base, r)
        if (again.text, again.tokens) != (o.text, o.tokens):
            failures.append({**r.describe(), "error": f"greedy re-run differs: {o.text!r} ({o.tokens} tokens) then "
                                                      f"{again.text!r} ({again.tokens} tokens)"})
    return len(sample), failures


async def run_soak(cfg: SoakConfig) -> dict:
    base = target.base_url("", 0, cfg.base_url)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model_info = await get_json(session, base + "/get_model_info")
        model = model_info["served_model_name"]
        start_info = await get_json(session, base + "/get_server_info")
        # the engine's pid is shown only with --show-internal-info; else it is the server process's child
        engine_pid = start_info.get("engine_pid") or child_pid(cfg.server_pid)
        pids = {"server": cfg.server_pid, "engine": engine_pid} if cfg.server_pid else {}
        rss = {k: {"pid": p, "start": read_rss_kb(p)} for k, p in pids.items()}
        reqs = make_mix(cfg.num_requests, cfg.seed, model, model_info["context_length"], cfg.max_new_tokens,
                        cfg.abort_fraction, cfg.bad_fraction, await _overhead(session, base, model))
        t0 = time.perf_counter()
        outs = await _mixed_run(session, base, reqs, cfg, pids, rss)
        duration = time.perf_counter() - t0
        retractions = (await get_json(session, base + "/get_server_info"))["num_retractions"]
        pairs = list(zip(reqs, outs))
        failures = [{**r.describe(), "error": e} for r, o in pairs if (e := check(r, o))]
        n_rerun, rerun_failures = await _rerun_greedy(session, base, pairs, cfg)
        failures += rerun_failures
        idle, end = await wait_idle(session, base, cfg.idle_timeout)
    leaked = end["kv_initial_free_pages"] - end["kv_free_pages"]
    if not idle:
        state = ", ".join(f"{k}={end[k]}" for k in IDLE_KEYS)
        failures.append({"index": None, "kind": "idle", "error": f"not idle {cfg.idle_timeout} s after the run: "
                                                                 f"{state}"})
    for k, p in pids.items():
        m = rss[k]
        m["end"] = read_rss_kb(p)
        m["growth"] = None if None in (m["start"], m["end"]) else m["end"] - m["start"]
    kinds = Counter(r.kind for r in reqs)
    return {"requests": len(reqs), "kinds": dict(sorted(kinds.items())),
            "completed": sum(r.kind in VALID_KINDS and o.status == 200 and o.done for r, o in pairs),
            "aborted": kinds["abort"], "aborted_early": sum(o.closed_early for o in outs), "bad": kinds["bad"],
            "bad_status": dict(sorted(Counter(str(o.status) for r, o in pairs if r.kind == "bad").items())),
            "failures": failures, "num_failures": len(failures),
            "retractions": retractions - start_info["num_retractions"], "determinism_checked": n_rerun,
            "duration_s": round(duration, 3), "rss_kb": rss, "leaks": {"kv_pages": leaked, "idle": idle},
            "ok": not failures and leaked == 0 and idle}


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="specserve soak", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(SoakConfig):  # one flag per config field, so the two cannot drift apart
        kind = int if f.default is None else type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata.get("help"))
    p.add_argument("--output-file", default=None, help="write the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.num_requests < 1 or a.concurrency < 1 or a.max_new_tokens < 1:
        parser.error("--num-requests, --concurrency and --max-new-tokens must be >= 1")
    if min(a.abort_fraction, a.bad_fraction) < 0 or a.abort_fraction + a.bad_fraction > 1:
        parser.error("--abort-fraction and --bad-fraction must be >= 0 and sum to at most 1")
    cfg = SoakConfig(**{f.name: getattr(a, f.name) for f in fields(SoakConfig)})
    try:
        summary = asyncio.run(run_soak(cfg))
    except (aiohttp.ClientError, OSError, KeyError) as e:
        print(f"specserve soak: cannot query {cfg.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(summary, indent=2)
    print(text)
    if a.output_file:
        with open(a.output_file, "w") as f:
            f.write(text + "\n")
    return 0 if summary["ok"] else 1
