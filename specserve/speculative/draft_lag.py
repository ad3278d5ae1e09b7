"""The draft's lag behind the target after plain steps (adaptive speculation, engine/adaptive_spec.py).

A speculating engine's plain step runs the target alone: no draft forward, so it costs what a plain engine's step
costs. The draft falls behind by one position per plain step. `DraftLag` keeps, per page-table row, what the
draft's extend at each such position needs (the target's features there and the token that followed) and how many
positions are pending. Before the next speculative step the worker extends the draft over them all in one prefill
forward (`SpecWorker.catch_up`), which leaves the draft KV, d1 and the draft hidden state exactly as a plain step
that ran the draft each time would have: the same forward over the same inputs, batched.

Device side (graph-safe, no host read, no counter): the position at sequence index p goes to column p % C, so a
row's pending positions S-L..S-1 (L <= C) never overwrite each other; padded graph rows (row 0) write their own
columns of the dummy row. Host side: `pending` counts each live row's positions, so the worker knows when and over
what to catch up without a sync; a prefill that gives a row a new sequence starts its count over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# positions a row may lag; a row that reaches it catches up before its next plain step. Adaptive speculation's
# longest probe period is this long, so a settled run of plain steps catches up once a period, at its probe.
LAG_CAPACITY = 128


@dataclass
class DraftLag:
    hidden: torch.Tensor  # [rows, C, F] the target's features at pending positions (column = sequence index % C)
    tokens: torch.Tensor  # [rows, C] the token after each pending position (the draft's input there)
    pending: dict[int, int] = field(default_factory=dict)  # row -> pending positions (host, live rows)

    @staticmethod
    def allocate(rows: int, feature_size: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = LAG_CAPACITY) -> DraftLag:
        return DraftLag(hidden=torch.zeros((rows, capacity, feature_size), dtype=dtype, device=device),
                        tokens=torch.zeros((rows, capacity), dtype=torch.int64, device=device))

    @staticmethod
    def bytes_per_row(feature_size: int, dtype: torch.dtype, capacity: int = LAG_CAPACITY) -> int:
        """Device bytes `allocate` takes per row (the engine counts them in its memory budget)."""
        return capacity * (feature_size * dtype.itemsize + torch.int64.itemsize)

    @property
    def capacity(self) -> int:
        return self.tokens.shape[1]

    def record(self, rows: torch.Tensor, s: torch.Tensor, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """A plain step over sequence index s [bs] of rows [bs]: the target's features there hidden [bs, F] and the
        sampled token tokens [bs]. Device only (inside the plain step's graph)."""
        col = s % self.capacity  # [bs]
        self.hidden[rows, col] = hidden.to(self.hidden.dtype)
        self.tokens[rows, col] = tokens

    def advance(self, rows: list[int]) -> None:
        """The host count of `record` for the live rows of a plain step."""
        for r in rows:
            self.pending[r] = self.pending.get(r, 0) + 1

    def lagging(self, rows: list[int]) -> list[int]:
        """Indices into rows of those with pending positions."""
        if not self.pending:  # the common case while speculating: nothing lags
            return []
        return [i for i, r in enumerate(rows) if self.pending.get(r, 0)]

    def full(self, rows: list[int]) -> bool:
        """Whether a row would overflow on one more plain step."""
        return bool(self.pending) and any(self.pending.get(r, 0) >= self.capacity for r in rows)

    def clear(self, rows: list[int]) -> None:
        """Rows caught up, or given a new sequence by a prefill: nothing pending."""
        if self.pending:
            for r in rows:
                self.pending.pop(r, None)
