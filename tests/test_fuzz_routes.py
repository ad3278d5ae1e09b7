"""Property-based fuzzing (hypothesis) of the OpenAI and native routes on one live tiny-model server.

Arbitrary JSON values, near-valid requests with a field mutated, and raw bytes are posted to /v1/chat/completions,
/v1/completions, /generate and /abort_request. Each answer is a 2xx or a 4xx, never a 5xx, a dropped connection or a
timeout; a 4xx is OpenAI-shaped ({"error": {"message": str, "type": str, ...}}); a 2xx has the route's shape and no
more completion tokens than asked for. A thread polls /health every 50 ms for the whole module (a stalled event loop
shows up there), and at the end the server is idle with every KV page back.

derandomize=True and no example database: every run posts the same examples, so a CI failure reproduces locally.
Bodies are built as text here (ASCII escapes), so lone surrogates travel as \\udXXX escapes, NaN/Infinity as the
JSON extensions Python's json reads, and numbers json.dumps cannot write (over 4300 digits, 1e999) verbatim. The
model's context is 64 tokens, so even a huge or absent max_tokens ends within a few dozen tokens.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import threading
import time

import httpx
import pytest
from helpers import build_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import LiveServer, start_server

pytestmark = pytest.mark.slow

CHAT, COMP, GEN, ABORT = "/v1/chat/completions", "/v1/completions", "/generate", "/abort_request"
ROUTES = [CHAT, COMP, GEN, ABORT]
TIMEOUT_S = 20.0  # per request; a timeout fails the example
MAX_NEW = 8  # generated valid bodies ask for at most this many tokens
CONTEXT = 64
MAX_PROMPTS, MAX_N = 4, 3  # the server's request caps (--max-prompts-per-request, --max-n), low enough to reach
HEALTH_EVERY_S = 0.05
HEALTH_MAX_S = 2.0
JSON_HEADERS = {"content-type": "application/json"}


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------------- server, /health poller, client
class HealthPoller(threading.Thread):
    """GET /health every 50 ms on its own keep-alive connection; records each poll's latency and any failure."""

    def __init__(self, url: str):
        super().__init__(name="health-poller", daemon=True)
        self.url = url
        self.stopped = threading.Event()
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while True:  # at least one poll, however soon it is stopped
                t0 = time.perf_counter()
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code != 200:
                        self.failures.append(f"/health answered {r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(f"/health raised {e!r}")
                self.latencies.append(time.perf_counter() - t0)
                if self.stopped.wait(HEALTH_EVERY_S):
                    return

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=30)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_routes")
    # A context of 64 tokens bounds every generation (max_tokens huge or absent) to a few dozen tokens.
    model = build_tiny_model(str(root / "tiny"), "llama", seed=7, max_position_embeddings=CONTEXT)
    srv = start_server(["--model-path", model, "--max-total-tokens", "4096", "--skip-warmup",
                        "--max-request-body-mb", "1", "--max-prompts-per-request", str(MAX_PROMPTS),
                        "--max-n", str(MAX_N)], str(root / "server.log"))
    poller = HealthPoller(srv.url)
    poller.start()
    yield srv, poller
    poller.stop()
    srv.terminate()


@pytest.fixture
def server(live) -> LiveServer:
    return live[0]


@pytest.fixture
def client(server):
    """One keep-alive client for all examples of a test; _post fails an example after which the server closed the
    connection, or that raised (a reset, a timeout)."""
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


# ---------------------------------------------------------------------- JSON built as text
class Raw(str):
    """JSON text placed in the body verbatim."""


