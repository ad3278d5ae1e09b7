"""The draft's per-row device state, carried between steps with no host round trip, and the draft-token choice.

`DraftState` holds, per page-table row: d1 (the draft token the next step starts from), the draft hidden state that
chains into d2, with context lookup the row's token history, and with sampled drafting the distribution d1 was drawn
from. `DraftChooser` turns draft hidden states into draft tokens: the head's greedy token, or the context lookup's
continuation (speculative/ngram.py); for sampled rows under `--speculative-draft-sampling sample`, a token drawn
from the head's own distribution (the row's temperature and filters applied to the head's logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.noise import SALT_DRAFT
from specserve.layers.sampler import SamplingBatch, probs_from_logits, sample_from_probs
from specserve.speculative.accept import one_hot_probs
from specserve.speculative.ngram import history_tail, lookup_drafts


@dataclass
class DraftState:
    draft_token: torch.Tensor  # [rows] d1 for the next spec step
    draft_hidden: torch.Tensor  # [rows, H] the draft hidden state that chains into d2
    tokens: torch.Tensor | None = None  # [rows, row width + 1] token history (context lookup drafting only)
    # [rows, V] float32: the distribution d1 was drawn from (sampled drafting only; one-hot for a deterministic d1).
    # Read by sampled rows only: greedy rows accept exactly when d1 is the argmax whatever q says, so batches of
    # greedy rows need not keep it.
    draft_probs: torch.Tensor | None = None

    @staticmethod
    def allocate(rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 history_width: int | None, vocab_size: int | None = None) -> DraftState:
        """history_width: columns of the token history (None: context lookup off); vocab_size: the target's
        vocabulary when drafts may be sampled (None: drafts are deterministic)."""
        return DraftState(
            draft_token=torch.zeros(rows, dtype=torch.int64, device=device),
            draft_hidden=torch.zeros((rows, hidden_size), dtype=dtype, device=device),
            tokens=(None if history_width is None
                    else torch.full((rows, history_width), -1, dtype=torch.int64, device=device)),
            draft_probs=(None if vocab_size is None
                         else torch.zeros((rows, vocab_size), dtype=torch.float32, device=device)),
        )

    def set_d1(self, rows: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor | None) -> None:
        """d1 of rows [B] and, with sampled drafting, its distribution (probs [B, V]; None: one-hot)."""
        self.draft_token[rows] = tokens
        if self.draft_probs is not None:
            self.draft_probs[rows] = probs if probs is not None else one_hot_probs(tokens, self.draft_probs.shape[1])


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

    def sample_drafts(self, hidden: torch.Tensor, hist: torch.Tensor | None, last: torch.Tensor, sb: SamplingBatch,
                      positions: torch.Tensor, pattern: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens drawn from the head's own distribution for hidden [B, H] -> (tokens [B], q [B, V]).

        q is the head's logits (over the target vocabulary) under each row's temperature, top-k, top-p and min-p
        (sb), one-hot at the argmax for greedy rows; the token at sequence index positions [B] is drawn from q with
        its own noise (SALT_DRAFT). With context lookup, a row whose continuation wins (the same test as
        draft_tokens: the head's top probability below the confidence) takes it with a one-hot q."""
        logits = self.model.draft_logits(hidden)  # [B, V] float32
        q = probs_from_logits(logits, sb)  # [B, V]
        tokens = sample_from_probs(q, sb.seeds, positions, SALT_DRAFT)
        if hist is None:
            return tokens, q
        conf = torch.softmax(logits, dim=-1).amax(dim=-1)  # the head's top probability, as draft_tokens uses
        pattern = pattern if pattern is not None else history_tail(hist, last)
        cont = lookup_drafts(hist, last, *pattern, torch.full_like(tokens, -1), conf, self.lookup_confidence)
        chosen = cont >= 0  # [B] the continuation won
        tokens = torch.where(chosen, cont, tokens)
        q = torch.where(chosen[:, None], one_hot_probs(cont.clamp(min=0), q.shape[1]), q)
        return tokens, q
