"""The page table: req_to_token[req_row, position] -> KV slot, shared by target and draft (docs/architecture.md)."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Rows of slot indices. Row 0 is the reserved dummy row (all zeros -> dummy slot 0) used by padded graph rows."""

    def __init__(self, max_reqs: int, width: int, device: torch.device):
        self.max_reqs = max_reqs
        self.width = width  # max_context + N + 1 (+ page rounding)
        self.table = torch.zeros((max_reqs + 1, width), dtype=torch.int64, device=device)  # [rows, width]
        self._free_rows: list[int] = list(range(max_reqs, 0, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        # Zero the row so a stale row can never point at slots now owned by someone else.
        self.table[row].zero_()
        self._free_rows.append(row)