def to_json(v) -> str:
    """ensure_ascii text: lone surrogates become \\udXXX escapes, nan/inf NaN/Infinity, Raw stays as it is."""
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=True)}: {to_json(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(to_json(x) for x in v) + "]"
    return json.dumps(v, ensure_ascii=True)


def server_view(raw: bytes):
    """The body as the server's json.loads sees it, or None where it cannot (then it must be a 4xx anyway)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


# ---------------------------------------------------------------------- strategies
SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc00", "a\ud83db", "x \ud83d", "\ude00 tail", "ok\udbff"])
ANY_CHAR_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
TEXT = st.one_of(st.text(max_size=12), ANY_CHAR_TEXT, SURROGATES, st.sampled_from(["", " ", "tiny", "hello", "\x00"]))
HUGE_INTS = st.one_of(
    st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]),
    st.integers(min_value=-(2**200), max_value=2**200),
    # more digits than Python's int() takes by default (4300)
    st.integers(min_value=4290, max_value=4400).map(lambda n: Raw("9" * n)),
)
RAW_FLOATS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-400", "-0", "-0.0", "4.9e-324",
                              "1.7976931348623157e308", "123456789012345678901234567890.5"]).map(Raw)
FLOATS = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e-300, 1e300]),
                   RAW_FLOATS)
DEEP = st.integers(min_value=1, max_value=3000).map(lambda d: Raw("[" * d + "]" * d))
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(), HUGE_INTS, FLOATS, TEXT, DEEP)
FIELD_NAMES = ["model", "messages", "role", "content", "prompt", "text", "input_ids", "sampling_params",
               "max_tokens", "max_new_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
               "seed", "stop", "stop_token_ids", "stream", "stream_options", "include_usage", "n", "logprobs", "rid",
               "chat_template_kwargs", "ignore_eos", "type"]
KEYS = st.one_of(st.sampled_from(FIELD_NAMES), TEXT)
JSON_VALUES = st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(KEYS, kids, max_size=4),
                           max_leaves=12)
# Top level: any value, or an object whose keys are mostly the routes' field names (gets past "not an object").
BODIES = st.one_of(JSON_VALUES, st.dictionaries(KEYS, JSON_VALUES, max_size=6))


def _ids(max_size: int = 6):
    return st.lists(st.one_of(st.integers(0, 255), st.sampled_from([-1, 256, 2**31, 10**30, True, 1.0])),
                    max_size=max_size)


SMALL_N = st.one_of(st.integers(0, MAX_NEW), st.sampled_from([-1, -(2**63), 2**31, 2**63, 10**30, 1.0, 4.5, "4",
                                                               True, None, Raw("9" * 4301), Raw("1e999")]))
TEMPERATURE = st.sampled_from([0, 0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-8, 1e-5, 0.7, 1, 2.0, 100, 100.0001, -1e-9,
                               math.nan, math.inf, 10**400, "0.5", True, None, [0.5]])
TOP_P = st.sampled_from([0, 1e-9, 0.5, 1, 1.0, 1.0000001, -0.1, math.nan, -math.inf, None, "1"])
TOP_K = st.sampled_from([-2, -1, 0, 1, 2, 255, 256, 10**9, 2**63 - 1, 2**63, 2**70, -(2**70), 1.0, True, None])
MIN_P = st.sampled_from([0, 0.0, 0.5, 1, 1.0, 1.5, -0.1, math.nan, math.inf, None])
SEED = st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64, 10**30, 1.5, "1", None, True])
STOP = st.one_of(TEXT, st.lists(st.text(min_size=1, max_size=3), max_size=40),
                 st.sampled_from(["s" * 1024, "s" * 1025, ["a"] * 16, ["a"] * 17]),
                 st.lists(st.one_of(TEXT, st.integers(), st.none()), max_size=4), st.sampled_from([[], [""], None]))
STOP_IDS = st.one_of(_ids(8), st.sampled_from([[], [2], [0, 1, 2, 255], [-1], [10**30], [256], "2", None]))
BOOLISH = st.sampled_from([True, False, None, 0, 1, "true", [], {}])
STREAM_OPTIONS = st.sampled_from([{"include_usage": True}, {"include_usage": False}, {}, {"include_usage": "yes"},
                                  {"include_usage": None}, {"continuous_usage_stats": True}, None, "x", [], 1])
STREAM = st.sampled_from([True, False, None, 1, "true"])
N = st.sampled_from([1, 0, 2, MAX_N, MAX_N + 1, -1, 10**30, 1.0, None, "1"])
PENALTY = st.sampled_from([0, 0.0, -0.0, 0.5, -2, 2, math.nan, None, "0"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "", 1]), "text": TEXT})
CONTENT = st.one_of(TEXT, st.none(), st.lists(PART, max_size=3), st.lists(st.one_of(TEXT, st.integers()), max_size=2))
ROLE = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot", "", "USER", None, 1])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": CONTENT},
                                optional={"name": TEXT, "tool_calls": JSON_VALUES, "extra": JSON_VALUES})
MESSAGES = st.one_of(st.lists(MESSAGE, max_size=3), st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
    min_size=1, max_size=3))
TEMPLATE_KWARGS = st.one_of(
    st.dictionaries(st.sampled_from(["tools", "documents", "chat_template", "continue_final_message", "tokenize",
                                     "add_generation_prompt", "return_dict", "return_tensors", "padding",
                                     "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
                                     "sanitize_control_tokens", "enable_thinking", "messages", "conversation"]),
                    JSON_VALUES, max_size=3),
    st.dictionaries(TEXT, JSON_VALUES, max_size=3), st.sampled_from([None, {}, [], "x"]))
PROMPT = st.one_of(TEXT, st.lists(TEXT, max_size=MAX_PROMPTS + 2), _ids(), st.lists(_ids(4), max_size=MAX_PROMPTS + 2),
                   st.sampled_from(["", [], [[]], [[1], []], ["a", 1], [1, "a"], [[1], "a"], "x" * 600]))
RID = st.one_of(TEXT, st.lists(TEXT, max_size=3), st.integers(), st.none())
LOGIT_BIAS = st.sampled_from([None, {}, {"1": 0.0}, {"1": 5}, {"x": "y"}, [], "x"])

OPENAI_FIELDS = {
    ("model",): st.one_of(TEXT, st.sampled_from(["tiny", None, 1])), ("max_tokens",): SMALL_N,
    ("temperature",): TEMPERATURE, ("top_p",): TOP_P, ("top_k",): TOP_K, ("min_p",): MIN_P, ("seed",): SEED,
    ("stop",): STOP, ("stop_token_ids",): STOP_IDS, ("ignore_eos",): BOOLISH, ("skip_special_tokens",): BOOLISH,
    ("n",): N, ("stream",): STREAM, ("stream_options",): STREAM_OPTIONS, ("presence_penalty",): PENALTY,
    ("frequency_penalty",): PENALTY, ("logit_bias",): LOGIT_BIAS, ("user",): TEXT, ("rid",): RID,
}
SAMPLING_KEYS = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "sampling_seed", "stop",
                 "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "min_new_tokens", "no_stop_trim", "spaces_between_special_tokens",
                 "logprob_start_len", "bogus"]
_BY_NAME = {"max_new_tokens": SMALL_N, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "min_p": MIN_P,
            "seed": SEED, "sampling_seed": SEED, "stop": STOP, "stop_token_ids": STOP_IDS, "n": N,
            "frequency_penalty": PENALTY, "presence_penalty": PENALTY, "repetition_penalty": PENALTY,
            "min_new_tokens": SMALL_N}
FIELDS = {
    CHAT: {**OPENAI_FIELDS, ("messages",): MESSAGES, ("messages", 0, "role"): ROLE,
           ("messages", 0, "content"): CONTENT, ("max_completion_tokens",): SMALL_N,
           ("logprobs",): BOOLISH, ("top_logprobs",): N, ("tools",): st.sampled_from([None, [], [{"type": "x"}], "x"]),
           ("tool_choice",): st.sampled_from([None, "auto", "none", {}]),
           ("response_format",): st.sampled_from([None, {}, {"type": "text"}, {"type": "json_object"}, "x"]),
           ("chat_template_kwargs",): TEMPLATE_KWARGS},
    COMP: {**OPENAI_FIELDS, ("prompt",): PROMPT, ("logprobs",): st.sampled_from([None, 0, 1, 5, -1, True]),
           ("echo",): BOOLISH, ("best_of",): N, ("suffix",): st.one_of(TEXT, st.none())},
    GEN: {("text",): st.one_of(TEXT, st.lists(TEXT, max_size=MAX_PROMPTS + 2)),
          ("input_ids",): st.one_of(_ids(), st.lists(_ids(4), max_size=MAX_PROMPTS + 2)),
          ("sampling_params",): st.one_of(st.dictionaries(st.sampled_from(SAMPLING_KEYS), LEAVES, max_size=3),
                                          st.lists(st.fixed_dictionaries({"max_new_tokens": SMALL_N}), max_size=3),
                                          JSON_VALUES),
          **{("sampling_params", k): _BY_NAME.get(k, BOOLISH) for k in SAMPLING_KEYS},
          ("stream",): STREAM, ("rid",): RID, ("model",): st.one_of(TEXT, st.sampled_from(["tiny", None])),
          ("return_logprob",): st.sampled_from([False, True, None, [False], [True, False], 0])},
    ABORT: {("rid",): RID},
}
TEXT_PATHS = {CHAT: [("model",), ("messages", 0, "content"), ("rid",), ("user",), ("stop",)],
              COMP: [("model",), ("prompt",), ("rid",), ("user",), ("stop",), ("suffix",)],
              GEN: [("text",), ("rid",), ("model",), ("sampling_params", "stop")], ABORT: [("rid",)]}
NESTED = {CHAT: [("messages", 0), ("stream_options",), ("chat_template_kwargs",)], COMP: [("stream_options",)],
          GEN: [("sampling_params",)]}
BASES = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    COMP: {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0},
    GEN: {"text": "hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    ABORT: {"rid": "no-such-request"},
}


def _set(body: dict, path: tuple, value) -> None:
    cur = body
    for k in path[:-1]:
        ok = (isinstance(cur, dict) and k in cur) or (isinstance(cur, list) and isinstance(k, int) and k < len(cur))
        if not ok:
            return  # an earlier mutation replaced the parent
        cur = cur[k]
    if isinstance(cur, dict) or (isinstance(cur, list) and isinstance(path[-1], int) and path[-1] < len(cur)):
        cur[path[-1]] = value


def _delete(body: dict, path: tuple) -> None:
    cur = body
    for k in path[:-1]:
        if not isinstance(cur, dict) or k not in cur:
            return
        cur = cur[k]
    if isinstance(cur, dict):
        cur.pop(path[-1], None)


@st.composite
def near_valid(draw, route: str) -> dict:
    """The route's valid base body with one or two mutations: a field set to an edge value of its kind, to junk or
    to odd text (lone surrogates), a field removed, an unknown field added, or streaming turned on."""
    body = copy.deepcopy(BASES[route])
    fields = FIELDS[route]
    paths = sorted(fields, key=repr)
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["edge", "edge", "edge", "junk", "delete", "extra", "unicode", "stream"]))
        path = draw(st.sampled_from(paths))
        if op == "stream":  # streamed, with any stream_options on the OpenAI routes
            if route != ABORT:
                body["stream"] = True
            if route in (CHAT, COMP):
                body["stream_options"] = draw(STREAM_OPTIONS)
        elif op == "unicode":  # a text field gets a lone surrogate (or other odd text)
            _set(body, draw(st.sampled_from(TEXT_PATHS[route])), draw(st.one_of(SURROGATES, ANY_CHAR_TEXT)))
        elif op == "edge":
            _set(body, path, draw(fields[path]))
        elif op == "junk":
            _set(body, path, draw(JSON_VALUES))
        elif op == "delete":
            _delete(body, path)
        else:  # an unknown field, at the top or in a nested object
            where = draw(st.sampled_from([(), *NESTED.get(route, [])]))
            _set(body, (*where, draw(TEXT)), draw(JSON_VALUES))
    return body


@st.composite
def truncated_valid(draw) -> bytes:
    raw = to_json(draw(st.sampled_from(ROUTES).flatmap(near_valid))).encode()
    return raw[:draw(st.integers(0, len(raw) - 1))]  # a proper prefix of an object is never valid JSON


# ---------------------------------------------------------------------- checks
def _post(client: httpx.Client, server: LiveServer, route: str, raw: bytes, headers=None) -> httpx.Response:
    """POST, then GET /health on the same client: the keep-alive connection must still be the one the answer came
    on (a server that closes it after answering makes httpx open a new one, or the GET hits a reset)."""
    what = f"POST {route} {raw[:600]!r}"
    t0 = time.perf_counter()
    try:
        r = client.post(route, content=raw, headers=JSON_HEADERS if headers is None else headers)
    except httpx.HTTPError as e:
        pytest.fail(f"{what} raised {e!r} (connection dropped or timed out)\nserver log:\n{server.log(6000)}")
    took = time.perf_counter() - t0
    assert took < TIMEOUT_S, f"{what} took {took:.1f} s"
    if r.status_code >= 500:
        # uvicorn closes the connection after a 5xx: a request on it here takes the reset (httpx then drops the
        # connection), so the next example (shrinking goes on after a failure) does not fail on a reset not its own.
        with contextlib.suppress(httpx.HTTPError):
            client.get("/health")
        pytest.fail(_why(r, route, raw, server, "a 5xx answer"))
    conn = r.extensions.get("network_stream")
    try:
        same = client.get("/health").extensions.get("network_stream") is conn or conn is None
    except httpx.HTTPError:
        same = False
    if not same:
        pytest.fail(_why(r, route, raw, server, "the server closed the keep-alive connection after answering"))
    return r


def _why(r: httpx.Response, route: str, raw: bytes, server: LiveServer, what: str) -> str:
    return f"{what}: POST {route} {raw[:600]!r} -> {r.status_code} {r.text[:600]}\nserver log:\n{server.log(6000)}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _asked_max(route: str, view) -> int | None:
    """The most completion tokens the (valid) body allows per prompt, where it says so."""
    if not isinstance(view, dict):
        return None
    if route == CHAT and view.get("max_completion_tokens") is not None:
        n = view["max_completion_tokens"]
    elif route in (CHAT, COMP):
        n = view.get("max_tokens")
    else:
        sp = view.get("sampling_params")
        n = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    return n if _is_int(n) else None


def _gen_max(view, i: int) -> int | None:
    sp = view.get("sampling_params") if isinstance(view, dict) else None
    if isinstance(sp, list) and i < len(sp) and isinstance(sp[i], dict):
        sp = sp[i]
    n = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    return n if _is_int(n) else None


def _sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def check_answer(r: httpx.Response, route: str, raw: bytes, server: LiveServer) -> None:
    """2xx or 4xx; a 4xx is OpenAI-shaped; a 2xx has the route's shape and respects the token limit."""
    def why(what: str) -> str:
        return _why(r, route, raw, server, what)

    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, why("not a 2xx or 4xx")
    if r.status_code >= 400:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str), \
            why("a 4xx that is not OpenAI-shaped")
        return
    view = server_view(raw)
    limit = _asked_max(route, view)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = _sse_events(r.text)
        assert events and events[-1] == "[DONE]", why("a stream that does not end with [DONE]")
        body = events[:-1]
        assert all(isinstance(e, dict) and "error" not in e for e in body), why("an error inside a 200 stream")
        used = [e["usage"]["completion_tokens"] for e in body if isinstance(e.get("usage"), dict)]
        used += [e["meta_info"]["completion_tokens"] for e in body
                 if isinstance(e.get("meta_info"), dict) and e["meta_info"].get("finish_reason")]
        if route == GEN:
            assert all(_gen_max(view, e.get("index", 0)) is None or
                       e["meta_info"]["completion_tokens"] <= _gen_max(view, e.get("index", 0))
                       for e in body if e["meta_info"].get("finish_reason")), why("more tokens than max_new_tokens")
        elif limit is not None:
            n_prompts = max(len({c["index"] for e in body for c in e.get("choices", [])}), 1)
            assert all(u <= limit * n_prompts for u in used), why("more tokens than max_tokens")
        return
    body = r.json()
    if route == ABORT:
        assert isinstance(body, dict) and isinstance(body.get("aborted"), bool), why("bad /abort_request answer")
        return
    if route == GEN:
        results = body if isinstance(body, list) else [body]
        assert results, why("an empty batch answer")
        assert len(results) <= MAX_PROMPTS, why("more prompts and choices than --max-prompts-per-request")
        for i, res in enumerate(results):
            assert isinstance(res["text"], str) and all(_is_int(t) for t in res["output_ids"]), why("bad result")
            done = res["meta_info"]["completion_tokens"]
            assert done == len(res["output_ids"]) == res["usage"]["completion_tokens"], why("inconsistent counts")
            cap = _gen_max(view, i)
            assert cap is None or done <= cap, why("more tokens than max_new_tokens")
        return
    choices = body["choices"]
    assert len(choices) <= MAX_PROMPTS, why("more prompts and choices than --max-prompts-per-request")
    assert choices and all(c["finish_reason"] in ("stop", "length", "abort") for c in choices), why("bad choices")
    if route == CHAT:
        msg = choices[0]["message"]
        assert msg["role"] == "assistant" and isinstance(msg["content"], str), why("bad chat message")
    else:
        assert all(isinstance(c["text"], str) for c in choices), why("bad completion text")
    done = body["usage"]["completion_tokens"]
    assert _is_int(done), why("usage.completion_tokens is not an int")
    assert limit is None or done <= limit * len(choices), why("more tokens than max_tokens")


# ---------------------------------------------------------------------- properties
@pytest.mark.parametrize("route", ROUTES)
@fuzz_settings(60)
@given(value=BODIES)
def test_arbitrary_json_values(server, client, route, value):
    raw = to_json(value).encode()
    check_answer(_post(client, server, route, raw), route, raw, server)


@pytest.mark.parametrize("route", ROUTES)
@fuzz_settings(120)
@given(data=st.data())
def test_near_valid_requests(server, client, route, data):
    raw = to_json(data.draw(near_valid(route), label="body")).encode()
    check_answer(_post(client, server, route, raw), route, raw, server)


CONTENT_TYPES = st.sampled_from([JSON_HEADERS, {"content-type": "text/plain"}, {},
                                 {"content-type": "application/x-www-form-urlencoded"},
                                 {"content-type": "multipart/form-data; boundary=x"}])


@fuzz_settings(150)
@given(route=st.sampled_from(ROUTES), raw=st.one_of(st.binary(max_size=4096), truncated_valid()),
       headers=CONTENT_TYPES)
def test_raw_bytes_are_4xx(server, client, route, raw, headers):
    r = _post(client, server, route, raw, headers)
    assert 400 <= r.status_code < 500, _why(r, route, raw, server, "not a 4xx")
    check_answer(r, route, raw, server)


NON_JSON_TYPES = st.sampled_from(["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                  "multipart/form-data; boundary=x", "application/jsonp", "text/json", "",
                                  "application/json-seq", "application/xml", "*/*"])


@fuzz_settings(40)
@given(route=st.sampled_from(ROUTES), data=st.data(), ctype=NON_JSON_TYPES)
def test_bodies_that_are_not_declared_json_are_415(server, client, route, data, ctype):
    """Whatever the body, a route that reads JSON refuses another content type (a page in a browser can send those
    across origins without a preflight) before reading it."""
    raw = to_json(data.draw(near_valid(route), label="body")).encode()
    r = _post(client, server, route, raw, {"content-type": ctype} if ctype else {})
    assert r.status_code == 415, _why(r, route, raw, server, f"not a 415 for content-type {ctype!r}")
    check_answer(r, route, raw, server)


# ---------------------------------------------------------------------- afterwards (keep last)
def test_no_stall_and_idle_after_fuzzing(live):
    server, poller = live
    poller.stop()
    assert poller.latencies, "the /health poller never ran"
    assert not poller.failures, poller.failures[:5]
    worst = max(poller.latencies)
    assert worst < HEALTH_MAX_S, f"/health took {worst:.2f} s at worst ({len(poller.latencies)} polls)"
    info = server.wait_idle()
    assert info["kv_free_pages"] == info["kv_initial_free_pages"], info
    assert info["num_http_requests"] == 0 and info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0, info
