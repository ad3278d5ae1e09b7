"""The host side of returning hidden states (`--enable-return-hidden-states`, SGLang's `return_hidden_states`): a
request's final-norm hidden state at every position the target ran, kept by position and answered in SGLang's
shape.

Positions are those the target ran for the request: the prompt's (prefill), then one per decode or plain step, and
1 to N + 1 per speculative step (the accepted ones only: a rejected draft's position is never kept). A retracted
request is prefilled again over its prompt and outputs, which overwrites the positions it had. The answer covers the
prompt and every output token but the last, which no forward has read: as SGLang, `[prompt [P, H]]` followed by one
`[H]` per later position, so that concatenated they are the hidden states of `prompt + output_ids[:-1]`.
"""

from __future__ import annotations

import torch

from specserve.engine.request import Req


def record_hidden(req: Req, start: int, rows: torch.Tensor) -> None:
    """Keep rows [k, H] (host, float32) as the request's hidden states at positions start .. start + k - 1."""
    kept = req.hidden_states
    if start > len(kept):
        raise AssertionError(f"hidden states of {req.rid} skip positions {len(kept)}..{start - 1}")
    for i, row in enumerate(rows.unbind(0)):
        if start + i < len(kept):
            kept[start + i] = row
        else:
            kept.append(row)


def hidden_states_output(req: Req) -> list:
    """SGLang's meta_info.hidden_states: [prompt positions [P, H]] + one [H] per output token but the last."""
    prompt = len(req.origin_input_ids)
    kept = req.hidden_states[:prompt + max(len(req.output_ids) - 1, 0)]
    if not kept:
        return []
    return [torch.stack(kept[:prompt]).tolist()] + [row.tolist() for row in kept[prompt:]]
