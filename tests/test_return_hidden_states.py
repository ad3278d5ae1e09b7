"""--enable-return-hidden-states (SGLang's return_hidden_states): meta_info.hidden_states equals transformers' last
hidden states over prompt + output_ids[:-1], on every decode path (plain engine, speculative steps with high and
low acceptance, adaptive speculation's plain steps), under the overlap schedule, with chunked prefill, page sizes 1
and 16 and retraction; asking without the flag is refused; requests that do not ask get no hidden states and the
same tokens."""

from __future__ import annotations

import pytest
import torch
from spec_fixtures import ForcedSteps, OracleDraft, build_scheduler, run_greedy

from specserve import Engine
from specserve.engine.hidden_states import hidden_states_output

PROMPT_LENS = (5, 21, 2, 12)
NEW = 14


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_llama(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()


def _hf_hidden(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]  # [T, H] after the norm


def _check(hf, prompt: list[int], output_ids: list[int], hidden: list, atol: float = 2e-4) -> None:
    """SGLang's shape: [prompt [P, H]] + one [H] per output token but the last; values = transformers'."""
    assert len(hidden) == len(output_ids)
    assert torch.tensor(hidden[0]).shape == (len(prompt), hf.config.hidden_size)
    got = torch.cat([torch.tensor(hidden[0])] + [torch.tensor(h)[None] for h in hidden[1:]])
    ref = _hf_hidden(hf, prompt + output_ids[:-1])
    torch.testing.assert_close(got, ref, atol=atol, rtol=1e-4)


def _run(sched, prompts, ask=lambda i: True, new=NEW):
    return run_greedy(sched, prompts, new, hidden=ask)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_plain_engine(tiny_models, hf_llama, page_size, overlap):
    sched, _ = build_scheduler(tiny_models["llama"], page_size=page_size, max_total_tokens=4096,
                               chunked_prefill_size=8, enable_return_hidden_states=True,
                               enable_overlap_schedule=overlap)
    prompts = _prompts()
    # odd requests do not ask: they get nothing, the same tokens, and (overlap) the batch still runs synchronously
    reqs = _run(sched, prompts, ask=lambda i: i % 2 == 0)
    plain, _ = build_scheduler(tiny_models["llama"], page_size=page_size, max_total_tokens=4096)
    ref = _run(plain, prompts, ask=lambda i: False)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    for r, p in zip(reqs, prompts):
        if r.return_hidden_states:
            _check(hf_llama, p, r.output_ids, hidden_states_output(r))
        else:
            assert r.hidden_states == []
    if overlap:
        assert sched.stats.num_overlapped_steps == 0  # a request returning hidden states reads every step


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_speculative_steps_keep_accepted_positions_only(tiny_models, hf_llama, overlap, n):
    """An oracle drafter accepts most drafts (1 in 4 wrong): each step keeps 1 to N + 1 positions."""
    prompts = _prompts(1)
    plain, _ = build_scheduler(tiny_models["llama"], max_total_tokens=4096)
    ref = _run(plain, prompts, ask=lambda i: False)
    seqs = {i + 1: p + r.output_ids for i, (p, r) in enumerate(zip(prompts, ref))}
    sched, _ = build_scheduler(tiny_models["llama"], draft=OracleDraft(64, seqs, wrong_every=4, vocab=256),
                               max_total_tokens=4096, speculative_algorithm="MTP", speculative_num_steps=n,
                               enable_return_hidden_states=True, enable_overlap_schedule=overlap)
    reqs = _run(sched, prompts)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in ref]
    assert max(r.spec_accepted_drafts for r in reqs) > 0
    for r, p in zip(reqs, prompts):
        _check(hf_llama, p, r.output_ids, hidden_states_output(r))


def test_adaptive_plain_steps_and_mtp_head(tiny_models):
    """The checkpoint's own MTP layer (low acceptance) with adaptive speculation's plain steps in between."""
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama_mtp"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sched, _ = build_scheduler(path, max_total_tokens=4096, chunked_prefill_size=16, speculative_algorithm="MTP",
                               speculative_num_steps=2, speculative_adaptive=True, enable_return_hidden_states=True)
    sched.adaptive = ForcedSteps([True, False, False])
    prompts = _prompts(2)
    reqs = _run(sched, prompts)
    assert sched.stats.spec_plain_steps > 0 and sched.stats.spec_verify_ct > 0
    for r, p in zip(reqs, prompts):
        _check(hf, p, r.output_ids, hidden_states_output(r))


