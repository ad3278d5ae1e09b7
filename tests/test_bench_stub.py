"""`specserve bench` and `specserve eval gsm8k` end to end against a stub server (FastAPI in a thread) that speaks
the specserve / SGLang / OpenAI protocol with known answers: every token is the text "ab" (two tokens when
re-tokenized, so a client that counts text instead of reading usage is caught), chunks carry two tokens (as with
speculation), and accept lengths are exact, so the summaries can be checked number by number. It also plays a prefix
cache: a prompt's cached tokens are its longest common prefix with an earlier prompt (all but its last token at
most), until /flush_cache."""

import asyncio
import json
import math
import re
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from helpers import build_tiny_model  # noqa: E402

from specserve.bench import eval_cli, serving  # noqa: E402
from specserve.bench.datasets import random_requests, shared_prefix_requests  # noqa: E402
from specserve.bench.target import resolve_tokenizer  # noqa: E402

TOKENS_PER_CHUNK = 2
TOKEN_TEXT = "ab"
EOS_AFTER = 6  # without ignore_eos the stub "meets EOS" after this many tokens
SERVER_ACCEPT = 2.25


class StubState:
    def __init__(self, model_path: str):
        self.model_path = model_path
        self.fail_every = 0  # every n-th generation request answers HTTP 500 (0: never)
        self.count = 0
        self.lock = threading.Lock()
        self.prompt_lens: list[int] = []  # what the stub reported, per request
        self.cached: list[int] = []  # the cached tokens it reported, per request
        self.seen: list = []  # earlier prompts (id lists or texts), until a flush
        self.flushes = 0
        self.flush_busy = False  # /flush_cache answers 400 (requests running) when set

    def cache(self, prompt) -> int:
        """The stub's prefix cache: the longest prefix prompt shares with an earlier one, then remember it."""
        with self.lock:
            best = 0
            for old in self.seen:
                n = 0
                while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                    n += 1
                best = max(best, n)
            self.seen.append(prompt)
            cached = min(best, len(prompt) - 1)
            self.cached.append(cached)
            return cached

    def next_fails(self) -> bool:
        with self.lock:
            self.count += 1
            return bool(self.fail_every) and self.count % self.fail_every == 0


def _num_tokens(max_tokens: int, ignore_eos: bool) -> int:
    return max_tokens if ignore_eos else min(max_tokens, EOS_AFTER)


def _spec(n: int) -> tuple[float, int]:
    verify = math.ceil(n / TOKENS_PER_CHUNK)
    return n / verify, verify


def _gsm8k_reply(question: str, chat: bool) -> str:
    """Right for plain "What is A plus B?", off by one when the question says "tricky", no number when it says
    "impossible"."""
    m = re.search(r"What is (\d+) plus (\d+)\?", question)
    if "impossible" in question or not m:
        return "I do not know."
    ans = int(m.group(1)) + int(m.group(2)) + (1 if "tricky" in question else 0)
    return f"Adding gives {ans}. The answer is {ans}." if chat else f" {m.group(1)} + {m.group(2)} = {ans}.\n#### {ans}"


