"""The speculative decode step (DESIGN §1) for the whole running batch, host side:

    draft decode (N-1 steps, one graph) -> target verify (N+1 tokens, one graph) -> accept (device, no sync)
    -> draft extend (fixed width N+1, one graph) -> one host sync to read the accepted tokens.

Greedy batches that fit the captured sizes run all of it as one graph (spec_step.SpecStepRunner); other batches
(sampling, or larger than the graphs) run the phases' own graphs with the glue in between (spec_step_device).
State between steps lives in per-row device tensors (last token, d1, draft hidden), so a step uploads only the
request rows, sequence lengths and rope positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.steps import rope_offsets, sampling_batch
from specserve.spec.spec_step import spec_step_device


@dataclass
class SpecStepResult:
    accept_len: list[int]  # accepted drafts per request (0..N)
    tokens: list[list[int]]  # the accept_len + 1 new tokens per request


@torch.inference_mode()
def run_spec_step(mr: ModelRunner, reqs: list[Req]) -> SpecStepResult:
    dev = mr.device
    rows_host = [r.kv.row for r in reqs]
    s_host = [r.seq_len for r in reqs]
    sb = sampling_batch(mr, reqs)
    one_graph = mr.spec_step
    if sb.all_greedy and one_graph is not None and one_graph.covers(len(reqs)):
        out = one_graph.run(rows_host, s_host, [r.seq_len + r.mrope_delta for r in reqs])
    else:
        rows = torch.tensor(rows_host, dtype=torch.int64).to(dev, non_blocking=True)
        s = torch.tensor(s_host, dtype=torch.int64).to(dev, non_blocking=True)  # [bs] = S
        pos0 = s + rope_offsets(reqs, dev)  # rope position of sequence index S
        accept_len, verified = spec_step_device(mr, lambda name, live: mr.runners[name].run(live), rows, s, pos0,
                                                max(s_host), sb)
        out = torch.cat((accept_len[:, None], verified), dim=1)
    # the one host sync of the step: accept lengths and verified tokens in one copy
    res = out.tolist()  # [bs, 1 + N + 1]
    return SpecStepResult([r[0] for r in res], [r[1:r[0] + 2] for r in res])
