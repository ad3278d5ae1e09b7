"""Which decode step runs next, and why: the one place the scheduler's six decode paths are chosen.

A decode step is of one of three kinds, and runs overlapped (launched before the step in flight is read, its own
tokens read with the next step: engine/overlap.py) or synchronously (the step in flight read first, then this step
run and read at once):

    kind    what runs (engine/steps.py -> ...)                          overlapped when
    ------  ----------------------------------------------------------  --------------------------------------------
    DECODE  a plain engine's decode step: launch_decode / run_decode      always, under the overlap schedule
            (graphs/step_graph.py DecodeStepGraph, else the decode
            runner's graph + sampling)
    SPEC    a speculative step: SpecWorker.launch / run_spec_step         the batch runs as the one-step graph
            (speculative/spec_step.py SpecStepGraph, else phase by        (SpecStepGraph covers it) and no row's
            phase)                                                        draft lags (a catch-up needs the host's S)
    PLAIN   adaptive speculation's plain step: SpecWorker.launch_plain /  no speculative step is in flight (its rows'
            run_plain_step (speculative/plain_step.py PlainStepGraph,     S are still on the device), PlainStepGraph
            else its verify runner's graph + sampling)                    covers the batch and no row's lag is full

Every kind runs synchronously when the overlap schedule is off (--disable-overlap-schedule, a CPU without
--enable-overlap-schedule, a tensor-parallel engine, whose steps are broadcast to the other ranks first), while a
running request carries logit rules (penalties, a logit bias, a grammar: engine/logit_rules.py; they are computed
from every token read, and a grammar walks each step's drafts on the host), while a running request returns hidden
states (the step's buffer is read before a later step writes it), when no
running request may join the launch (a speculating engine's rows all wait for the read of the step in flight), or
when the step's pages cannot be had without a retraction, which needs every token read (the scheduler finds that
when it reserves them, after the plan: `DecodePlan.fall_back`). The kind is a speculating engine's choice, made once
a step by adaptive speculation (engine/adaptive_spec.py); a plain engine always takes DECODE. Every path gives the
same tokens: overlap changes when the host reads them, never what they are.

Glossary (one name per concept, in code, tests and docs; engine/scheduler.py follows it):
- decode step: a plain (non-speculating) engine's step, one token per request: steps.launch_decode / run_decode,
  the target's DecodeRunner (model_runner.phases.decode), the whole step as one graph DecodeStepGraph
  (model_runner.decode_step_graph).
- speculative step (spec step): draft decode -> target verify -> accept -> draft extend, 1 to N + 1 tokens per
  request: SpecWorker.step / launch, spec_step_device, its phases SpecPhases (worker.phases), the whole step as one
  graph SpecStepGraph (worker.spec_step_graph).
- plain step: a speculating engine's draft-free step, one token per request, taken where adaptive speculation
  (engine/adaptive_spec.py) chooses it: SpecWorker.plain_step / launch_plain, plain_step_device over a
  PlainStepContext (worker.plain_step_ctx), the target's PlainVerifyRunner (model_runner.phases.plain_verify), the
  whole step as one graph PlainStepGraph (worker.plain_step_graph). The draft lags behind plain steps and catches up
  (SpecWorker.catch_up) before the next spec step.
- phase: one forward of one model inside a step, run by a PhaseRunner (graphs/phase_runners.py) on its own graph,
  or inlined into a step graph (a PhaseCall: replay_phase / inline_phase).
- step graph: a whole step captured as one CUDA graph per padded batch size and sampling kind (graphs/step_graph.py
  StepGraph); on a CPU the same function runs over the static buffers.
- seq_len (S): a request's committed tokens, whose KV is written (target and draft); its newest token, at index S,
  is the model runner's last_token row and not in the KV yet. seq_lens: those of a batch.
- overlapped / synchronous: a step launched before the step in flight is read (engine/overlap.py), or run after
  it was read and read at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class StepKind(enum.Enum):
    DECODE = "decode"  # a plain (non-speculating) engine's step: one token per request
    SPEC = "spec"  # a speculative step: N drafts verified, 1 to N + 1 tokens per request
    PLAIN = "plain"  # a speculating engine's draft-free step (adaptive speculation): one token per request


@dataclass(frozen=True)
class DecodePlan:
    kind: StepKind
    overlapped: bool
    reason: str  # why it runs so (for a reader, a debugger, a test)

    def fall_back(self, reason: str) -> DecodePlan:
        """The same step, run synchronously after all."""
        return replace(self, overlapped=False, reason=reason)


def step_kind(speculating: bool, plain_chosen: bool) -> StepKind:
    """The kind of the next decode step: DECODE for a plain engine; for a speculating one SPEC, or PLAIN where
    adaptive speculation chose a plain step."""
    if not speculating:
        return StepKind.DECODE
    return StepKind.PLAIN if plain_chosen else StepKind.SPEC


def plan_decode(kind: StepKind, *, overlap: bool, batch: bool = True, spec_in_flight: bool = False,
                one_graph: bool = True, reads_hidden: bool = False, ruled: bool = False) -> DecodePlan:
    """The next decode step's plan (the module docstring's table). overlap: the overlap schedule is on (one rank);
    batch: some running request may join an overlapped launch; spec_in_flight: the step in flight is speculative;
    one_graph: the worker can launch this kind for the batch as one graph (SpecWorker.can_launch /
    can_launch_plain; not asked for DECODE); reads_hidden: a running request returns hidden states
    (graphs/step_hidden.py); ruled: a running request carries logit rules (engine/logit_rules.py)."""
    if not overlap:
        return DecodePlan(kind, False, "the overlap schedule is off")
    if ruled:
        return DecodePlan(kind, False, "a request's logit rules are made from every token read, phase by phase")
    if reads_hidden:
        return DecodePlan(kind, False, "a request returns hidden states: each step is read before the next")
    if kind is StepKind.DECODE:
        return DecodePlan(kind, True, "a decode step needs nothing the host has not read")
    if not batch:
        return DecodePlan(kind, False, "every running request waits for the read of the step in flight")
    if kind is StepKind.PLAIN and spec_in_flight:
        return DecodePlan(kind, False, "a switch from speculative steps: a plain step needs the host's S")
    if not one_graph:
        return DecodePlan(kind, False, "the batch runs outside the one-step graphs, or the draft must catch up")
    return DecodePlan(kind, True, "the one-step graph keeps what the next step needs on the device")