def make_app(st: StubState) -> FastAPI:
    app = FastAPI()

    def sse(events):
        async def gen():
            for ev in events:
                await asyncio.sleep(0.002)
                yield f"data: {json.dumps(ev)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": st.model_path, "tokenizer_path": st.model_path, "served_model_name": "stub-model"}

    @app.get("/get_server_info")
    async def server_info():
        return {"version": "stub", "internal_states": [{"avg_spec_accept_length": SERVER_ACCEPT}]}

    @app.post("/flush_cache")
    async def flush_cache():
        if st.flush_busy:
            return PlainTextResponse("Cache not flushed: requests are running.", status_code=400)
        with st.lock:
            st.flushes += 1
            st.seen.clear()
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/generate")
    async def generate(req: Request):
        body = await req.json()
        if st.next_fails():
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
        sp = body["sampling_params"]
        prompt = body["input_ids"] if "input_ids" in body else body["text"]
        prompt_len = len(prompt)
        st.prompt_lens.append(prompt_len)
        cached = st.cache(prompt)
        n = _num_tokens(sp["max_new_tokens"], sp.get("ignore_eos", False))
        acc, verify = _spec(n)
        events = []
        for done in range(TOKENS_PER_CHUNK, n + TOKENS_PER_CHUNK, TOKENS_PER_CHUNK):
            k = min(done, n)
            last = k == n
            events.append({"text": TOKEN_TEXT * k, "meta_info": {
                "prompt_tokens": prompt_len, "completion_tokens": k, "cached_tokens": cached,
                "finish_reason": {"type": "length", "length": n} if last else None,
                "spec_accept_length": acc, "spec_verify_ct": verify}})
        return sse(events)

    async def openai_route(req: Request, chat: bool):
        body = await req.json()
        if st.next_fails():
            return JSONResponse({"error": {"message": "stub failure"}}, status_code=500)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_len = len(prompt)
        st.prompt_lens.append(prompt_len)
        cached = st.cache(prompt)
        if not body.get("stream"):  # the gsm8k eval path
            question = prompt.rpartition("Question:")[2] if not chat else prompt
            text = _gsm8k_reply(question, chat)
            n = len(text.split())
            acc, verify = _spec(n)
            choice = {"index": 0, "finish_reason": "stop"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return {"choices": [choice], "usage": {"prompt_tokens": prompt_len, "completion_tokens": n,
                                                   "spec": {"accept_length": acc, "verify_ct": verify}}}
        n = _num_tokens(body["max_tokens"], body.get("ignore_eos", False))
        acc, verify = _spec(n)
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] if chat else []
        for start in range(0, n, TOKENS_PER_CHUNK):
            piece = TOKEN_TEXT * (min(start + TOKENS_PER_CHUNK, n) - start)
            last = start + TOKENS_PER_CHUNK >= n
            choice = {"index": 0, "finish_reason": "length" if last else None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            events.append({"choices": [choice]})
        events.append({"choices": [], "usage": {"prompt_tokens": prompt_len, "completion_tokens": n,
                                                "prompt_tokens_details": {"cached_tokens": cached},
                                                "spec": {"accept_length": acc, "verify_ct": verify}}})
        return sse(events)

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await openai_route(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request):
        return await openai_route(req, chat=True)

    return app


class StubServer:
    def __init__(self, model_path: str):
        self.state = StubState(model_path)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        cfg = uvicorn.Config(make_app(self.state), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("bench_stub") / "tiny"), "llama", seed=3)


@pytest.fixture
def stub(tiny_folder):
    with StubServer(tiny_folder) as s:
        yield s


def _read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _bench(stub, tmp_path, *extra):
    out = tmp_path / "bench.jsonl"
    argv = ["--port", str(stub.port), "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "9",
            "--random-range-ratio", "0.5", "--seed", "5", "--disable-tqdm", "--output-file", str(out), *extra]
    rc = serving.main(argv)
    return rc, out


