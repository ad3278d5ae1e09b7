"""Unit tests of the benchmark client: datasets, SSE parsing per backend, payloads, metrics, arrivals, plot."""

import json

import numpy as np
import pytest

from specserve.bench import target
from specserve.bench.backends import (
    BACKENDS,
    NativeStream,
    OpenAIStream,
    RequestOutput,
    SSEDecoder,
    StreamError,
)
from specserve.bench.datasets import (
    BenchRequest,
    jsonl_requests,
    random_requests,
    shared_prefix_requests,
    uniform_lengths,
)
from specserve.bench.metrics import cached_tokens, compute_metrics, format_summary, mean_accept_length
from specserve.bench.runner import arrival_gaps, fill_missing_output_lens
from specserve.bench.serving import parse_concurrency


class FakeTokenizer:
    """Ids 0..99; 0-2 are special; token i decodes to chr(ord('A') + i % 26); encode is one token per char."""

    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 100

    def decode(self, ids):
        return "".join(chr(ord("A") + i % 26) for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [3 + (ord(c) % 90) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt
                                                                              else "")


# ---------------------------------------------------------------- datasets


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 1.0])
def test_uniform_lengths_within_range(ratio):
    rng = np.random.default_rng(0)
    lens = uniform_lengths(rng, 2000, 40, ratio)
    low = max(1, int(40 * ratio))
    assert lens.min() == low and lens.max() == 40  # both ends reachable, nothing outside
    assert ((lens >= low) & (lens <= 40)).all()


def test_uniform_lengths_rejects_bad_args():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError):
        uniform_lengths(rng, 3, 0, 0.5)
    with pytest.raises(ValueError):
        uniform_lengths(rng, 3, 10, 1.5)


def test_random_requests_exact_ids_and_no_special_tokens():
    tok = FakeTokenizer()
    reqs = random_requests(tok, 50, input_len=32, output_len=16, range_ratio=0.5, seed=3)
    assert len(reqs) == 50
    for r in reqs:
        assert 16 <= r.prompt_len <= 32 and len(r.prompt_ids) == r.prompt_len
        assert 8 <= r.output_len <= 16
        assert not set(r.prompt_ids) & set(tok.all_special_ids)
        assert r.prompt == tok.decode(r.prompt_ids)
    again = random_requests(tok, 50, 32, 16, 0.5, seed=3)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]
    other = random_requests(tok, 50, 32, 16, 0.5, seed=4)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in reqs]


def test_shared_prefix_requests_share_the_system_prompt_within_a_group_only():
    tok = FakeTokenizer()
    reqs = shared_prefix_requests(tok, num_groups=4, prompts_per_group=5, system_prompt_len=12, question_len=6,
                                  output_len=9, seed=2)
    assert len(reqs) == 20
    assert all(len(r.prompt_ids) == r.prompt_len == 18 and r.output_len == 9 for r in reqs)
    assert all(not set(r.prompt_ids) & set(tok.all_special_ids) and r.prompt == tok.decode(r.prompt_ids)
               for r in reqs)
    groups: dict[tuple, list] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt_ids[:12]), []).append(r.prompt_ids[12:])
    # four distinct system prompts, five prompts each, each with a question of its own
    assert len(groups) == 4 and all(len(qs) == 5 and len({tuple(q) for q in qs}) == 5 for qs in groups.values())
    systems = list(groups)
    for i, a in enumerate(systems):  # different groups share (almost) nothing: not a common prefix of 12
        for b in systems[i + 1:]:
            assert sum(x == y for x, y in zip(a, b, strict=True)) < 6
    # shuffled, as SGLang's: a group's prompts are not all in one run
    first_group = [tuple(r.prompt_ids[:12]) == systems[0] for r in reqs]
    assert first_group != sorted(first_group, reverse=True)
    again = shared_prefix_requests(tok, 4, 5, 12, 6, 9, seed=2)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]
    assert [r.prompt_ids for r in shared_prefix_requests(tok, 4, 5, 12, 6, 9, seed=3)] != [r.prompt_ids for r in reqs]
    with pytest.raises(ValueError, match="--gsp-question-len"):
        shared_prefix_requests(tok, 4, 5, 12, 0, 9, seed=2)


