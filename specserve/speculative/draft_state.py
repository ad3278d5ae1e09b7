"""The draft's per-row device state, carried between steps with no host round trip, and the draft-token choice.

`DraftState` holds, per page-table row: d1 (the draft token the next step starts from), the draft hidden state that
chains into d2, and with context lookup the row's token history. `DraftChooser` turns draft hidden states into
draft tokens: the head's greedy token, or the context lookup's continuation (speculative/ngram.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.speculative.ngram import history_tail, lookup_drafts


@dataclass
class DraftState:
    draft_token: torch.Tensor  # [rows] d1 for the next spec step
    draft_hidden: torch.Tensor  # [rows, H] the draft hidden state that chains into d2
    tokens: torch.Tensor | None = None  # [rows, row width + 1] token history (context lookup drafting only)

    @staticmethod
    def allocate(rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 history_width: int | None) -> DraftState:
        """history_width: columns of the token history (None: context lookup off)."""
        return DraftState(
            draft_token=torch.zeros(rows, dtype=torch.int64, device=device),
            draft_hidden=torch.zeros((rows, hidden_size), dtype=dtype, device=device),
            tokens=(None if history_width is None
                    else torch.full((rows, history_width), -1, dtype=torch.int64, device=device)),
        )


@dataclass
class DraftChooser:
    """The draft model's token choice, with the token history of context lookup when it is on."""

    model: torch.nn.Module
    token_history: torch.Tensor | None = None  # [rows, W] (DraftState.tokens)
    lookup_confidence: float = 0.5

    def history_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The token history of page-table rows [B] -> [B, W] (None when context lookup is off)."""
        return None if self.token_history is None else self.token_history[rows]

    def draft_tokens(self, hidden: torch.Tensor, hist: torch.Tensor | None, last: torch.Tensor,
                     pattern: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The draft model's tokens for hidden [B, H]; with a token history hist [B, W] (history_rows), the
        context lookup's choice for rows whose committed tokens end at index last [B], continuing `pattern`
        (p2, p1, p0; default: the last three committed tokens)."""
        if hist is None:
            return self.model.draft_tokens(hidden)
        head, conf = self.model.draft_tokens_and_confidence(hidden)
        pattern = pattern if pattern is not None else history_tail(hist, last)
        return lookup_drafts(hist, last, *pattern, head, conf, self.lookup_confidence)
