"""engine/decode_plan.py: the six decode paths and when each is taken (the scheduler follows the plan; the paths
themselves are exercised end to end by test_overlap_schedule.py and test_adaptive_spec.py)."""

import pytest

from specserve.engine.decode_plan import StepKind, plan_decode, step_kind


def test_step_kind():
    assert step_kind(speculating=False, plain_chosen=False) is StepKind.DECODE
    assert step_kind(speculating=True, plain_chosen=False) is StepKind.SPEC
    assert step_kind(speculating=True, plain_chosen=True) is StepKind.PLAIN


@pytest.mark.parametrize("kind", list(StepKind))
def test_synchronous_without_the_overlap_schedule(kind):
    plan = plan_decode(kind, overlap=False)
    assert plan.kind is kind and not plan.overlapped and "overlap schedule is off" in plan.reason


@pytest.mark.parametrize("facts, overlapped", [
    (dict(), True),
    (dict(batch=False), False),  # every row waits for the read of the step in flight
    (dict(one_graph=False), False),  # outside the one-step graphs, or a row lags
    (dict(spec_in_flight=True), True),  # a speculative step continues from the one in flight
])
def test_spec_step(facts, overlapped):
    assert plan_decode(StepKind.SPEC, overlap=True, **facts).overlapped == overlapped


@pytest.mark.parametrize("facts, overlapped", [
    (dict(), True),
    (dict(spec_in_flight=True), False),  # a switch from speculative steps: the plain step needs the host's S
    (dict(one_graph=False), False),  # outside the plain-step graphs, or a full lag
    (dict(batch=False), False),
])
def test_plain_step(facts, overlapped):
    assert plan_decode(StepKind.PLAIN, overlap=True, **facts).overlapped == overlapped


def test_decode_step_overlaps_always_and_falls_back():
    plan = plan_decode(StepKind.DECODE, overlap=True, batch=False, one_graph=False)
    assert plan.overlapped
    back = plan.fall_back("pages")
    assert back.kind is StepKind.DECODE and not back.overlapped and back.reason == "pages"
