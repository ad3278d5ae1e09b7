"""The speculative decode step (DESIGN §1), for the whole running batch:

    draft decode (N-1 steps, one graph) -> target verify (N+1 tokens, one graph) -> accept (device, no sync)
    -> draft extend (fixed width N+1, one graph) -> one host sync to read the accepted tokens.

State between steps lives in per-row device tensors (last token, d1, draft hidden), so a step uploads only the
request rows and sequence lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.model_runner import ModelRunner
from specserve.engine.padding import LiveInputs
from specserve.engine.request import Req
from specserve.engine.sampler import probs_from_logits
from specserve.engine.steps import rope_offsets, sampling_batch
from specserve.spec.accept import verify_greedy, verify_sampling


@dataclass
class SpecStepResult:
    accept_len: list[int]  # accepted drafts per request (0..N)
    tokens: list[list[int]]  # the accept_len + 1 new tokens per request


@torch.inference_mode()
def run_spec_step(mr: ModelRunner, reqs: list[Req]) -> SpecStepResult:
    n = mr.num_steps
    dev = mr.device
    bs = len(reqs)
    rows = torch.tensor([r.kv.row for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
    s_host = [r.seq_len for r in reqs]
    s = torch.tensor(s_host, dtype=torch.int64).to(dev, non_blocking=True)  # [bs] = S
    pos0 = s + rope_offsets(reqs, dev)  # rope position of sequence index S
    max_s = max(s_host)
    row_state = mr.rows

    # 1. draft decode: d2..dN from (g, d1) at sequence indices S .. S+N-2
    d1 = row_state.draft_token[rows]  # [bs]
    if n > 1:
        live = LiveInputs(bs, d1, pos0, rows, s + 1, max_s + n - 1, hidden=row_state.draft_hidden[rows])
        more = mr.runners["draft_decode"].run(live)["tokens"]  # [bs, N-1]
        drafts = torch.cat((d1[:, None], more), dim=1)  # [bs, N]
    else:
        drafts = d1[:, None]

    # 2. target verify over [last, d1..dN] at sequence indices S..S+N
    w = n + 1
    offs = torch.arange(w, device=dev)
    verify_ids = torch.cat((row_state.last_token[rows][:, None], drafts), dim=1).reshape(-1)  # [bs * w]
    verify_pos = (pos0[:, None] + offs[None, :]).reshape(-1)
    live = LiveInputs(bs, verify_ids, verify_pos, rows, s + w, max_s + w)
    out = mr.runners["target_verify"].run(live)
    logits, hidden = out["logits"], out["hidden"]  # [bs, w, V], [bs, w, H]

    # 3. accept
    sb = sampling_batch(mr, reqs)
    if sb.all_greedy:
        accept_len, verified = verify_greedy(drafts, logits)
    else:
        probs = probs_from_logits(logits.reshape(bs * w, -1), sb.repeat(w)).view(bs, w, -1)
        accept_len, verified = verify_sampling(drafts, probs, sb.seeds, s)

    if row_state.tokens is not None:  # token history for context lookup: verified tokens at S+1..S+N+1
        row_state.tokens[rows[:, None], s[:, None] + 1 + offs[None, :]] = verified

    # 4. draft extend over the same N+1 positions with the verified tokens, row accept_len -> next d1, g
    live = LiveInputs(bs, verified.reshape(-1), verify_pos, rows, s + w, max_s + w, accept_len=accept_len,
                      hidden=hidden.reshape(bs * w, -1))
    ext = mr.runners["draft_extend"].run(live)
    row_state.draft_token[rows] = ext["tokens"]
    row_state.draft_hidden[rows] = ext["hidden"].to(row_state.draft_hidden.dtype)
    ar = torch.arange(bs, device=dev)
    row_state.last_token[rows] = verified[ar, accept_len]

    # 5. the one host sync of the step: accept lengths and verified tokens in one copy
    rows_host = torch.cat((accept_len[:, None], verified), dim=1).tolist()  # [bs, 1 + N + 1]
    return SpecStepResult([r[0] for r in rows_host], [r[1:r[0] + 2] for r in rows_host])
