"""Logit rules (penalties, logit bias, grammars) stay lossless under speculation.

- The batched adjuster applied along a draft path equals applying each rule position by position with the drafts
  before it counted as output (the definition).
- A grammar's masks along a draft path are the matcher's after each draft; past a forbidden draft positions stay
  unmasked; the walk leaves the matcher where it was; a reasoning gate opens inside a draft path.
- Greedy: the embedded model with MTP (overlap schedule on) gives plain decoding's tokens under json_schema, regex,
  penalties and a logit bias, in a batch mixed with unconstrained requests; the outputs match their grammars.
- Sampled: with rules on, speculative sampling follows the exact distribution of the adjusted target (chi-square,
  small-vocabulary model, oracle drafts the grammar partly forbids).
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import _tiny_tokenizer_files, build_tiny_model
from spec_fixtures import OracleDraft, build_scheduler
from test_sampling_lossless import PROMPT, V, _assert_fits, _filtered

from specserve.engine.grammar import GrammarBackend
from specserve.engine.logit_rules import LogitAdjuster, RowRules
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams


def _reference_adjust(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams) -> torch.Tensor:
    """One position's rules, by their definition."""
    out = logits.clone().double()
    counts = torch.zeros_like(out)
    for t in output:
        counts[t] += 1
    for t in set(prompt) | set(output):
        if sp.repetition_penalty != 1.0:
            out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
    out -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).double()
    for t, b in sp.bias_items:
        out[t] += b
    return out


def test_adjuster_along_drafts_equals_rules_position_by_position():
    g = torch.Generator().manual_seed(0)
    vocab, width = 23, 4
    sps = [SamplingParams(frequency_penalty=0.8, presence_penalty=0.5),
           SamplingParams(repetition_penalty=1.3, logit_bias={"5": 3.0, "7": -100}),
           SamplingParams(),  # a row without rules in a ruled batch: unchanged
           SamplingParams(frequency_penalty=-0.4, repetition_penalty=0.7, logit_bias={"0": 1.5})]
    reqs = []
    for sp in sps:
        prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
        output = torch.randint(0, vocab, (5,), generator=g).tolist() + [3, 3]
        reqs.append(SimpleNamespace(origin_input_ids=prompt, output_ids=output, return_logprob=False,
                                    rules=RowRules(sp) if sp.has_logit_rules else None))
    logits = torch.randn((len(reqs), width, vocab), generator=g) * 3
    drafts = torch.randint(0, vocab, (len(reqs), width - 1), generator=g)
    drafts[0, :2] = 3  # a draft repeating an output token, twice
    got = LogitAdjuster(reqs, vocab, torch.device("cpu"))(logits, drafts)
    for i, (r, sp) in enumerate(zip(reqs, sps)):
        for j in range(width):
            want = _reference_adjust(logits[i, j], r.origin_input_ids, r.output_ids + drafts[i, :j].tolist(), sp)
            torch.testing.assert_close(got[i, j].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], logits[2])


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tok"))
    _tiny_tokenizer_files(folder, V)  # <unk> <s> </s> a..i = ids 0..11
    return AutoTokenizer.from_pretrained(folder)


