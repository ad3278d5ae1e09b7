"""The prefix cache in the engine: prompts sharing prefixes of many lengths (inside a page, on a page edge, across
chunk boundaries, a whole earlier conversation with its answer) give the outputs the same prompts give with the
cache off, for the dense, Qwen3-MoE, MLA (DeepSeek-V3), sparse-attention (GLM-5, top-k 5) and hybrid (Qwen3-Next,
Qwen3.5: recurrent-state snapshots) families with MTP; the cached token counts are what the tree's rules give; under
the overlap schedule, adaptive speculation's plain steps (the draft lagging), retraction and abort; eviction under a
small pool; every pool back to its start when idle and the cache flushed."""

import pytest
import torch
from deepseek_helpers import build_tiny_deepseek, build_tiny_dsa
from hybrid_helpers import build_tiny_hybrid
from spec_fixtures import ForcedSteps, build_scheduler
from test_deepseek_dsa import _with_mtp

from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
NEW = 10
CHUNK = 16  # --chunked-prefill-size: prompts longer than it cross chunk boundaries


@pytest.fixture(scope="module")
def family_models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return {"llama_mtp": tiny_models["llama_mtp"], "qwen3_moe_mtp": tiny_models["qwen3_moe_mtp"],
            "deepseek_mtp": build_tiny_deepseek(str(root / "ds"), seed=51, mtp=True),
            "glm5_sparse_mtp": _with_mtp(build_tiny_dsa(str(root / "glm"), "glm_moe_dsa", seed=63, index_topk=5),
                                         64),
            "qwen3_next_mtp": build_tiny_hybrid(str(root / "next"), "qwen3_next", seed=41, mtp=True),
            "qwen3_5_mtp": build_tiny_hybrid(str(root / "q35"), "qwen3_5", seed=42, mtp=True)}

HYBRID = ("qwen3_next_mtp", "qwen3_5_mtp")


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


BASE = _tokens(40, 0)


def _second_wave(first_fill: list[int]) -> list[list[int]]:
    """Prompts sharing the first request's tokens (prompt + answer) to many lengths."""
    return [BASE,  # a repeat: all but its last page edge's worth
            BASE[:3] + _tokens(7, 1),  # inside the first page (page size 16: nothing)
            BASE[:16] + _tokens(9, 2),  # to a page edge
            BASE[:21] + _tokens(12, 3),  # inside a page
            BASE[:37] + _tokens(6, 4),  # across chunk boundaries
            first_fill + _tokens(5, 5)]  # the next turn of a conversation: prompt, answer, new message


def _sampling(i, sampled):
    if sampled:
        return SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, ignore_eos=True)
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)