SUMMARY_FIELDS = ["backend", "completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                  "request_throughput", "input_throughput", "output_throughput", "total_throughput", "concurrency",
                  "accept_length", "server_accept_length", "max_concurrency", "request_rate", "args", "errors"] + [
    f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e_latency") for s in ("mean", "median", "p99")]


def _expected(tiny_folder):
    tok = resolve_tokenizer(tiny_folder, None)
    return random_requests(tok, 6, 12, 9, 0.5, seed=5)


@pytest.mark.parametrize("backend", ["specserve", "openai", "openai-chat"])
def test_bench_against_stub(stub, tmp_path, tiny_folder, backend):
    rc, out = _bench(stub, tmp_path, "--backend", backend, "--max-concurrency", "3", "--warmup-requests", "2")
    assert rc == 0
    (line,) = _read_lines(out)
    for f in SUMMARY_FIELDS:
        assert f in line, f
    reqs = _expected(tiny_folder)
    n_out = [r.output_len for r in reqs]
    assert line["backend"] == backend and line["completed"] == 6 and line["failed"] == 0
    assert line["max_concurrency"] == 3 and line["request_rate"] == "inf"
    # server-reported counts, never chunks (the stub sends 2 tokens per chunk); ignore_eos is on for random
    assert line["total_output_tokens"] == sum(n_out)
    assert line["total_input_tokens"] == sum(stub.state.prompt_lens[-6:])  # the server's counts (warm-up first)
    # the cached tokens the server reported, summed (the warm-up sent the first prompt: its copy is all cached)
    assert line["total_cached_tokens"] == sum(stub.state.cached[-6:]) >= reqs[0].prompt_len - 1
    assert line["cache_hit_rate"] == pytest.approx(line["total_cached_tokens"] / line["total_input_tokens"])
    if backend == "specserve":
        # native sends the exact ids; up to 3 requests are in flight, so they may reach the stub in any order
        assert sorted(stub.state.prompt_lens[-6:]) == sorted(r.prompt_len for r in reqs)
    verify = [math.ceil(n / 2) for n in n_out]
    assert line["accept_length"] == pytest.approx(sum(n_out) / sum(verify))
    assert line["server_accept_length"] == SERVER_ACCEPT
    assert line["output_throughput"] == pytest.approx(sum(n_out) / line["duration"])
    assert line["mean_ttft_ms"] > 0 and line["median_tpot_ms"] > 0 and line["p99_itl_ms"] > 0
    assert line["mean_e2e_latency_ms"] >= line["mean_ttft_ms"]
    assert 0 < line["concurrency"] <= 3.0 + 1e-6


def _gsp_expected(tok, flushed: bool, groups=3, per_group=4, system=10, question=3, seed=5):
    """The cached tokens the stub's cache gives the gsp requests sent one at a time, after the warm-up (2 copies of
    the first prompt) and, when flushed, an empty cache: each prompt's longest prefix shared with one sent before."""
    reqs = shared_prefix_requests(tok, groups, per_group, system, question, 7, seed)
    seen = [] if flushed else [reqs[0].prompt_ids] * 2
    total = 0
    for r in reqs:
        best = max((next((i for i, (a, b) in enumerate(zip(old, r.prompt_ids, strict=False)) if a != b),
                          min(len(old), len(r.prompt_ids))) for old in seen), default=0)
        total += min(best, len(r.prompt_ids) - 1)
        seen.append(r.prompt_ids)
    return reqs, total


@pytest.mark.parametrize("flush", [True, False])
def test_bench_generated_shared_prefix_reports_cached_tokens(stub, tmp_path, tiny_folder, flush, capsys):
    gsp = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
           "--gsp-system-prompt-len", "10", "--gsp-question-len", "3", "--gsp-output-len", "7"]
    rc, out = _bench(stub, tmp_path, "--backend", "specserve", "--max-concurrency", "1", "--warmup-requests", "2",
                     *gsp, *(["--flush-cache"] if flush else []))
    assert rc == 0
    (line,) = _read_lines(out)
    reqs, expected = _gsp_expected(resolve_tokenizer(tiny_folder, None), flush)
    assert line["completed"] == 12 and line["total_output_tokens"] == 12 * 7  # --num-prompts (6) is not used
    assert stub.state.flushes == (1 if flush else 0)
    assert sorted(stub.state.prompt_lens[-12:]) == [13] * 12
    # every prompt but its group's first finds at least the system prompt cached
    assert line["total_cached_tokens"] == expected >= (12 - 3) * 10
    assert line["cache_hit_rate"] == pytest.approx(expected / (12 * 13))
    assert "Cached prompt tokens:" in capsys.readouterr().out


def test_bench_flush_cache_refused_is_a_warning(stub, tmp_path, capsys):
    stub.state.flush_busy = True
    rc, out = _bench(stub, tmp_path, "--backend", "openai", "--flush-cache")
    assert rc == 0 and _read_lines(out)[0]["completed"] == 6
    assert "/flush_cache failed (HTTP 400: Cache not flushed" in capsys.readouterr().err


