"""The reduced draft vocabulary: the Vd tokens the target generates most often (+ EOS and special tokens).

A smaller draft head makes every draft step cheaper (the lm-head GEMM dominates a one-layer drafter); tokens outside
it can never be drafted, so the coverage (share of target-generated tokens inside it) bounds the acceptance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class DraftVocab:
    ids: torch.Tensor | None  # [Vd] int64 target token ids, ascending; None = the full target vocabulary
    size: int
    coverage: float  # fraction of target-generated tokens inside the draft vocabulary

    def to_draft_index(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] int64 map target id -> draft index (-1 outside the draft vocabulary)."""
        if self.ids is None:
            return torch.arange(vocab_size, dtype=torch.int64, device=device)
        m = torch.full((vocab_size,), -1, dtype=torch.int64, device=device)
        m[self.ids.to(device)] = torch.arange(self.size, dtype=torch.int64, device=device)
        return m


def build_draft_vocab(responses: Iterable[list[int]], prompts: Iterable[list[int]], vocab_size: int, size: int,
                      forced: Iterable[int]) -> DraftVocab:
    """Choose `size` ids: forced ones (EOS, specials) first, then by count in the responses; prompt counts break
    ties (and fill the vocabulary when the responses use fewer distinct tokens), then the lower id."""
    resp = token_counts(responses, vocab_size)
    if size <= 0 or size >= vocab_size:
        return DraftVocab(None, vocab_size, 1.0)
    prm = token_counts(prompts, vocab_size)
    forced_ids = sorted({int(t) for t in forced if 0 <= int(t) < vocab_size})
    if len(forced_ids) > size:
        raise ValueError(f"--draft-vocab-size {size} cannot hold the {len(forced_ids)} special tokens")
    # lexicographic (response count, prompt count, -id) as one float64-safe score
    score = resp.double() * (prm.max().double() + 1) + prm.double()
    score[forced_ids] = float("inf")
    order = torch.sort(score, descending=True, stable=True).indices  # stable: ties keep the lower id first
    ids = torch.sort(order[:size]).values
    return DraftVocab(ids, size, _coverage(resp, ids))


def token_counts(seqs: Iterable[list[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in seqs -> [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        if s:
            counts += torch.bincount(torch.tensor(s, dtype=torch.int64), minlength=vocab_size)
    return counts


def _coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of the counted tokens that fall inside `ids`."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def vocab_of_checkpoint(folder: str, responses: Iterable[list[int]], vocab_size: int) -> DraftVocab | None:
    """The draft vocabulary stored in a draft checkpoint folder (None when it uses the full vocabulary), with its
    coverage of `responses`: a head continued with --init-draft keeps the vocabulary it was trained with."""
    import os

    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        if "draft_vocab" not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            return None
        ids = f.get_tensor("draft_vocab").to(torch.int64)
    return DraftVocab(ids, int(ids.numel()), _coverage(token_counts(responses, vocab_size), ids))