def _run_wave(sched, prompts, tag, sampled=False, abort_at=None) -> list[Req]:
    reqs = [Req(f"{tag}{i}", p, _sampling(i, sampled), seed=100 + i) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        if abort_at is not None and steps == abort_at[1]:
            sched.abort(reqs[abort_at[0]].rid)
    return reqs


def _expected_hit(prompt, fill, ps, draft, snapshots=None):
    """The tree's rule for a prompt after one finished request whose tokens were `fill` (its KV valid below
    len(fill) - 1): whole pages of the common prefix, not the prompt's last token, and with a draft, an edge where
    the prompt's next token is the one the cached request had there; for a model with recurrent state, an edge
    with a snapshot (`snapshots`: where the cached request's state was copied)."""
    common = 0
    while common < min(len(prompt), len(fill)) and prompt[common] == fill[common]:
        common += 1
    p = min(common, len(prompt) - 1, len(fill) - 1) // ps * ps
    if snapshots is not None:
        return max([b for b in snapshots if b <= p and (not draft or prompt[b] == fill[b])], default=0)
    while draft and p and prompt[p] != fill[p]:
        p -= ps
    return p


def _workload(path, ps, cache, sampled=False, **kw):
    sched, _ = build_scheduler(path, page_size=ps, max_total_tokens=kw.pop("max_total_tokens", 4096),
                               chunked_prefill_size=CHUNK, speculative_algorithm="MTP", speculative_num_steps=2,
                               disable_radix_cache=not cache, **kw)
    forced = kw.get("speculative_adaptive")
    if forced:  # plain steps now and then: the draft lags when a request ends
        sched.adaptive = ForcedSteps([False, True, True, False])
    first = _run_wave(sched, [BASE], "a", sampled)
    second = _run_wave(sched, _second_wave(first[0].fill_ids), "b", sampled)
    return sched, first, second


@pytest.mark.parametrize("key", ["llama_mtp", "qwen3_moe_mtp", "deepseek_mtp", "glm5_sparse_mtp", *HYBRID])
@pytest.mark.parametrize("ps", [1, 16])
def test_shared_prefixes_give_the_outputs_of_the_cache_off(family_models, key, ps):
    path = family_models[key]
    _, first_off, second_off = _workload(path, ps, cache=False)
    sched, first, second = _workload(path, ps, cache=True)
    assert [r.output_ids for r in first + second] == [r.output_ids for r in first_off + second_off]
    fill = first[0].fill_ids
    assert first[0].cached_tokens == 0
    # a hybrid model's snapshots: where the first request's prefill chunks ended, and where it ended (its state
    # is after its last committed token, len(fill) - 1, which is a page edge only with page size 1)
    snaps = None
    if key in HYBRID:
        snaps = [CHUNK, 2 * CHUNK] + ([len(fill) - 1] if ps == 1 else [])
        assert sched.prefix_cache_stats().state_snapshots > 0
    assert [r.cached_tokens for r in second] == [_expected_hit(r.origin_input_ids, fill, ps, True, snaps)
                                                 for r in second]
    if ps == 1 or key not in HYBRID:
        assert second[-1].cached_tokens > len(BASE)  # the conversation's answer came from the cache too
    assert all(r.cached_tokens == 0 for r in second_off)
    stats = sched.prefix_cache_stats()
    assert stats.hit_tokens == sum(r.cached_tokens for r in second) and stats.cached_pages > 0
    sched.check_idle_invariants()
    assert sched.flush_cache()
    assert sched.model_runner.allocator.num_free_pages == sched.initial_free_pages
    assert sched.prefix_cache_stats().cached_pages == 0 and sched.prefix_cache_stats().state_snapshots == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_sampled_outputs_are_the_same_by_seed(family_models, ps):
    """Seeded sampling with MTP: the draft's cache after a hit is what a cold prefill writes, so the drafts, and the
    accept/reject draws, are the same."""
    path = family_models["llama_mtp"]
    _, first_off, second_off = _workload(path, ps, cache=False, sampled=True)
    _, first, second = _workload(path, ps, cache=True, sampled=True)
    assert [r.output_ids for r in first + second] == [r.output_ids for r in first_off + second_off]
    assert [r.spec_accepted_drafts for r in second] == [r.spec_accepted_drafts for r in second_off]
    assert sum(r.cached_tokens for r in second) > 0


@pytest.mark.parametrize("key,ps", [("llama_mtp", 1), ("llama_mtp", 4), ("qwen3_next_mtp", 1)])
def test_overlap_adaptive_plain_steps_retraction_and_abort(family_models, key, ps):
    """The overlap schedule, plain steps that leave the draft behind (its lagging positions are not cached), a pool
    small enough to retract and evict, and an abort: outputs equal the cache-off ones, nothing leaks (a hybrid
    model's snapshots: not of a state a step in flight moves on)."""
    path = family_models[key]
    kw = dict(enable_overlap_schedule=True, speculative_adaptive=True, max_total_tokens=136, max_running_requests=4,
              schedule_conservativeness=0.0, context_length=80)
    outs = {}
    for cache in (False, True):
        sched, _ = build_scheduler(path, page_size=ps, chunked_prefill_size=CHUNK, speculative_algorithm="MTP",
                                   speculative_num_steps=2, disable_radix_cache=not cache, **kw)
        sched.adaptive = ForcedSteps([False, True, True, False])
        first = _run_wave(sched, [BASE], "a")
        second = _run_wave(sched, _second_wave(first[0].fill_ids), "b", abort_at=(2, 5))
        third = _run_wave(sched, _second_wave(first[0].fill_ids)[::-1], "c")
        outs[cache] = (first + second + third, sched)
        sched.check_idle_invariants()
    (off, _), (on, sched) = outs[False], outs[True]
    assert sched.stats.num_overlapped_steps > 0
    assert sched.stats.num_retractions + outs[False][1].stats.num_retractions > 0
    for a, b in zip(off, on):
        if a.finished_reason["type"] == "abort" or b.finished_reason["type"] == "abort":
            assert b.output_ids == a.output_ids[:len(b.output_ids)] or a.output_ids == b.output_ids[:len(a.output_ids)]
        else:
            assert b.output_ids == a.output_ids, b.rid
    assert sum(r.cached_tokens for r in on) > 0
    assert sched.flush_cache() and sched.model_runner.allocator.num_free_pages == sched.initial_free_pages


@pytest.mark.parametrize("key", ["llama_mtp", "qwen3_next_mtp"])
def test_eviction_under_a_small_pool_keeps_outputs_and_accounting(family_models, key):
    """Many distinct prompts through a pool that holds a few: the tree evicts least recently used pages (and a
    hybrid model's bounded snapshots: two) to admit them; outputs equal the cache-off ones; the last prompt,
    repeated, still hits."""
    path = family_models[key]
    prompts = [_tokens(30, 50 + i) for i in range(8)]
    outs = {}
    for cache in (False, True):
        sched, _ = build_scheduler(path, page_size=4, max_total_tokens=128, chunked_prefill_size=CHUNK,
                                   context_length=48,
                                   speculative_algorithm="MTP", speculative_num_steps=2, max_running_requests=2,
                                   disable_radix_cache=not cache)
        reqs = []
        for i, p in enumerate(prompts):
            reqs += _run_wave(sched, [p], f"e{i}")
        again = _run_wave(sched, [prompts[-1]], "again")
        outs[cache] = (reqs + again, sched)
        sched.check_idle_invariants()
    (off, _), (on, sched) = outs[False], outs[True]
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    # 29 tokens may hit (page size 4); a hybrid model's snapshot is at its chunk edge (16): its prompt's end (30)
    # and its own (39) are no page edges
    assert on[-1].cached_tokens == (16 if key == "qwen3_next_mtp" else 28)
    cache = sched.model_runner.kv.prefix_cache
    assert cache.cached_pages * 4 <= 128 and cache.evictable_pages == cache.cached_pages
    if cache.snapshots is not None:
        assert cache.snapshots.count == 2 and 1 <= sched.prefix_cache_stats().state_snapshots <= 2


def test_n_choices_of_one_prompt_share_its_pages(family_models):
    """Choices of one long prompt admitted together: the first prefills it, the others wait a step and take it from
    the cache (each computes only its last token)."""
    path = family_models["llama_mtp"]
    prompt = _tokens(45, 9)
    sched, _ = build_scheduler(path, page_size=4, max_total_tokens=4096, chunked_prefill_size=64,
                               speculative_algorithm="MTP", speculative_num_steps=2)
    reqs = [Req(f"n{i}", list(prompt), SamplingParams(max_new_tokens=NEW, temperature=0.9, ignore_eos=True),
                seed=7 + i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    assert [r.cached_tokens for r in reqs] == [0, 44, 44, 44]
    assert sched.stats.num_prompt_tokens == 45 + 3 * 1
    sched.check_idle_invariants()