def test_jsonl_requests_fields_and_chat(tmp_path):
    p = tmp_path / "d.jsonl"
    recs = [{"prompt": "hello"}, {"text": "abc", "output_len": 3}, {"question": "why?"},
            {"instruction": "do it", "max_tokens": 5},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    reqs = jsonl_requests(str(p), FakeTokenizer(), num_prompts=10, output_len=7)
    assert [r.prompt for r in reqs[:4]] == ["hello", "abc", "why?", "do it"]
    assert [r.output_len for r in reqs] == [7, 3, 7, 5, 7]
    assert reqs[0].prompt_len == 5
    assert reqs[4].messages == recs[4]["messages"] and reqs[4].prompt == "<system>s<user>u<assistant>"
    assert reqs[0].chat_messages() == [{"role": "user", "content": "hello"}]
    assert len(jsonl_requests(str(p), FakeTokenizer(), num_prompts=2, output_len=7)) == 2


def test_jsonl_requests_bad_records(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"foo": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        jsonl_requests(str(p), FakeTokenizer(), 5, 4)
    p.write_text("{not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        jsonl_requests(str(p), FakeTokenizer(), 5, 4)


# ---------------------------------------------------------------- SSE parsing


def test_sse_decoder_splits_across_chunks():
    dec = SSEDecoder()
    assert dec.feed(b'data: {"a"') == []
    assert dec.feed(b': 1}\r\n\r\n: keep-alive comment\nevent: x\ndata:{"b": 2}\n\ndata: [DO') == ['{"a": 1}',
                                                                                           '{"b": 2}']
    assert dec.feed(b"NE]\n\n") == ["[DONE]"]


def _native_ev(text, n, finish=None, spec=None):
    meta = {"prompt_tokens": 9, "completion_tokens": n, "finish_reason": finish}
    if spec:
        meta["spec_accept_length"], meta["spec_verify_ct"] = spec
    return {"text": text, "meta_info": meta}


def test_native_stream_cumulative_text_and_token_counts():
    out = RequestOutput(start_time=10.0, prompt_len=3)
    s = NativeStream(out)
    s.feed(_native_ev("ab", 2), 10.5)  # first chunk: 2 tokens (speculation)
    s.feed(_native_ev("ab", 3), 10.7)  # a token that decodes to nothing yet still counts as content
    s.feed(_native_ev("abcde", 5), 11.0)
    final = _native_ev("abcde", 5, {"type": "length", "length": 5}, (2.5, 2))
    final["meta_info"]["cached_tokens"] = 6
    s.feed(final, 11.1)  # meta-only final chunk
    s.finish(11.2)
    assert out.cached_tokens == 6
    assert out.text == "abcde" and out.output_len == 5 and out.prompt_len == 9
    assert out.ttft == pytest.approx(0.5)
    assert out.itl == pytest.approx([0.2, 0.3])  # three content chunks -> two gaps; the final meta chunk is none
    assert out.latency == pytest.approx(1.2)
    assert out.accept_length == 2.5 and out.verify_ct == 2 and out.finish_reason == "length"


def test_openai_completion_stream_deltas_and_usage():
    out = RequestOutput(start_time=0.0, prompt_len=3)
    s = OpenAIStream(out, chat=False)
    s.feed({"choices": [{"index": 0, "text": "He", "finish_reason": None}], "usage": None}, 0.1)
    s.feed({"choices": [{"index": 0, "text": "llo", "finish_reason": None}]}, 0.15)
    s.feed({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}, 0.16)
    s.feed({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 7,
                                     "prompt_tokens_details": {"cached_tokens": 3},
                                     "spec": {"accept_length": 3.5, "verify_ct": 2}}}, 0.17)
    s.finish(0.2)
    assert out.text == "Hello" and out.output_len == 7 and out.prompt_len == 4  # never the chunk count (2)
    assert out.cached_tokens == 3
    assert out.ttft == pytest.approx(0.1) and out.itl == pytest.approx([0.05])
    assert out.accept_length == 3.5 and out.verify_ct == 2 and out.finish_reason == "length"


def test_openai_chat_stream_role_chunk_is_not_content():
    out = RequestOutput(start_time=0.0)
    s = OpenAIStream(out, chat=True)
    s.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.05)
    s.feed({"choices": [{"delta": {"content": "Hi"}}]}, 0.2)
    s.feed({"choices": [{"delta": {"reasoning_content": " there"}}]}, 0.3)
    s.finish(0.4)
    assert out.ttft == pytest.approx(0.2) and out.itl == pytest.approx([0.1])
    assert out.text == "Hi there" and out.output_len is None  # no usage: the runner re-tokenizes
    assert out.cached_tokens is None  # nor cached tokens: not reported, not 0


def test_stream_with_no_content_has_ttft_equal_latency():
    out = RequestOutput(start_time=1.0)
    s = OpenAIStream(out, chat=False)
    s.feed({"choices": [{"text": ""}], "usage": {"completion_tokens": 1}}, 1.2)
    s.finish(1.5)
    assert out.ttft == pytest.approx(0.5) == pytest.approx(out.latency)


def test_native_accept_length_from_verify_count_only():
    out = RequestOutput(start_time=0.0)
    s = NativeStream(out)
    s.feed({"text": "abcdef", "meta_info": {"completion_tokens": 6, "spec_verify_ct": 4}}, 0.1)
    s.finish(0.2)
    assert out.accept_length == pytest.approx(1.5) and out.verify_ct == 4


@pytest.mark.parametrize("ev", [{"error": {"message": "boom", "code": 400}}, {"error": "boom"}])
def test_error_event_raises(ev):
    with pytest.raises(StreamError, match="boom"):
        NativeStream(RequestOutput()).feed(ev, 0.0)
    with pytest.raises(StreamError, match="boom"):
        OpenAIStream(RequestOutput(), chat=True).feed(ev, 0.0)


# ---------------------------------------------------------------- payloads


def test_native_payload_sends_ids_and_routes_sampling_keys():
    req = BenchRequest(prompt="xyz", prompt_len=3, output_len=8, prompt_ids=[5, 6, 7])
    body = BACKENDS["specserve"].payload(req, None, True, {"temperature": 0.5, "rid": "r1"})
    assert body["input_ids"] == [5, 6, 7] and "text" not in body and body["stream"] is True
    assert body["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.5, "ignore_eos": True}
    assert body["rid"] == "r1"
    body = BACKENDS["sglang"].payload(BenchRequest("xyz", 3, 8), None, False, {})
    assert body["text"] == "xyz" and "input_ids" not in body and body["sampling_params"]["ignore_eos"] is False


def test_openai_payloads():
    req = BenchRequest(prompt="xyz", prompt_len=3, output_len=8, prompt_ids=[5, 6, 7])
    body = BACKENDS["openai"].payload(req, "m", True, {"top_p": 0.9})
    assert body["prompt"] == "xyz" and body["model"] == "m" and body["max_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True and body["top_p"] == 0.9
    body = BACKENDS["openai-chat"].payload(req, "m", False, {})
    assert body["messages"] == [{"role": "user", "content": "xyz"}] and "ignore_eos" not in body
    assert BACKENDS["openai-chat"].path == "/v1/chat/completions" and BACKENDS["openai"].path == "/v1/completions"


# ---------------------------------------------------------------- metrics


def _out(ttft, latency, n, itl=(), accept=None, vct=None, prompt=10, ok=True):
    return RequestOutput(success=ok, error="" if ok else "HTTP 500", ttft=ttft, latency=latency, output_len=n,
                         itl=list(itl), accept_length=accept, verify_ct=vct, prompt_len=prompt)


def test_compute_metrics_known_answers():
    outs = [_out(0.1, 1.1, 11, itl=[0.2, 0.4], accept=2.0, vct=10, prompt=10),
            _out(0.3, 2.3, 21, itl=[0.6], accept=3.0, vct=30, prompt=30),
            _out(0, 0, None, ok=False)]
    m = compute_metrics(outs, duration=4.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 40 and m["total_output_tokens"] == 32
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["input_throughput"] == pytest.approx(10.0)
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_throughput"] == pytest.approx(18.0)
    assert m["concurrency"] == pytest.approx(3.4 / 4.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # linear interpolation: 100 + 0.99 * 200
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["p99_tpot_ms"] == pytest.approx(100.0)
    assert m["mean_itl_ms"] == pytest.approx(400.0) and m["median_itl_ms"] == pytest.approx(400.0)
    assert m["max_itl_ms"] == pytest.approx(600.0) and m["p95_itl_ms"] == pytest.approx(580.0)
    assert m["mean_e2e_latency_ms"] == pytest.approx(1700.0) and m["p99_e2e_latency_ms"] == pytest.approx(2288.0)
    assert m["accept_length"] == pytest.approx((2.0 * 10 + 3.0 * 30) / 40)  # weighted by verify count


def test_cached_tokens_summed_over_the_requests_that_report_them():
    outs = [_out(0.1, 1, 2, prompt=100), _out(0.1, 1, 2, prompt=50), _out(0.1, 1, 2, prompt=30),
            _out(0, 0, None, prompt=40, ok=False)]
    outs[0].cached_tokens, outs[1].cached_tokens, outs[3].cached_tokens = 80, 0, 40  # [2]: not reported
    assert cached_tokens(outs) == (80, pytest.approx(80 / 150))  # the failed one is left out
    m = compute_metrics(outs, 1.0)
    assert m["total_cached_tokens"] == 80 and m["cache_hit_rate"] == pytest.approx(80 / 150)
    assert m["total_input_tokens"] == 180
    assert compute_metrics([_out(0.1, 1, 2)], 1.0)["total_cached_tokens"] is None
    m.update(backend="specserve", request_rate=1.0, max_concurrency=4, server_accept_length=None)
    lines = format_summary(m).splitlines()
    ttft = lines.index(next(x for x in lines if "Time to First Token" in x))
    assert lines[ttft + 4].split() == ["Cached", "prompt", "tokens:", "80"]
    assert lines[ttft + 5].split()[-1] == f"{100 * 80 / 150:.2f}"


def test_tpot_skips_single_token_outputs_and_empty_stats_are_none():
    m = compute_metrics([_out(0.5, 0.5, 1)], duration=1.0)
    assert m["mean_tpot_ms"] is None and m["mean_itl_ms"] is None and m["max_itl_ms"] is None
    assert m["mean_ttft_ms"] == pytest.approx(500.0) and m["accept_length"] is None
    m = compute_metrics([], duration=0.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0


def test_accept_length_plain_mean_without_verify_counts():
    assert mean_accept_length([_out(0, 1, 2, accept=2.0), _out(0, 1, 2, accept=3.0, vct=100)]) == pytest.approx(2.5)
    assert mean_accept_length([_out(0, 1, 2, accept=9.0, ok=False)]) is None


def test_format_summary_layout():
    m = compute_metrics([_out(0.1, 1.1, 11)], 2.0)
    m.update(backend="openai", request_rate=float("inf"), max_concurrency=None, server_accept_length=None)
    text = format_summary(m)
    assert "Serving Benchmark Result" in text and "Max request concurrency:" in text and "not set" in text
    assert "Output token throughput (tok/s):" in text and "5.50" in text
    assert "Median TPOT (ms):" in text and "P99 ITL (ms):" in text and "n/a" in text


def test_fill_missing_output_lens_retokenizes_only_when_needed():
    outs = [_out(0, 1, None), _out(0, 1, 4), _out(0, 1, None, ok=False)]
    outs[0].text = "abc"
    assert fill_missing_output_lens(outs, FakeTokenizer()) == 1
    assert [o.output_len for o in outs] == [3, 4, None]


# ---------------------------------------------------------------- arrivals, args, server info


def test_arrival_gaps():
    assert arrival_gaps(4, float("inf"), 0) == [0.0] * 4
    gaps = arrival_gaps(4000, 20.0, seed=1)
    assert gaps[0] == 0.0 and all(g >= 0 for g in gaps)
    assert np.mean(gaps[1:]) == pytest.approx(1 / 20.0, rel=0.1)
    assert gaps == arrival_gaps(4000, 20.0, seed=1) and gaps != arrival_gaps(4000, 20.0, seed=2)
    with pytest.raises(ValueError):
        arrival_gaps(3, 0.0, 0)


def test_parse_concurrency():
    assert parse_concurrency(None) == [None]
    assert parse_concurrency("8") == [8]
    assert parse_concurrency("1, 2,4") == [1, 2, 4]
    for bad in ("0", "a", "1,-2", ""):
        with pytest.raises(ValueError):
            parse_concurrency(bad)


def test_find_accept_length_shapes():
    assert target.find_accept_length({"internal_states": [{"avg_spec_accept_length": 2.75}]}) == 2.75
    assert target.find_accept_length({"spec": {"accept_length": 3}}) == 3.0
    assert target.find_accept_length({"x": [1, 2], "accept_length": None, "ok": True}) is None
    assert target.find_accept_length({"spec_enabled": False, "avg_spec_accept_length": 0.0}) is None
    assert target.find_accept_length(None) is None


def test_base_url():
    assert target.base_url("h", 1, None) == "http://h:1"
    assert target.base_url("h", 1, "http://x:9/v1/") == "http://x:9"
    assert target.base_url("h", 1, "https://x/api") == "https://x/api"


def test_plot_sweep_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    from specserve.bench.plot import plot_sweep

    results = [{"max_concurrency": c, "num_prompts": 8, "output_throughput": 10.0 * c, "median_tpot_ms": 5.0 + c}
               for c in (1, 2, 4)] + [{"max_concurrency": None, "num_prompts": 8, "output_throughput": 70.0,
                                       "median_tpot_ms": None}]
    path = tmp_path / "sweep.png"
    plot_sweep(results, str(path), title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_run_accept_length_is_the_runs_not_the_servers_lifetime():
    """bench and eval printed the server's lifetime accept length as this run's (warm-up and earlier runs in it);
    with verify counts the server-side figure is now the run's own."""
    from specserve.bench.target import SpecCounters, run_accept_length

    value, scope = run_accept_length(SpecCounters(2.0, 100), SpecCounters(2.5, 300))
    assert scope == "run" and value == pytest.approx((2.5 * 300 - 2.0 * 100) / 200)  # 2.75, not 2.5
    assert run_accept_length(SpecCounters(None, None), SpecCounters(2.25, None)) == (2.25, "lifetime")
    assert run_accept_length(SpecCounters(2.0, 100), SpecCounters(2.0, 100)) == (2.0, "lifetime")  # nothing ran
