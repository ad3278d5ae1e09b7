"""Access control and connection hygiene (issue 46): --api-key on every route but /health; client rids scoped to the
credential that sent them; JSON routes refuse other content types (415); info routes without paths or pids unless
--show-internal-info; 500s and chat-template errors that name no internals; header and body read timeouts; a client
that leaves mid-body or mid-stream is an info-level abort, never a 500; big bodies parsed off the event loop.

The first half runs the FastAPI app in-process (TestClient) with a fake engine; the second half a live tiny-model
server with short timeouts, spoken to over raw sockets where a well-behaved client cannot misbehave enough.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
from helpers import build_tiny_model
from server_fixtures import LiveServer, start_server

from specserve.engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from specserve.server.errors import APIError
from specserve.server.messages import EngineInfo, EngineStats, RequestDelta, StepOutput
from specserve.server.metrics import ServerMetrics
from specserve.server.tokenizer_manager import GenRequest, TokenizerManager
from specserve.server_args import ServerArgs

KEY = "sk-test-0123456789"


class _Engine:
    def __init__(self):
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.on_output = None

    def start_io(self, loop, on_output, on_exit):
        self.on_output = on_output

    def add(self, rid, *_args, **_kw):
        self.added.append(rid)

    def abort(self, rid):
        self.aborted.append(rid)


def _tm(args: ServerArgs, tokenizer=None) -> tuple[TokenizerManager, _Engine]:
    info = EngineInfo(model_path=args.model_path or "/x/m", architecture="Fake", context_len=64, vocab_size=100,
                      max_total_tokens=512, max_running=8, page_size=1, capacity_pages=512, initial_free_pages=512,
                      default_sampling={}, spec_enabled=False, load_time=0.0, pid=4242)
    eng = _Engine()
    tm = TokenizerManager(args, tokenizer, eng, info, "m", ServerMetrics("m"))
    return tm, eng


def _client(args: ServerArgs):
    from fastapi.testclient import TestClient

    from specserve.server.app import create_app

    tm, _ = _tm(args)
    tm.attach(None)
    return TestClient(create_app(tm, [1]), raise_server_exceptions=False)


# ---------------------------------------------------------------------- API key
ROUTES = [("GET", "/v1/models"), ("GET", "/v1/models/m"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
          ("GET", "/metrics"), ("GET", "/health_generate"), ("GET", "/flush_cache"), ("POST", "/flush_cache"),
          ("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/abort_request")]


def test_api_key_guards_every_route_but_health():
    http = _client(ServerArgs(model_path="/x/m", api_key=KEY))
    for method, path in ROUTES:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY}):
            r = http.request(method, path, headers=headers, json={"model": "m"})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "authentication_error" and KEY not in r.text
    assert http.get("/health").status_code == 200  # a load balancer's probe needs no secret
    ok = {"Authorization": f"Bearer {KEY}"}
    assert http.get("/v1/models", headers=ok).json()["data"][0]["id"] == "m"
    assert http.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200  # scheme: any case
    r = http.post("/v1/completions", headers=ok, json={"model": "m"})  # through the check to the route's own 400
    assert r.status_code == 400 and "prompt" in r.text
    assert 'status="401"' in http.get("/metrics", headers=ok).text  # the refusals are counted
    # without --api-key nothing is asked
    assert _client(ServerArgs(model_path="/x/m")).get("/v1/models").status_code == 200


# ---------------------------------------------------------------------- content type
def test_json_routes_refuse_other_content_types():
    http = _client(ServerArgs(model_path="/x/m"))
    body = json.dumps({"model": "m"}).encode()  # valid JSON, missing its prompt: a 400 once read
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/abort_request"):
        for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x", None):
            headers = {} if ctype is None else {"content-type": ctype}
            r = http.post(path, content=body, headers=headers)
            assert r.status_code == 415, (path, ctype, r.status_code, r.text)
            assert "application/json" in r.json()["error"]["message"]
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON",
                      "application/vnd.api+json"):
            r = http.post(path, content=body, headers={"content-type": ctype})
            assert r.status_code == 400, (path, ctype, r.status_code, r.text)
    assert http.post("/v1/completions", data={"model": "m", "prompt": "hi"}).status_code == 415  # a form


# ---------------------------------------------------------------------- info routes
def test_info_routes_show_no_paths_pids_or_key_unless_asked():
    secret = "/srv/secret-dir"
    args = dict(model_path=f"{secret}/Model-7B", tokenizer_path=f"{secret}/tok", api_key=KEY,
                dist_init_addr="10.1.2.3:5000")
    ok = {"Authorization": f"Bearer {KEY}"}
    http = _client(ServerArgs(**args))
    texts = [http.get(p, headers=ok).text for p in ("/v1/models", "/get_model_info", "/get_server_info")]
    for t in texts:
        assert secret not in t and KEY not in t and "4242" not in t and "10.1.2.3" not in t, t
    info = json.loads(texts[2])
    assert info["model_path"] == "Model-7B" and info["tokenizer_path"] == "tok" and "engine_pid" not in info
    assert json.loads(texts[0])["data"][0]["root"] == "Model-7B"
    assert json.loads(texts[1])["model_path"] == "Model-7B"
    assert info["max_request_body_mb"] == 32.0 and "api_key" not in info  # the harmless arguments stay
    # the operator's view: whole paths and the pid, never the key
    http = _client(ServerArgs(**args, show_internal_info=True))
    info = http.get("/get_server_info", headers=ok).json()
    assert info["model_path"] == f"{secret}/Model-7B" and info["engine_pid"] == 4242
    assert info["dist_init_addr"] == "10.1.2.3:5000" and "api_key" not in info
    assert KEY not in http.get("/get_server_info", headers=ok).text


# ---------------------------------------------------------------------- errors
def test_an_internal_error_names_no_internals():
    """_Engine.add raises here (no such engine method takes these arguments): the 500 says where to look, not
    what broke."""
    from fastapi.testclient import TestClient

    from specserve.server.app import create_app

    class Broken(_Engine):
        def add(self, *_a, **_kw):
            raise KeyError("/srv/secret/internal_table")

    tm, _ = _tm(ServerArgs(model_path="/x/m"))
    tm.engine = Broken()
    tm.attach(None)
    http = TestClient(create_app(tm, [1]), raise_server_exceptions=False)
    r = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    assert "KeyError" not in msg and "secret" not in msg and re.search(r"error id [0-9a-f]{12}", msg), msg


def test_chat_template_errors_name_the_problem_not_jinja(bpe):
    tm, _ = _tm(ServerArgs(model_path="/x/m"), bpe)
    bpe.chat_template = ("{% if messages[0].role != 'user' %}{{ raise_exception('the first message must be the "
                         "user\\'s') }}{% endif %}{% for m in messages %}{{ m.content.missing.deeper }}{% endfor %}")
    with pytest.raises(APIError) as e:  # the template's own message is for the client
        tm.chat_prompt_ids([{"role": "assistant", "content": "hi"}], None)
    assert e.value.status == 400 and "the first message must be the user's" in e.value.message
    with pytest.raises(APIError) as e:  # jinja's own words are not
        tm.chat_prompt_ids([{"role": "user", "content": "hi"}], None)
    assert e.value.status == 400 and "could not be applied" in e.value.message
    assert "undefined" not in e.value.message.lower() and "str object" not in e.value.message


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(["hello world"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_stop_token_ids_are_capped():
    SamplingParams.from_dict({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams.from_dict({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)})


# ---------------------------------------------------------------------- rid scoping
def test_client_rids_are_scoped_to_their_owner(bpe):
    async def go():
        tm, eng = _tm(ServerArgs(model_path="/x/m"), bpe)
        tm.attach(None)
        mine, theirs = (tm.generate(GenRequest([5], {}, rid="job-1", owner=o)) for o in ("alice", "mallory"))
        tasks = [asyncio.ensure_future(g.__anext__()) for g in (mine, theirs)]
        await asyncio.sleep(0)
        assert len(eng.added) == 2 and "job-1" not in eng.added  # the engine sees server-made ids only
        alice_id, mallory_id = tm.labels[("alice", "job-1")], tm.labels[("mallory", "job-1")]
        with pytest.raises(APIError, match="already in use"):  # the same owner may not reuse a live rid
            await tm.generate(GenRequest([5], {}, rid="job-1", owner="alice")).__anext__()
        # mallory's abort of "job-1" hits mallory's own request, never alice's
        assert tm.abort_request("job-1", "mallory", "aborted by /abort_request")
        assert eng.aborted == [mallory_id]
        assert not tm.abort_request("job-1", "eve", "aborted by /abort_request")  # eve has no "job-1"
        assert (await tasks[1]).finish_reason["type"] == "abort"
        assert not tasks[0].done()
        # the server-made id is a capability: whoever knows it may abort
        assert tm.abort_request(alice_id, "eve", "aborted by /abort_request")
        assert (await tasks[0]).meta["id"] == "job-1"  # the client sees its own rid
        for g in (mine, theirs):
            await g.aclose()
        assert tm.reqs == {} and tm.labels == {}

    asyncio.run(go())


def test_validation_runs_once_per_request(bpe):
    """precheck_all validates each prompt and its sampling once (off the loop); generate() does not again."""
    async def go():
        tm, eng = _tm(ServerArgs(model_path="/x/m"), bpe)
        tm.attach(None)
        calls = []
        real = tm.validate
        tm.validate = lambda ids, sp: (calls.append(len(ids)), real(ids, sp))
        reqs = [GenRequest([5, 6], {"max_new_tokens": 1}), GenRequest([7], {"max_new_tokens": 1})]
        await tm.precheck_all(reqs)
        gens = [tm.generate(r) for r in reqs]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)
        assert calls == [2, 1] and len(eng.added) == 2
        done = {"type": "length", "length": 1}
        eng.on_output(StepOutput([RequestDelta(rid, [9], done) for rid in eng.added], [], EngineStats()))
        assert [(await t).finished for t in tasks] == [True, True]
        for g in gens:
            await g.aclose()

    asyncio.run(go())


# ---------------------------------------------------------------------- live: timeouts, departures, big bodies
HEADER_TIMEOUT, BODY_TIMEOUT = 1.0, 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> LiveServer:
    root = tmp_path_factory.mktemp("server_access")
    model = build_tiny_model(str(root / "tiny"), "llama", seed=11, max_position_embeddings=4096)
    srv = start_server(["--model-path", model, "--max-total-tokens", "8192", "--skip-warmup",
                        "--http-header-timeout", str(HEADER_TIMEOUT), "--http-body-timeout", str(BODY_TIMEOUT)],
                       str(root / "server.log"))
    yield srv
    srv.terminate()


def _connect(srv: LiveServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_until_closed(s: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; and when that was (seconds from now)."""
    t0, got = time.perf_counter(), b""
    s.settimeout(limit_s)
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        got += chunk
    return got, time.perf_counter() - t0


