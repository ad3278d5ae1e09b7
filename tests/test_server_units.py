"""Server pieces without a live server: incremental detokenisation, body parsing and errors, flag parsing, the
request tracking of the tokenizer manager (with a fake engine), and the cancellation helpers."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import pytest

from specserve.engine.stop import final_text
from specserve.server.detokenizer import IncrementalDetokenizer
from specserve.server.errors import APIError
from specserve.server.launch import parse_args, served_model_name
from specserve.server.messages import EngineInfo, EngineStats, FlushCacheResult, RequestDelta, StepOutput
from specserve.server.metrics import ServerMetrics
from specserve.server.native_routes import native_router, normalize_sgl_sampling
from specserve.server.openai_routes import usage
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest, UsageInfo, parse_body
from specserve.server.streaming import merge_streams, run_all
from specserve.server.tokenizer_manager import GenRequest, TokenizerManager
from specserve.server_args import ServerArgs

TEXTS = ["héllo 你好 🙂 wörld", "abc déf 🙂🙂 x", "wörld 好 héllo"]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer whose merges are learnt from ASCII-ish text, so CJK and emoji are split over
    several byte tokens (each decodes to "\ufffd" alone)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(["hello world", "héllo wörld", "abc def STOP here"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


# ---------------------------------------------------------------------- detokenizer
@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(bpe, text, step):
    ids = bpe.encode(text)
    assert any("\ufffd" in bpe.decode([i]) for i in ids), "the test needs tokens that split a character"
    d = IncrementalDetokenizer(bpe)
    deltas = []
    body, last = ids[:-step], ids[-step:]
    for k in range(0, len(body), step):
        deltas.append(d.feed(body[k:k + step]))
    deltas.append(d.finish(last, {"type": "length", "length": len(ids)}))
    assert "".join(deltas) == text
    assert not any("\ufffd" in x for x in deltas)
    assert d.text[:d.sent] == text


def test_detokenizer_never_shows_a_stop_string(bpe):
    text = "abc def STOP here"
    ids = bpe.encode(text)
    d = IncrementalDetokenizer(bpe, stop=["STOP"])
    deltas = []
    # The engine stops on the token that completes the stop string: feed until then, finish with that token.
    for k in range(1, len(ids) + 1):
        if "STOP" in bpe.decode(ids[:k]):
            deltas.append(d.finish(ids[k - 1:k], {"type": "stop", "matched": "STOP"}))
            break
        deltas.append(d.feed(ids[k - 1:k]))
    assert "".join(deltas) == "abc def "
    assert all("S" not in x for x in deltas)


def test_final_text_cuts_at_matched_stop(bpe):
    ids = bpe.encode("abc def STOP here")
    assert final_text(bpe, ids, {"type": "stop", "matched": "STOP"}, True) == "abc def "
    assert final_text(bpe, ids, {"type": "length", "length": 3}, True) == "abc def STOP here"


# ---------------------------------------------------------------------- parsing and errors
@pytest.mark.parametrize("raw,needle", [
    (b"", "empty"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "missing required field 'model'"),
    (b'{"model": "m", "messages": "hi"}', "messages"),
    (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
    (b'{"model": "m", "messages": [], "max_tokens": "5"}', "max_tokens"),
    (b'{"model": "m", "messages": [], "stream": "yes"}', "stream"),
])
def test_parse_body_errors(raw, needle):
    with pytest.raises(APIError) as e:
        parse_body(raw, ChatCompletionRequest)
    assert e.value.status == 400
    body = e.value.body()["error"]
    assert needle in body["message"] and body["type"] == "invalid_request_error"


def test_parse_body_accepts_prompt_shapes():
    for prompt in ("hi", ["a", "b"], [1, 2, 3], [[1], [2, 3]]):
        req = parse_body(CompletionRequest.model_validate({"model": "m", "prompt": prompt}).model_dump_json().encode(),
                         CompletionRequest)
        assert req.prompt == prompt
    with pytest.raises(APIError) as e:
        parse_body(b'{"model": "m", "prompt": 5}', CompletionRequest)
    assert e.value.param == "prompt"


def test_normalize_sgl_sampling():
    assert normalize_sgl_sampling({"max_new_tokens": 3, "n": 1, "repetition_penalty": 1.2, "sampling_seed": 7}) == \
        {"max_new_tokens": 3, "repetition_penalty": 1.2, "seed": 7}
    with pytest.raises(APIError, match="min_new_tokens"):
        normalize_sgl_sampling({"min_new_tokens": 2})


# ---------------------------------------------------------------------- launch flags
def test_parse_args_defaults_and_errors(capsys):
    a = parse_args([])
    assert (a.host, a.port, a.model_path) == ("127.0.0.1", 30000, None)
    a = parse_args(["--model-path", "/x", "--port", "31000", "--skip-warmup", "--served-model-name", "m"])
    assert (a.model_path, a.port, a.skip_warmup, a.served_model_name) == ("/x", 31000, True, "m")
    for bad, needle in ((["--no-such-flag"], "--no-such-flag"), (["--tp-size", "0"], "tp-size"),
                        (["--port", "abc"], "port"),
                        (["--model-path", "/x", "--speculative-num-steps", "2"], "speculative-algorithm"),
                        (["--speculative-eagle-topk", "4"], "eagle-topk"),  # the embedded model speculates
                        (["--speculative-num-steps", "40"], "num-steps"), (["--max-request-body-mb", "0"], "body")):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


def test_embedded_model_takes_speculative_flags_without_an_algorithm():
    """The embedded model speculates by default, so --speculative-num-steps tunes it (it used to be refused)."""
    a = parse_args(["--speculative-num-steps", "3"])
    e = a.with_embedded_defaults("/head", "cpu")
    assert (e.speculative_algorithm, e.speculative_num_steps, e.speculative_num_draft_tokens) == ("MTP", 3, 4)
    assert parse_args([]).with_embedded_defaults("/head", "cuda").speculative_num_steps == 4


def test_cli_generate_rejects_bad_sampling_before_loading():
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "--prompt", "x", "--temperature", "-3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 30  # no model was loaded


def test_cli_serve_rejects_unknown_flags_with_exit_code_2():
    r = subprocess.run([sys.executable, "-m", "specserve.cli", "serve", "--definitely-not-a-flag"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--definitely-not-a-flag" in r.stderr and "unrecognized" in r.stderr


def test_served_model_name(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert served_model_name(ServerArgs(model_path=str(folder)), str(folder)) == "my-model"
    assert served_model_name(ServerArgs(model_path=str(folder) + "/"), str(folder)) == "my-model"
    assert served_model_name(ServerArgs(model_path="/a/b/Foo.Q4_0.gguf"), "/a/b/Foo.Q4_0.gguf") == "Foo.Q4_0"
    assert served_model_name(ServerArgs(model_path=str(folder), served_model_name="x"), str(folder)) == "x"
    assert served_model_name(ServerArgs(), "/somewhere/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"


# ---------------------------------------------------------------------- tokenizer manager with a fake engine
class FakeEngine:
    def __init__(self):
        self.added: list[tuple] = []
        self.aborted: list[str] = []
        self.on_output = None
        self.on_exit = None
        self.flushes: list[int] = []
        self.flush_reply: FlushCacheResult | None = None  # answered at once when set (else the test answers)

    def start_io(self, loop, on_output, on_exit):
        self.on_output, self.on_exit = on_output, on_exit

    def add(self, rid, input_ids, sampling, return_hidden_states=False, **_):
        self.added.append((rid, input_ids, sampling))

    def abort(self, rid):
        self.aborted.append(rid)

    def flush_cache(self, flush_id):
        self.flushes.append(flush_id)
        if self.flush_reply is not None:  # the engine answers with its next step output (on the event loop)
            reply = FlushCacheResult(flush_id, self.flush_reply.success, self.flush_reply.num_running,
                                     self.flush_reply.num_waiting)
            stats = EngineStats(cached_pages=0 if reply.success else 7)
            asyncio.get_running_loop().call_soon(self.on_output, StepOutput(flushed=[reply], stats=stats))


def _manager(bpe, spec=False, page_size=1):
    info = EngineInfo(model_path="/m", architecture="Fake", context_len=64, vocab_size=len(bpe), max_total_tokens=512,
                      max_running=8, page_size=page_size, capacity_pages=512, initial_free_pages=512,
                      default_sampling={}, spec_enabled=spec, load_time=0.0, pid=0, prefix_cache=True)
    eng = FakeEngine()
    tm = TokenizerManager(ServerArgs(model_path="/m"), bpe, eng, info, "m", ServerMetrics("m"))
    tm.attach(None)
    return tm, eng


def test_manager_streams_text_and_meta(bpe):
    async def go():
        tm, eng = _manager(bpe, spec=True)
        ids = bpe.encode("héllo wörld")
        gen = tm.generate(GenRequest([5, 6], {"max_new_tokens": len(ids)}, rid="r1"))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert eng.added == [("r1", [5, 6], {"max_new_tokens": len(ids)})]
        eng.on_output(StepOutput([RequestDelta("r1", ids[:3], None, 1, 2)], [], EngineStats(num_running=1)))
        c1 = await first
        eng.on_output(StepOutput([RequestDelta("r1", ids[3:], {"type": "length", "length": len(ids)}, 2, 3)], [],
                                 EngineStats()))
        c2 = await gen.__anext__()
        assert c1.text + c2.text_delta == "héllo wörld" == c2.text
        assert c2.finished and c2.meta["completion_tokens"] == len(ids) and c2.meta["prompt_tokens"] == 2
        assert c2.meta["spec_verify_ct"] == 2 and c2.meta["spec_accept_length"] == pytest.approx(2.5)
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        assert eng.aborted == [] and tm.reqs == {}

    asyncio.run(go())


def test_manager_aborts_when_consumer_leaves_and_fails_fast_when_engine_dies(bpe):
    async def go():
        tm, eng = _manager(bpe)
        gen = tm.generate(GenRequest([5], {}, rid="a"))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        task.cancel()  # a client disconnect cancels the consumer
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gen.aclose()
        assert eng.aborted == ["a"] and tm.reqs == {}

        gen = tm.generate(GenRequest([5], {}, rid="b"))
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        eng.on_exit("killed")
        with pytest.raises(APIError) as e:
            await task
        assert e.value.status == 503 and not tm.healthy
        with pytest.raises(APIError) as e:  # new requests are refused at once
            await tm.generate(GenRequest([5], {})).__anext__()
        assert e.value.status == 503

    asyncio.run(go())


def test_manager_validates_before_queueing(bpe):
    async def go():
        tm, eng = _manager(bpe)
        for ids, sp, needle in (([], {}, "empty"), ([1] * 64, {}, "context length"), ([10**6], {}, "input_ids"),
                                ([1], {"temperature": -1}, "temperature"), ([1], {"bogus": 1}, "bogus")):
            with pytest.raises(APIError, match=needle) as e:
                await tm.generate(GenRequest(ids, sp)).__anext__()
            assert e.value.status == 400
        assert eng.added == []
        with pytest.raises(APIError) as e:
            tm.check_model("other")
        assert e.value.status == 404
        tm.check_model("m")

    asyncio.run(go())


# ---------------------------------------------------------------------- prefix cache: cached_tokens, flush, stats
def _metric(text: str, name: str) -> float:
    line = [x for x in text.splitlines() if x.startswith(name + "{") or x.startswith(name + " ")]
    assert len(line) == 1, (name, line)
    return float(line[0].split()[-1])


def test_manager_reports_cached_tokens_in_meta_usage_and_metrics(bpe):
    async def go():
        tm, eng = _manager(bpe)
        gens = [tm.generate(GenRequest([5, 6, 7, 8], {"max_new_tokens": 2}, rid=r)) for r in ("a", "b")]
        firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.sleep(0)
        # "a" got 3 of its 4 prompt tokens from the cache, "b" none; the count rides on every delta
        eng.on_output(StepOutput([RequestDelta("a", [10], None, cached_tokens=3), RequestDelta("b", [11], None)]))
        c1 = [await f for f in firsts]
        assert [c.meta["cached_tokens"] for c in c1] == [3, 0]
        done = {"type": "length", "length": 2}
        eng.on_output(StepOutput([RequestDelta("a", [12], done, cached_tokens=3), RequestDelta("b", [13], done)]))
        lasts = [await g.__anext__() for g in gens]
        assert all(c.finished for c in lasts) and [c.meta["cached_tokens"] for c in lasts] == [3, 0]
        u = usage(lasts, spec_enabled=False)
        assert u["prompt_tokens"] == 8 and u["completion_tokens"] == 4 and u["total_tokens"] == 12
        assert u["prompt_tokens_details"] == {"cached_tokens": 3} and "spec" not in u
        assert UsageInfo.model_validate(u).prompt_tokens_details.cached_tokens == 3
        # the counter sums the finished requests' cached tokens next to their prompt tokens
        text = tm.metrics.render().decode()
        assert _metric(text, "specserve:cached_tokens_total") == 3
        assert _metric(text, "specserve:prompt_tokens_total") == 8

    asyncio.run(go())


def test_usage_sums_cached_tokens_per_choice_and_keeps_spec():
    from specserve.server.tokenizer_manager import GenChunk

    def chunk(prompt, completion, cached, verify):
        meta = {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
                "spec_verify_ct": verify, "spec_accept_length": completion / verify}
        return GenChunk("r", "", "", [], [], True, {"type": "length"}, meta)

    u = usage([chunk(10, 6, 8, 3), chunk(10, 4, 8, 2), chunk(5, 2, 0, 1)], spec_enabled=True)
    assert u["prompt_tokens"] == 25 and u["prompt_tokens_details"] == {"cached_tokens": 16}
    assert u["spec"] == {"accept_length": pytest.approx(12 / 6), "verify_ct": 6}


def test_engine_stats_put_the_prefix_cache_in_metrics_and_server_info(bpe):
    tm, _ = _manager(bpe, page_size=4)
    stats = EngineStats(free_pages=500, cached_pages=12, evictable_pages=9, cache_hit_tokens=30, cache_query_tokens=120,
                        state_snapshots=2)
    assert stats.cache_hit_rate == pytest.approx(0.25) and EngineStats().cache_hit_rate == 0.0
    tm._on_output(StepOutput(stats=stats))
    text = tm.metrics.render().decode()
    assert _metric(text, "specserve:cache_hit_rate") == pytest.approx(0.25)
    assert _metric(text, "specserve:cached_pages") == 12 and _metric(text, "specserve:evictable_pages") == 9
    assert _metric(text, "specserve:state_snapshots") == 2
    assert "# TYPE specserve:cached_tokens_total counter" in text and "# TYPE specserve:cache_hit_rate gauge" in text
    pc = tm.runtime_info()["prefix_cache"]
    assert pc == {"enabled": True, "cached_pages": 12, "evictable_pages": 9, "hit_tokens": 30, "query_tokens": 120,
                  "hit_rate": pytest.approx(0.25), "state_snapshots": 2}


def _app(tm):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.include_router(native_router(tm, [1]))
    return TestClient(app)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_flush_cache_route_answers_what_the_engine_did(bpe, method):
    tm, eng = _manager(bpe)
    tm._on_output(StepOutput(stats=EngineStats(cached_pages=7, evictable_pages=7)))
    with _app(tm) as client:
        eng.flush_reply = FlushCacheResult(0, False, num_running=2, num_waiting=1)
        r = client.request(method, "/flush_cache")
        assert r.status_code == 400 and "not flushed" in r.text and "2 requests are running" in r.text
        assert client.get("/get_server_info").json()["prefix_cache"]["cached_pages"] == 7
        eng.flush_reply = FlushCacheResult(0, True)
        r = client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        assert r.headers["content-type"].startswith("text/plain")
        info = client.get("/get_server_info").json()
        assert info["prefix_cache"]["cached_pages"] == 0 and info["prefix_cache"]["enabled"] is True
        assert _metric(client.get("/metrics").text, "specserve:cached_pages") == 0
    assert eng.flushes == [1, 2] and tm._flushes == {}  # one message per call, none left waiting


def test_flush_cache_waits_for_the_engine_and_fails_fast_when_it_dies(bpe):
    async def go():
        tm, eng = _manager(bpe)
        task = asyncio.ensure_future(tm.flush_cache())
        await asyncio.sleep(0)
        assert eng.flushes == [1] and not task.done()  # waits for the answer without blocking the loop
        eng.on_output(StepOutput(flushed=[FlushCacheResult(99, True)]))  # someone else's answer
        await asyncio.sleep(0)
        assert not task.done()
        eng.on_output(StepOutput(flushed=[FlushCacheResult(1, True)]))
        assert (await task).success
        task = asyncio.ensure_future(tm.flush_cache())
        await asyncio.sleep(0)
        eng.on_exit("killed")
        with pytest.raises(APIError) as e:
            await task
        assert e.value.status == 503 and tm._flushes == {}
        with pytest.raises(APIError):  # refused at once afterwards
            await tm.flush_cache()

    asyncio.run(go())


# ---------------------------------------------------------------------- cancellation helpers
def test_merge_streams_and_run_all_cancel_the_rest():
    async def go():
        closed = []

        async def gen(i, n):
            try:
                for k in range(n):
                    await asyncio.sleep(0.001 * (i + 1))
                    yield k
            finally:
                closed.append(i)

        got = [x async for x in merge_streams([gen(0, 3), gen(1, 2)])]
        assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        closed.clear()
        merged = merge_streams([gen(0, 100), gen(1, 100)])
        await merged.__anext__()
        await merged.aclose()  # the consumer leaves early: every source is closed
        assert sorted(closed) == [0, 1]

        async def fail():
            await asyncio.sleep(0.01)
            raise APIError(503, "down")

        slow_done = []

        async def slow():
            try:
                await asyncio.sleep(10)
            finally:
                slow_done.append(True)

        with pytest.raises(APIError):
            await run_all([fail(), slow()])
        assert slow_done == [True]

    asyncio.run(go())


def test_every_serve_flag_has_help():
    import argparse

    from specserve.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    missing = [a.option_strings[0] for a in p._actions if a.option_strings and a.dest != "help" and not a.help]
    assert not missing, f"flags without help text: {missing}"