def test_engine_api_retraction_and_refusal(tiny_models, hf_llama):
    path = tiny_models["llama"]
    prompts = [torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (40, 55, 33, 61, 47, 52)]
    sp = {"max_new_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    # a pool too small for the batch: requests are retracted and prefilled again over prompt + outputs
    kw = dict(context_length=128, chunked_prefill_size=32, max_running_requests=8, schedule_conservativeness=0.0,
              enable_return_hidden_states=True)
    with Engine(model_path=path, max_total_tokens=160, **kw) as tight:
        outs = tight.generate(input_ids=prompts, sampling_params=sp, return_hidden_states=True)
        assert tight.scheduler.stats.num_retractions > 0
        plain = tight.generate(input_ids=prompts[0], sampling_params=sp)
    for o, p in zip(outs, prompts):
        _check(hf_llama, p, o["output_ids"], o["meta_info"]["hidden_states"])
    assert "hidden_states" not in plain["meta_info"] and plain["output_ids"] == outs[0]["output_ids"]
    with Engine(model_path=path, max_total_tokens=1024) as off, \
            pytest.raises(ValueError, match="--enable-return-hidden-states"):
        off.generate(input_ids=prompts[0], sampling_params=sp, return_hidden_states=True)


def test_generate_route_parsing():
    from specserve.server.errors import APIError
    from specserve.server.native_routes import _requests
    from specserve.server.protocol import GenerateRequest

    class _Caps:  # _requests tokenises text only; these bodies give ids, within every request cap
        def check_prompt_count(self, prompts, choices=None, param="prompt"):
            assert prompts <= 2

        def check_prompt_tokens(self, prompts, param="prompt"):
            assert sum(map(len, prompts)) <= 3

        def check_n(self, n, param="n"):
            return n

    class _TM:
        caps = _Caps()

    body = GenerateRequest(input_ids=[[1, 2], [3]], return_hidden_states=[True, False])
    reqs, single = _requests(_TM(), body)
    assert [r.return_hidden_states for r in reqs] == [True, False] and not single
    reqs, _ = _requests(_TM(), GenerateRequest(input_ids=[1, 2], return_hidden_states=True))
    assert reqs[0].return_hidden_states
    with pytest.raises(APIError) as e:
        _requests(_TM(), GenerateRequest(input_ids=[[1], [2]], return_hidden_states=[True]))
    assert e.value.status == 400 and e.value.param == "return_hidden_states"


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [False, True])
def test_gpu_graphs_keep_the_hidden_states(tiny_models, hf_llama, spec):
    """On a GPU the buffer is written inside the captured graphs (decode step, one-graph spec step, plain step),
    with the overlap schedule on: the same values as transformers, and the graphs actually replayed."""
    prompts = _prompts(3)
    kw = dict(device="cuda", max_total_tokens=4096, cuda_graph_bs=[1, 2, 4, 8], enable_return_hidden_states=True)
    if spec:
        plain, _ = build_scheduler(tiny_models["llama"], device="cuda", max_total_tokens=4096)
        ref = _run(plain, prompts, ask=lambda i: False)
        seqs = {i + 1: p + r.output_ids for i, (p, r) in enumerate(zip(prompts, ref))}
        sched, _ = build_scheduler(tiny_models["llama"], draft=OracleDraft(64, seqs, wrong_every=4, vocab=256),
                                   speculative_algorithm="MTP", speculative_num_steps=3, speculative_adaptive=True,
                                   **kw)
        sched.adaptive = ForcedSteps([False, False, True])
    else:
        sched, _ = build_scheduler(tiny_models["llama"], **kw)
    reqs = _run(sched, prompts)
    for r, p in zip(reqs, prompts):
        _check(hf_llama, p, r.output_ids, hidden_states_output(r), atol=2e-3)  # GPU kernels' rounding
    mr = sched.model_runner
    graphs = [mr.spec.spec_step_graph, mr.spec.plain_step_graph] if spec else [mr.decode_step_graph]
    assert all(g.replays > 0 for g in graphs)
