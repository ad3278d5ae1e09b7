"""The draft's per-row device state, carried between steps with no host round trip, and the draft-token choice.

`DraftState` holds, per page-table row: d1 (the draft token the next step starts from), the draft hidden state that
chains into d2, with context lookup the row's token history, and with sampled drafting the distribution d1 was drawn
from. `DraftChooser` turns draft hidden states into draft tokens: the head's greedy token, or the context lookup's
continuation (speculative/ngram.py); for sampled rows under `--speculative-draft-sampling sample`, a token drawn
from the head's own distribution over its DRAFT_CANDIDATES most likely tokens (the row's temperature, top-k, top-p
and min-p applied among them). Any draft distribution keeps verification exact as long as it is the one the draft
was drawn from; keeping it to a few candidates makes drawing, storing and verifying it cheap (no pass over the
vocabulary but the head's own top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.availability import triton_kernels
from specserve.kernels.noise import SALT_DRAFT
from specserve.layers.sampler import SamplingBatch, filter_sorted, sample_from_probs
from specserve.speculative.accept import one_hot_dist
from specserve.speculative.ngram import history_tail, lookup_drafts

DRAFT_CANDIDATES = 32  # candidate tokens of a sampled draft's distribution (fewer when the draft vocabulary is)


@dataclass
class DraftState:
    draft_token: torch.Tensor  # [rows] d1 for the next spec step
    draft_hidden: torch.Tensor  # [rows, H] the draft hidden state that chains into d2
    tokens: torch.Tensor | None = None  # [rows, row width + 1] token history (context lookup drafting only)
    # sampled drafting only: the distribution d1 was drawn from, as K candidate ids [rows, K] and probabilities
    # [rows, K] float32 (one-hot for a deterministic d1). Read by sampled rows only: greedy rows accept exactly when
    # d1 is the argmax whatever q says, so batches of greedy rows need not keep it.
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None

    @staticmethod
    def allocate(rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 history_width: int | None, candidates: int | None = None) -> DraftState:
        """history_width: columns of the token history (None: context lookup off); candidates: K of a sampled
        draft's distribution (None: drafts are deterministic)."""
        k = candidates or 0
        return DraftState(
            draft_token=torch.zeros(rows, dtype=torch.int64, device=device),
            draft_hidden=torch.zeros((rows, hidden_size), dtype=dtype, device=device),
            tokens=(None if history_width is None
                    else torch.full((rows, history_width), -1, dtype=torch.int64, device=device)),
            q_ids=torch.zeros((rows, k), dtype=torch.int64, device=device) if k else None,
            q_probs=torch.zeros((rows, k), dtype=torch.float32, device=device) if k else None,
        )

    @property
    def sampled_drafting(self) -> bool:
        return self.q_ids is not None

    def set_d1(self, rows: torch.Tensor, tokens: torch.Tensor,
               dist: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """d1 of rows [B] and, with sampled drafting, its distribution (ids, probs [B, K]; None: one-hot)."""
        self.draft_token[rows] = tokens
        if self.q_ids is not None:
            ids, probs = dist if dist is not None else one_hot_dist(tokens, self.q_ids.shape[1])
            self.q_ids[rows] = ids
            self.q_probs[rows] = probs


@dataclass
class DraftChooser:
    """The draft model's token choice, with the token history of context lookup when it is on."""

    model: torch.nn.Module
    token_history: torch.Tensor | None = None  # [rows, W] (DraftState.tokens)
    lookup_confidence: float = 0.5
    candidates: int = DRAFT_CANDIDATES  # K of a sampled draft's distribution

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

    def sample_drafts(self, hidden: torch.Tensor, hist: torch.Tensor | None, last: torch.Tensor,
                      sampling: SamplingBatch, positions: torch.Tensor,
                      pattern: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Draft tokens drawn from the head's own distribution for hidden [B, H] -> (tokens [B], (ids, probs)
        [B, K]: the distribution each was drawn from).

        The distribution is the head's K most likely tokens under each row's temperature, top-k, top-p and min-p
        (candidate_probs; one-hot at the argmax for greedy rows); the token at sequence index positions [B] is drawn
        with its own noise (SALT_DRAFT). With context lookup, a row whose continuation wins (the same test as
        draft_tokens: the head's top probability below the confidence) takes it with a one-hot distribution."""
        vals, ids, lse = self.model.draft_candidates(hidden, self.candidates)  # [B, K] descending, [B]
        tokens, q = draw_candidate(vals, ids, sampling, positions)  # [B], [B, K]
        if hist is None:
            return tokens, (ids, q)
        conf = torch.exp(vals[:, 0] - lse)  # the head's top probability, as draft_tokens uses
        pattern = pattern if pattern is not None else history_tail(hist, last)
        cont = lookup_drafts(hist, last, *pattern, torch.full_like(tokens, -1), conf, self.lookup_confidence)
        chosen = cont >= 0  # [B] the continuation won
        tokens = torch.where(chosen, cont, tokens)
        oh_ids, oh_probs = one_hot_dist(tokens, ids.shape[1])
        return tokens, (torch.where(chosen[:, None], oh_ids, ids), torch.where(chosen[:, None], oh_probs, q))


def draw_candidate(vals: torch.Tensor, ids: torch.Tensor, sampling: SamplingBatch,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled draft from its K candidates: vals [B, K] the head's candidate logits (descending), ids [B, K] ->
    (tokens [B], q [B, K] = candidate_probs) drawn with SALT_DRAFT's noise at positions [B]: one Triton launch on
    CUDA (kernels/triton_candidates.py), the torch reference otherwise."""
    if vals.is_cuda and (tk := triton_kernels()) is not None:
        tokens, q, _ = tk.sample_candidates_triton(vals, ids, sampling.temperature, sampling.greedy, sampling.top_k,
                                                   sampling.top_p, sampling.min_p, sampling.seeds, positions,
                                                   SALT_DRAFT)
        return tokens, q
    q = candidate_probs(vals, sampling)  # [B, K]
    return ids.gather(1, sample_from_probs(q, sampling.seeds, positions, SALT_DRAFT)[:, None]).squeeze(1), q


def candidate_probs(vals: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """A sampled draft's distribution over its K candidates: vals [B, K] the head's candidate logits in descending
    order -> probs [B, K] summing to 1: softmax at the row's temperature, then the row's top-k, top-p and min-p
    among the candidates (layers/sampler.py filter_sorted, the sampler's own rule); one-hot at candidate 0 for
    greedy rows."""
    temp = torch.where(sampling.greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    p = filter_sorted(torch.softmax(vals / temp[:, None], dim=-1), sampling)  # [B, K], descending like vals
    p = p / p.sum(dim=-1, keepdim=True)
    first = torch.zeros_like(p)
    first[:, 0] = 1.0
    return torch.where(sampling.greedy[:, None], first, p)