def _errors(srv: LiveServer, status: int) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf'specserve:num_request_errors_total\{{[^}}]*status="{status}"[^}}]*\}} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def test_headers_trickled_a_byte_at_a_time_are_cut_off(server):
    s = _connect(server)
    t0 = time.perf_counter()
    closed = False
    try:
        for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n":
            s.sendall(bytes([b]))
            time.sleep(0.05)  # 20 bytes a second: each byte resets uvicorn's keep-alive timer, not ours
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    got, _ = _read_until_closed(s, 10)
    took = time.perf_counter() - t0
    s.close()
    assert closed or got == b"", got
    assert HEADER_TIMEOUT <= took < HEADER_TIMEOUT + 4, took


def test_the_header_timer_leaves_long_responses_and_keepalive_alone(server):
    """A response longer than the header timeout is not cut, and a keep-alive connection serves its next request
    after an idle gap shorter than the timeout."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        t0 = time.perf_counter()
        r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
            "max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}})
        took = time.perf_counter() - t0
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 1000
        conn = r.extensions.get("network_stream")
        time.sleep(HEADER_TIMEOUT / 2)
        r2 = c.get("/health")
        assert r2.status_code == 200 and r2.extensions.get("network_stream") is conn  # the same connection
    if took < HEADER_TIMEOUT:
        pytest.skip(f"the generation took {took:.2f} s, under the header timeout: the first half proves nothing")


def test_a_body_slower_than_the_body_timeout_gets_a_408(server):
    s = _connect(server)
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
              b'{"text": ')
    got, took = _read_until_closed(s, 15)
    s.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert b"--http-body-timeout" in got and BODY_TIMEOUT - 0.5 <= took < BODY_TIMEOUT + 4, took


def test_clients_leaving_mid_body_are_info_level_aborts(server):
    before = _errors(server, 500)
    for _ in range(10):
        s = _connect(server)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"model": "x", "prompt": "' + b"a" * 50)
        time.sleep(0.05)
        s.close()
    time.sleep(1.0)
    log = server.log(200_000)
    assert _errors(server, 500) == before
    assert "Traceback" not in log and " ERROR]" not in log, log[-3000:]
    assert log.count("the client went away before sending the whole request body") >= 10
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_client_leaving_mid_stream_is_one_info_line_and_frees_its_request(server):
    marker = "the client went away mid-stream"
    before = server.log(500_000).count(marker)
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream(
            "POST", "/generate", json={"text": "hello", "stream": True, "sampling_params": {
                "max_new_tokens": 3000, "ignore_eos": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first event
    info = server.wait_idle()
    assert info["num_running_reqs"] == 0 and info["kv_free_pages"] == info["kv_initial_free_pages"]
    time.sleep(0.5)
    log = server.log(500_000)
    assert log.count(marker) == before + 1, log[-3000:]
    assert "Traceback" not in log and " ERROR]" not in log


def test_big_valid_bodies_do_not_stall_the_event_loop(server):
    """Four ~15 MiB bodies (5M prompt token ids; 5M stop_token_ids) are refused with 400s while /health, polled
    every 20 ms, keeps answering. Before bodies were parsed and validated off the loop (twice), /health waited
    1.4-9.4 s."""
    bodies = [json.dumps({"input_ids": [7] * 5_000_000}).encode(),
              json.dumps({"text": "hi", "sampling_params": {"stop_token_ids": [5] * 5_000_000}}).encode()] * 2
    assert all(14 << 20 < len(b) < 16 << 20 for b in bodies)
    lat: list[float] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=server.url, timeout=30) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                lat.append(time.perf_counter() - t0)
                time.sleep(0.02)

    th = threading.Thread(target=poll)
    th.start()
    time.sleep(0.3)
    codes = []

    def post(body):
        r = httpx.post(server.url + "/generate", content=body, headers={"content-type": "application/json"},
                       timeout=120)
        codes.append((r.status_code, r.json()["error"]["message"]))

    posts = [threading.Thread(target=post, args=(b,)) for b in bodies]
    for t in posts:
        t.start()
    for t in posts:
        t.join()
    stop.set()
    th.join()
    assert sorted(c for c, _ in codes) == [400] * 4, codes
    assert any("stop_token_ids" in m for _, m in codes), codes
    assert any("--max-request-prompt-tokens" in m for _, m in codes), codes
    # json.loads and pydantic hold the GIL for one body's parse (~0.2-0.4 s at 15 MiB on this CPU): the bound
    # is a few of those, not seconds
    print("health latency, largest:", [round(x, 3) for x in sorted(lat)[-5:]], "polls", len(lat))
    assert max(lat) < 1.5, sorted(lat)[-5:]
