"""Recurrent state of the linear-attention layers, row-indexed (docs/architecture.md).

Each running request owns one state row with `slots_per_row` = N + 1 slots (N = draft steps; 1 without
speculation). Target verify writes the state after verified position i into slot i; the accept commit records the
slot of the last accepted token as the row's current slot (`commit`), and the next step (decode, verify or a
prefill chunk) starts from it. No rollback pass, no copy. Row 0 is the reserved dummy that padded graph rows read
and write; it is never handed out. A row is zeroed when it is handed out (a new request starts from the zero
state) and returned when its request finishes, is aborted or is retracted (kvcache/manager.py).

Forward batches name requests by page-table row; `row_state[page-table row]` is the request's state row (0 for the
dummy row and for rows without a request), kept on the device so graph metadata can gather it.
"""

from __future__ import annotations

import torch

from specserve.kvcache.cache_spec import RecurrentStateSpec


class StatePool:
    def __init__(self, specs: list[RecurrentStateSpec], max_rows: int, slots_per_row: int, device: torch.device,
                 table_rows: int | None = None):
        """max_rows: state rows (running requests); table_rows: page-table rows that can be bound to one
        (default max_rows + 1)."""
        if not specs:
            raise ValueError("a state pool needs at least one recurrent layer")
        kinds = {(s.conv_shape, s.ssm_shape, s.conv_dtype, s.ssm_dtype) for s in specs}
        if len(kinds) != 1:
            raise ValueError("recurrent layers of one model must share state shapes and dtypes")
        spec = specs[0]
        self.num_layers = len(specs)
        self.max_rows = max_rows
        self.slots_per_row = slots_per_row
        rows = max_rows + 1  # + dummy row 0
        # one tensor per state kind for all layers, so handing out a row zeroes it in two ops
        self.conv = torch.zeros((self.num_layers, rows, slots_per_row, *spec.conv_shape), dtype=spec.conv_dtype,
                                device=device)  # [L, rows, S, *conv]
        self.ssm = torch.zeros((self.num_layers, rows, slots_per_row, *spec.ssm_shape), dtype=spec.ssm_dtype,
                               device=device)  # [L, rows, S, *ssm]
        self.current = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows] slot of the committed state
        self.row_state = torch.zeros(table_rows or rows, dtype=torch.int64, device=device)  # [page-table rows]
        self._free: list[int] = list(range(max_rows, 0, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A zeroed state row whose current slot is 0, or None when all are taken."""
        if not self._free:
            return None
        row = self._free.pop()
        self.reset(row)
        return row

    def reset(self, row: int) -> None:
        """Zero state row `row` and make slot 0 current (alloc's; a tensor-parallel follower mirrors rank 0's
        allocation with it, engine/tp_ranks.py)."""
        self.conv[:, row].zero_()
        self.ssm[:, row].zero_()
        self.current[row] = 0

    def free(self, row: int) -> None:
        if not 0 < row <= self.max_rows:
            raise ValueError(f"state row {row} is not a row of this pool (1..{self.max_rows})")
        if row in self._free:
            raise ValueError(f"state row {row} freed twice")
        self._free.append(row)

    def bind(self, table_row: int, state_row: int) -> None:
        """Page-table row `table_row` now belongs to the request holding `state_row` (0: to nobody)."""
        self.row_state[table_row] = state_row

    def commit(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Make slot `slots[b]` the current state of row `rows[b]` (device op, capturable). rows, slots [bs]."""
        self.current[rows] = slots

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (conv [rows, S, *conv], ssm [rows, S, *ssm]) views (i: the layer's recurrent cache index)."""
        return self.conv[i], self.ssm[i]

    def flat_slots(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Index of (row, slot) in a layer's state viewed as [rows * S, ...]. rows, slots [...] -> [...]."""
        return rows * self.slots_per_row + slots

    def bytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()) + (self.ssm.numel() * self.ssm.element_size())
