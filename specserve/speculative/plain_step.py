"""A speculating engine's plain step (adaptive speculation, engine/adaptive_spec.py): one token per request from the
target alone, no draft forward.

The step is the target's verify pass at width 1 over the last token (PlainVerifyRunner: it keeps the features the
draft needs), then the token plain decoding samples (the same noise, so a plain step is lossless by construction).
The draft lags one position per plain step: the target's features there and the sampled token are kept for the
worker's catch-up (speculative/draft_lag.py). As lean as a plain engine's decode step (graphs/step_graph.py
DecodeStepGraph) plus the lag's two writes, the token history and the recurrent commit where they exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.graphs.padding import LiveInputs
from specserve.graphs.phase_runners import PhaseCall, PlainVerifyRunner, inline_phase
from specserve.graphs.step_graph import StepGraph
from specserve.graphs.step_hidden import StepHidden
from specserve.kvcache.state_pool import StatePool
from specserve.layers.sampler import GREEDY, SamplingBatch, sample
from specserve.speculative.draft_lag import DraftLag
from specserve.speculative.draft_state import DraftState
from specserve.speculative.spec_step import LogitAdjust


@dataclass
class PlainStepContext:
    """What a plain step reads and writes: the worker's row state (token history), the target's last tokens and
    recurrent state, the target's width-1 verify runner, and the draft's lag."""

    state: DraftState
    last_token: torch.Tensor  # [rows]
    target_state: StatePool | None
    plain_verify: PlainVerifyRunner
    lag: DraftLag
    step_hidden: StepHidden | None = None  # where the step's hidden states are kept (--enable-return-hidden-states)


def plain_step_device(ctx: PlainStepContext, call: PhaseCall, rows: torch.Tensor, seq_lens: torch.Tensor,
                      pos0: torch.Tensor, max_seq_len: int, sampling: SamplingBatch,
                      adjust: LogitAdjust | None = None) -> torch.Tensor:
    """The plain step for page-table rows [bs] of committed length S = seq_lens [bs] (pos0 [bs]: the rope position
    of index S) -> tokens [bs] at index S + 1. No host sync, but for the logit rules' (adjust: outside graphs)."""
    out = call(ctx.plain_verify, LiveInputs(rows.shape[0], ctx.last_token[rows], pos0, rows, seq_lens + 1,
                                            max_seq_len + 1))
    if ctx.step_hidden is not None:
        ctx.step_hidden.write(rows, out["hidden"])
    logits = out["logits"] if adjust is None else adjust(out["logits"])  # [bs, 1, V]
    tokens = sample(logits[:, 0], sampling, seq_lens + 1, masked=adjust is not None)  # [bs]
    ctx.last_token[rows] = tokens
    if ctx.target_state is not None:  # the state after S (the verify pass's slot 0) is current
        ctx.target_state.commit(ctx.target_state.row_state[rows], torch.zeros_like(rows))
    if ctx.state.tokens is not None:  # context lookup's token history
        ctx.state.tokens[rows, seq_lens + 1] = tokens
    ctx.lag.record(rows, seq_lens, out["hidden"][:, 0], tokens)
    return tokens


class PlainStepGraph(StepGraph):
    """The plain step (plain_step_device) as one graph per captured batch size and sampling kind -> tokens [pbs]."""

    name = "plain_step"

    def __init__(self, ctx: PlainStepContext, capture_bs: list[int], use_graphs: bool):
        runner_ctx = ctx.plain_verify.ctx
        super().__init__(capture_bs, use_graphs, runner_ctx.device, runner_ctx.model.config.vocab_size,
                         runner_ctx.graph_max_seq_len, 1)
        self.ctx = ctx

    def forward(self, inputs: torch.Tensor, max_seq_len: int, sampling: SamplingBatch = GREEDY) -> torch.Tensor:
        return plain_step_device(self.ctx, inline_phase, inputs[0], inputs[1], inputs[2], max_seq_len, sampling)