def _allowed(mask_row: torch.Tensor) -> list[int]:
    return [t for t in range(V) if (int(mask_row[t // 32]) >> (t % 32)) & 1]


A, B, C, H, I_ = 3, 4, 5, 10, 11  # token ids of a, b, c, h, i
ALL = list(range(V))
LETTERS = list(range(3, V))


def test_grammar_masks_follow_the_draft_path(tiny_tokenizer):
    backend = GrammarBackend(tiny_tokenizer, V, [2])
    state = backend.start("regex", "[a-f][c-i][a-i]").result()
    mask = torch.full((4, 1), -1, dtype=torch.int32)
    state.fill(mask, [A, C, B])
    assert [_allowed(m) for m in mask] == [list(range(3, 9)), list(range(5, 12)), LETTERS, [2]]
    # a forbidden draft (b after a): the positions after it stay unmasked; the walk left the matcher unmoved
    mask = torch.full((4, 1), -1, dtype=torch.int32)
    state.fill(mask, [A, B, B])
    assert [_allowed(m) for m in mask] == [list(range(3, 9)), list(range(5, 12)), ALL, ALL]
    state.commit(A)
    mask = torch.full((2, 1), -1, dtype=torch.int32)
    state.fill(mask, [C])
    assert [_allowed(m) for m in mask] == [list(range(5, 12)), LETTERS]


def test_reasoning_gate_opens_inside_a_draft_path(tiny_tokenizer):
    backend = GrammarBackend(tiny_tokenizer, V, [2])
    state = backend.start("regex", "[a-c]+", reasoning_end=[H, I_]).result()
    mask = torch.full((5, 1), -1, dtype=torch.int32)
    state.fill(mask, [A, H, I_, B])  # "a" reasoning, "hi" ends it, then "b" under the grammar
    assert [_allowed(m) for m in mask] == [ALL, ALL, ALL, [A, B, C], [2, A, B, C]]
    state.commit(H)  # the marker split over two steps
    mask = torch.full((2, 1), -1, dtype=torch.int32)
    state.fill(mask, [I_])
    assert [_allowed(m) for m in mask] == [ALL, [A, B, C]]
    state.commit(I_)
    assert state.active and not state.terminated


# ---------------------------------------------------------------------------------------------- embedded model
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ANSWER = r"(yes|no), because [a-z ]+\."
CASES = [
    ("Give me a person as JSON.", {"json_schema": json.dumps(PERSON), "max_new_tokens": 40}),
    ("Is the sky green?", {"regex": ANSWER, "max_new_tokens": 30}),
    ("Write a list of fruits.", {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.2,
                                 "max_new_tokens": 24}),
    ("Name three colours.", {"logit_bias": {"28": 6.0, "30": -100}, "max_new_tokens": 16}),
    ("Write a list of fruits.", {"max_new_tokens": 24}),  # no rules, in the same batch
]


@pytest.fixture(scope="module")
def embedded_outputs():
    from specserve import Engine

    outs = {}
    for name, kw in {"plain": {"speculative_algorithm": "NONE"},
                     "mtp_overlap": {"enable_overlap_schedule": True}}.items():
        engine = Engine(**kw)
        try:
            prompts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q, _ in CASES]
            outs[name] = engine.generate(prompts, [{"temperature": 0.0, **sp} for _, sp in CASES], return_logprob=True,
                                         top_logprobs_num=2)
            if name == "mtp_overlap":
                outs["spec_steps"] = engine.core.scheduler.stats.spec_verify_ct
                with pytest.raises(ValueError, match="could not be compiled"):
                    engine.generate(prompts[0], {"json_schema": '{"$ref": "#/nowhere"}', "max_new_tokens": 4})
                engine.core.scheduler.check_idle_invariants()
        finally:
            engine.shutdown()
    return outs


def test_greedy_spec_equals_plain_under_rules(embedded_outputs):
    assert embedded_outputs["spec_steps"] > 0
    for (q, sp), plain, spec in zip(CASES, embedded_outputs["plain"], embedded_outputs["mtp_overlap"]):
        assert spec["output_ids"] == plain["output_ids"], (q, sp)


def test_logprobs_equal_with_and_without_speculation(embedded_outputs):
    for plain, spec in zip(embedded_outputs["plain"], embedded_outputs["mtp_overlap"]):
        a, b = plain["meta_info"], spec["meta_info"]
        assert len(a["output_token_logprobs"]) == len(plain["output_ids"])
        assert [t for _, t, _ in a["output_token_logprobs"]] == plain["output_ids"]
        np.testing.assert_allclose([x[0] for x in a["output_token_logprobs"]],
                                   [x[0] for x in b["output_token_logprobs"]], atol=1e-4)
        for top, (lp, tok, _) in zip(a["output_top_logprobs"], a["output_token_logprobs"]):
            assert len(top) == 2 and top[0][0] >= top[1][0]
            assert top[0][1] == tok and top[0][0] == pytest.approx(lp)  # greedy: the chosen token is the top one
            assert lp <= 0.0


def test_outputs_follow_their_grammars(embedded_outputs):
    person = json.loads(embedded_outputs["plain"][0]["text"])
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and isinstance(person["age"], int)
    assert re.fullmatch(ANSWER, embedded_outputs["plain"][1]["text"])
    assert embedded_outputs["plain"][0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert 30 not in embedded_outputs["plain"][3]["output_ids"]


def test_grammar_and_rules_are_refused_clearly():
    for bad, msg in [({"regex": "a", "ebnf": "root ::= \"a\""}, "only one of"),
                     ({"json_schema": "{not json"}, "not valid JSON"),
                     ({"logit_bias": {"x": 1.0}}, "token ids"),
                     ({"logit_bias": {"3": 101}}, r"\[-100, 100\]"),
                     ({"frequency_penalty": 3}, r"\[-2, 2\]"),
                     ({"repetition_penalty": 0}, r"\(0, 2\]")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams.from_dict(bad)


# ---------------------------------------------------------------------------------------------- distributions
RULES = {"frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.3, "logit_bias": {"4": 1.0}}


@pytest.fixture(scope="module")
def ruled_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v12r") / "m")
    return build_tiny_model(path, "llama", seed=5, vocab_size=V, hidden_size=32, intermediate_size=64,
                            num_attention_heads=2, num_key_value_heads=1, logit_scale=2.5)


def _exact_ruled_joint(path, regex_sets: list[list[int]], temperature: float) -> np.ndarray:
    """P(t1, t2, t3) of the adjusted target: RULES, then the grammar's allowed set per position (a regex of three
    character classes), then temperature."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    sp = SamplingParams(**RULES)

    def dist(out: list[int]) -> np.ndarray:
        with torch.no_grad():
            lg = hf(torch.tensor([PROMPT + out])).logits[0, -1]
        lg = _reference_adjust(lg, PROMPT, out, sp).numpy()
        lg[[t for t in range(V) if t not in regex_sets[len(out)]]] = -np.inf
        return _filtered(lg, temperature, V, 1.0)

    joint = np.zeros((V, V, V))
    p1 = dist([])
    for a in np.nonzero(p1)[0]:
        p2 = dist([int(a)])
        for b in np.nonzero(p2)[0]:
            joint[a, b] = p1[a] * p2[b] * dist([int(a), int(b)])
    return joint


def test_spec_sampling_under_rules_matches_exact_distribution(ruled_model, tiny_tokenizer):
    letter = "abcdefghi"
    # the oracle drafts the most likely output under the rules and a letters-only grammar; the third token's class
    # then forbids its third token: the oracle's second draft is always cut by the grammar, its first accepted
    # with its probability under the rules
    mode = [int(t) for t in np.unravel_index(_exact_ruled_joint(ruled_model, [LETTERS] * 3, 1.0).argmax(), (V,) * 3)]
    classes = [LETTERS, LETTERS, [t for t in LETTERS if t != mode[2]]]
    regex = "".join("[" + "".join(letter[t - 3] for t in c) + "]" for c in classes)
    joint = _exact_ruled_joint(ruled_model, classes, 1.0)
    backend = GrammarBackend(tiny_tokenizer, V, [2])
    compiled = backend.compile("regex", regex)
    num = 2000
    for name, spec in {"plain": {}, "spec3": {"speculative_algorithm": "MTP", "speculative_num_steps": 3}}.items():
        draft = OracleDraft(32, {row: PROMPT + mode for row in range(1, 65)}, wrong_every=None, vocab=V) \
            if spec else None
        sched, _ = build_scheduler(ruled_model, draft=draft, max_total_tokens=1 << 15, max_running_requests=64,
                                   **spec)
        reqs = []
        for i in range(num):
            sp = SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True, regex=regex, **RULES)
            r = Req(f"r{i}", list(PROMPT), sp, seed=5000 + i)
            r.rules = RowRules(sp, backend.new_state(compiled))
            reqs.append(r)
            sched.add_request(r)
        while sched.has_work:
            sched.step()
        sched.check_idle_invariants()
        if spec:
            # drafts are accepted (about 1 in 8 here: the rules flatten the target) as well as cut by the grammar
            assert sched.stats.spec_accept_length > 1.05, sched.stats.spec_accept_length
        _assert_fits(joint, np.array([r.output_ids for r in reqs]), name)


def test_grammar_after_reasoning_boundary_greedy_spec_equals_plain(ruled_model, tiny_tokenizer):
    """A grammar that opens after a reasoning marker: the output up to and including the marker is the unconstrained
    greedy one (the marker is never masked), the grammar applies right after it, and speculation (oracle drafts of
    the unconstrained output, which cross the boundary and are then forbidden) gives plain decoding's tokens."""
    from test_sampling_lossless import _greedy

    free = _greedy(ruled_model)  # 8 unconstrained greedy tokens
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] >= 3)  # a fresh letter: the marker
    letter = "abcdefghi"
    banned = free[k + 1]  # the unconstrained next token: the grammar forbids it right after the marker
    assert banned >= 3, free
    regex = "[" + "".join(c for t, c in zip(LETTERS, letter) if t != banned) + "]{3}"
    backend = GrammarBackend(tiny_tokenizer, V, [2])
    compiled = backend.compile("regex", regex)
    outs = {}
    for name, spec in {"plain": {}, "spec3": {"speculative_algorithm": "MTP", "speculative_num_steps": 3}}.items():
        draft = OracleDraft(32, {row: PROMPT + free for row in range(1, 9)}, wrong_every=None, vocab=V) \
            if spec else None
        sched, _ = build_scheduler(ruled_model, draft=draft, max_total_tokens=4096, **spec)
        sp = SamplingParams(max_new_tokens=k + 4, temperature=0.0, ignore_eos=True, regex=regex)
        r = Req("g", list(PROMPT), sp, seed=0)
        r.rules = RowRules(sp, backend.new_state(compiled, reasoning_end=[free[k]]))
        sched.add_request(r)
        while sched.has_work:
            sched.step()
        sched.check_idle_invariants()
        outs[name] = r.output_ids
        assert r.rules.grammar.active and not r.rules.grammar.rejected
    assert outs["spec3"] == outs["plain"]
    out = outs["plain"]
    assert out[:k + 1] == free[:k + 1]  # the reasoning and its marker, untouched
    assert all(t >= 3 for t in out[k + 1:]) and out[k + 1] != banned  # the grammar from the next token on


def _ruled_greedy_run(path, backend, compiled, n_req: int, new: int, force_plain=None, **kw) -> tuple[list, object]:
    draft = None
    if kw.get("speculative_algorithm"):
        from test_sampling_lossless import _greedy

        seq = PROMPT + _greedy(path)
        draft = OracleDraft(32, {row: seq for row in range(1, 65)}, wrong_every=3, vocab=V)
    sched, _ = build_scheduler(path, draft=draft, **kw)
    if force_plain is not None:
        from spec_fixtures import ForcedSteps

        sched.adaptive, sched.adaptive_ruled = ForcedSteps([False]), ForcedSteps(force_plain)
    reqs = []
    for i in range(n_req):
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True, frequency_penalty=0.3 * (i % 3),
                            regex="[a-f][a-i]{0,80}")
        r = Req(f"r{i}", PROMPT[: 2 + i % 4], sp, seed=i)
        r.rules = RowRules(sp, backend.new_state(compiled))
        reqs.append(r)
        sched.add_request(r)
    while sched.has_work:
        sched.step()
    sched.check_idle_invariants()
    return [r.output_ids for r in reqs], sched


def test_rules_with_adaptive_steps_and_retraction(ruled_model, tiny_tokenizer):
    """Grammar + penalties through plain and speculative steps interleaved (adaptive speculation) and retractions
    (a pool too small for the batch): the same greedy tokens as plain decoding with room to spare."""
    backend = GrammarBackend(tiny_tokenizer, V, [2])
    compiled = backend.compile("regex", "[a-f][a-i]{0,80}")
    plain, _ = _ruled_greedy_run(ruled_model, backend, compiled, 6, 30, max_total_tokens=4096)
    spec, sched = _ruled_greedy_run(ruled_model, backend, compiled, 6, 30, force_plain=[True, False, False],
                                    max_total_tokens=96, context_length=64, speculative_algorithm="MTP",
                                    speculative_num_steps=3,
                                    speculative_adaptive=True)
    assert sched.stats.num_retractions > 0 and sched.stats.spec_plain_steps > 0 and sched.stats.spec_verify_ct > 0
    assert spec == plain
    # ruled batches are steered, and timed, by their own adaptive speculation
    assert sched.adaptive_ruled.recorded and not sched.adaptive.recorded
    assert all(3 <= t <= 8 for t in (o[0] for o in plain))  # the grammar's first class, [a-f]


def test_abort_while_the_grammar_compiles(ruled_model, tiny_tokenizer):
    from concurrent.futures import Future

    sched, _ = build_scheduler(ruled_model, max_total_tokens=1024)
    sp = SamplingParams(max_new_tokens=4, regex="[a-c]+")
    r = Req("c", list(PROMPT), sp, seed=0)
    r.rules, r.grammar_future = RowRules(sp), Future()  # a compile that has not finished
    sched.add_request(r)
    assert sched.has_work and r in sched.compiling and r not in sched.waiting
    sched.step()  # nothing to run: waits briefly for the compile, then returns
    assert r in sched.compiling
    sched.abort("c")
    assert r.finished and not sched.compiling and r.grammar_future is None
    sched.step()
    sched.check_idle_invariants()
