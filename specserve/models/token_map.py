"""--speculative-token-map: a file of "hot" target token ids the MTP draft may propose (FR-Spec style). The draft's
head becomes those rows of its lm-head (models/mtp.py `restrict_vocab`), so every draft step reads Vd x H head
weights instead of V x H; the target still verifies every token, so the output is unchanged (greedy and sampled
alike: a sampled draft's distribution is zero outside the map, which the rejection rule allows). What it costs is
acceptance: a token outside the map can never be drafted.

Formats: `.pt` (a 1-D integer tensor or a list of ints, read with torch.load(weights_only=True): the format of
FR-Spec's published maps and of SGLang's flag) or `.json` (a list of ints). `specserve token-map` writes one from
text the target generates.
"""

from __future__ import annotations

import json
import os
import pickle

import torch


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The token ids of a token-map file -> [Vd] int64, ascending (ties of the reduced head's argmax then go to
    the lower target id, as over the full vocabulary). Raises ValueError naming the file on anything else."""
    if not os.path.isfile(path):
        raise ValueError(f"--speculative-token-map {path!r}: no such file")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".json":
            with open(path) as f:
                raw = json.load(f)
        elif ext == ".pt":
            raw = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise ValueError(f"--speculative-token-map {path!r}: expected a .pt or .json file")
    except (OSError, json.JSONDecodeError, RuntimeError, EOFError, pickle.UnpicklingError) as e:  # torch.load's too
        raise ValueError(f"--speculative-token-map {path!r}: cannot read it ({e})") from e
    return check_token_ids(raw, vocab_size, path)


def check_token_ids(raw, vocab_size: int, what: str) -> torch.Tensor:
    """A list or 1-D tensor of distinct ints in [0, vocab_size) -> [Vd] int64 ascending."""
    if isinstance(raw, torch.Tensor):
        ok = raw.dim() == 1 and not raw.is_floating_point() and not raw.is_complex() and raw.dtype != torch.bool
        ids = raw.to(torch.int64) if ok else None
    elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        ids = torch.tensor(raw, dtype=torch.int64)
    else:
        ids = None
    if ids is None:
        raise ValueError(f"--speculative-token-map {what!r}: expected a 1-D list or tensor of integer token ids")
    if ids.numel() == 0:
        raise ValueError(f"--speculative-token-map {what!r}: holds no token ids")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"--speculative-token-map {what!r}: token id {lo if lo < 0 else hi} is outside the "
                         f"target's vocabulary of {vocab_size}")
    ids = torch.sort(ids).values
    if bool((ids[1:] == ids[:-1]).any()):
        raise ValueError(f"--speculative-token-map {what!r}: token ids repeat")
    return ids
