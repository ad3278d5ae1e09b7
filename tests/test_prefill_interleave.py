"""Prefill never freezes decoding (engine/scheduler.py: Scheduler.decode_owed): while a long prompt is prefilled in
chunks, the running requests decode between its chunks, so a running request's longest pause is one prefill step
(at most --chunked-prefill-size prompt tokens), plain and speculating, synchronous and under the overlap schedule;
the outputs are those of each request run alone."""

import pytest
import torch
from spec_fixtures import build_scheduler

from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 16
LONG = 7 * CHUNK + 5  # eight chunks


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _alone(path, prompt, n, kw):
    sched, _ = build_scheduler(path, chunked_prefill_size=CHUNK, **kw)
    r = Req("alone", prompt, _greedy(n), seed=0)
    sched.add_request(r)
    while sched.has_work:
        sched.step()
    return r.output_ids


@pytest.mark.parametrize("spec,overlap", [(False, False), (True, False), (True, True)])
def test_a_long_prompt_pauses_running_requests_by_one_chunk_at_most(tiny_models, spec, overlap):
    path = tiny_models["llama_mtp"]
    kw = dict(max_total_tokens=2048, enable_overlap_schedule=overlap)
    if spec:
        kw.update(speculative_algorithm="MTP", speculative_num_steps=2, speculative_adaptive=False)
    sched, _ = build_scheduler(path, chunked_prefill_size=CHUNK, **kw)
    short, long_prompt = _tokens(6, 1), _tokens(LONG, 2)
    stream = Req("stream", short, _greedy(40), seed=0)
    sched.add_request(stream)
    while len(stream.output_ids) < 3:  # decoding
        sched.step()
    late = Req("late", long_prompt, _greedy(5), seed=0)
    sched.add_request(late)
    # prompt tokens prefilled since the stream last gained tokens, at each step
    gaps, since, seen, prompt_tokens = [], 0, len(stream.output_ids), sched.stats.num_prompt_tokens
    while sched.has_work:
        sched.step()
        since += sched.stats.num_prompt_tokens - prompt_tokens
        prompt_tokens = sched.stats.num_prompt_tokens
        if len(stream.output_ids) > seen or stream.finished:
            gaps.append(since)
            since, seen = 0, len(stream.output_ids)
    assert late.finished and stream.finished
    assert sched.stats.num_prompt_tokens >= LONG + len(short)
    # the whole long prompt ran while the stream decoded, a chunk at most between two of its steps
    assert sum(gaps) >= LONG and max(gaps) <= CHUNK
    sched.check_idle_invariants()
    kw.pop("enable_overlap_schedule")
    assert stream.output_ids == _alone(path, short, 40, kw)
    assert late.output_ids == _alone(path, long_prompt, 5, kw)