def test_bench_sweep_writes_plot_and_one_line_per_point(stub, tmp_path):
    png = tmp_path / "sweep.png"
    rc, out = _bench(stub, tmp_path, "--backend", "openai", "--max-concurrency", "1,2", "--plot", str(png),
                     "--request-rate", "200")
    assert rc == 0
    lines = _read_lines(out)
    assert [ln["max_concurrency"] for ln in lines] == [1, 2] and all(ln["completed"] == 6 for ln in lines)
    assert lines[0]["concurrency"] <= 1.0 + 1e-6  # a cap of one never has two requests in flight
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_counts_failures_without_stopping(stub, tmp_path, capsys):
    stub.state.fail_every = 3
    rc, out = _bench(stub, tmp_path, "--backend", "specserve", "--warmup-requests", "0", "--max-concurrency", "1")
    assert rc == 0
    (line,) = _read_lines(out)
    assert line["completed"] == 4 and line["failed"] == 2
    assert len(line["errors"]) == 2 and all("HTTP 500" in e and "stub failure" in e for e in line["errors"])
    assert "2 requests failed" in capsys.readouterr().err


def test_bench_jsonl_dataset_respects_eos(stub, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"hello number {i}"}) for i in range(4)))
    rc, out = _bench(stub, tmp_path, "--backend", "openai", "--dataset-name", "jsonl", "--dataset-path", str(data))
    assert rc == 0
    (line,) = _read_lines(out)
    assert line["completed"] == 4 and line["total_output_tokens"] == 4 * min(9, EOS_AFTER)  # no ignore_eos
    assert line["total_input_tokens"] == sum(len(f"hello number {i}") for i in range(4))


def test_bench_all_warmups_failing_stops_early(stub, tmp_path):
    stub.state.fail_every = 1
    rc, out = _bench(stub, tmp_path, "--backend", "specserve")
    assert rc == 1 and not out.exists()


def test_bench_unreachable_server_is_a_clear_error(tmp_path, tiny_folder, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    rc = serving.main(["--port", str(port), "--backend", "openai", "--tokenizer", tiny_folder, "--disable-tqdm"])
    assert rc == 2 and "--model" in capsys.readouterr().err


GSM8K = ([{"question": "What is 1 plus 1?", "answer": "1 + 1 = 2\n#### 2"}]  # the shot
         + [{"question": f"What is {a} plus {b}?{tag}", "answer": f"#### {a + b}"}
            for a, b, tag in ((2, 3, ""), (10, 20, ""), (7, 8, ""), (4, 4, " tricky"), (6, 1, " tricky"),
                              (9, 9, " impossible"))])


@pytest.mark.parametrize("api", ["completion", "chat"])
def test_eval_gsm8k_against_stub(stub, tmp_path, api, capsys):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(e) for e in GSM8K) + "\n")
    out = tmp_path / "eval.jsonl"
    rc = eval_cli.main(["gsm8k", "--data", str(data), "--num-examples", "6", "--num-threads", "3", "--api", api,
                        "--num-shots", "1", "--port", str(stub.port), "--output-file", str(out), "--disable-tqdm"])
    assert rc == 0
    (line,) = _read_lines(out)
    assert line["num_examples"] == 6 and line["num_shots"] == 1 and line["model"] == "stub-model"
    assert line["correct"] == 3 and line["accuracy"] == pytest.approx(0.5)
    assert line["num_invalid"] == 1 and line["invalid"] == pytest.approx(1 / 6) and line["failed"] == 0
    assert line["output_tokens"] > 0 and line["output_throughput"] > 0 and line["latency"] > 0
    assert line["accept_length"] is not None and line["server_accept_length"] == SERVER_ACCEPT
    printed = capsys.readouterr().out
    assert "Accuracy: 0.500" in printed and "Invalid: 0.167" in printed
