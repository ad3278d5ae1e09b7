"""The prompt's logprobs (logprob_start_len >= 0): each prompt token's log-probability under the target given the
tokens before it, equal to transformers' teacher-forced log_softmax, computed once per token whatever the chunking
(chunked prefill splits the prompt), a retraction's re-prefill, or speculation; the first token has none."""

from __future__ import annotations

import pytest
import torch
from spec_fixtures import build_scheduler

from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams, check_logprob_args

PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 63, 12, 88, 19, 3, 54], [9, 8, 7, 6, 5, 4, 3, 2, 1, 77, 66]]


def _hf_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [T, V]
    return lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]  # token q's logprob at q - 1


@pytest.mark.parametrize("start", [0, 4])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "mtp"])
def test_prompt_logprobs_equal_teacher_forcing(tiny_models, start, spec):
    kw = {"speculative_algorithm": "MTP", "speculative_num_steps": 2} if spec else {}
    path = tiny_models["llama_mtp"]
    # chunks of 5 tokens split both prompts; a pool of 40 tokens forces a retraction (and a re-prefill) mid-decode
    sched, _ = build_scheduler(path, chunked_prefill_size=5, max_total_tokens=40, context_length=32,
                               schedule_conservativeness=0.0, **kw)
    reqs = []
    for i, p in enumerate(PROMPTS):
        r = Req(f"r{i}", list(p), SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True), seed=i,
                return_logprob=True, top_logprobs_num=2, logprob_start_len=start)
        reqs.append(r)
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    assert sched.stats.num_retractions > 0
    for r, p in zip(reqs, PROMPTS):
        want = _hf_logprobs(path, p)[max(start, 1) - 1:]
        got = r.input_logprobs
        assert len(got) == len(p) - start
        if start == 0:
            assert got[0] is None and r.input_top_logprobs[0] is None
            got = got[1:]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=1e-4)
        for (_t, v), lp in zip((pos[0] for pos in r.input_top_logprobs if pos), got):
            assert v >= lp - 1e-6  # the top token is at least as likely as the prompt's
        assert len(r.output_logprobs) == len(r.output_ids) == 12


def test_logprob_start_len_is_checked():
    for bad in (-2, 5, True, "0"):
        with pytest.raises(ValueError, match="logprob_start_len"):
            check_logprob_args(True, 0, bad, 5)
    check_logprob_args(True, 0, 4, 5)
