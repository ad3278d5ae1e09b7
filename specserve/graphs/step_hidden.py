"""The target's hidden states at the positions a decode step ran, kept per page-table row for requests that return
them (`--enable-return-hidden-states`, SGLang's `return_hidden_states`).

A decode step's hidden states live in graph memory and are gone at the next replay, so the step itself (its graph
included) copies the final-norm hidden state of every position it ran into this buffer, row by row; the host reads
the rows of the requests that asked once the step is read. The buffer exists only when the flag is on, so an engine
without it captures exactly the graphs it did before. While a request that returns hidden states runs, every
decode step is synchronous (engine/decode_plan.py): no later step can overwrite the buffer before it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepHidden:
    buf: torch.Tensor  # [rows, width, H]: width = N + 1 for a speculating engine, 1 for a plain one

    @staticmethod
    def allocate(rows: int, width: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> StepHidden:
        return StepHidden(torch.zeros(rows, width, hidden_size, dtype=dtype, device=device))

    def write(self, rows: torch.Tensor, hidden: torch.Tensor) -> None:
        """rows [bs]; hidden [bs, w, F] (or [bs, F] for w = 1) of a step's target forward, whose first H features
        are the final-norm hidden state (models/base.py CausalLM.forward). No host sync: runs inside graphs."""
        if hidden.dim() == 2:
            hidden = hidden[:, None]
        self.buf[rows, :hidden.shape[1]] = hidden[..., :self.buf.shape[-1]].to(self.buf.dtype)

    def read(self, row: int, count: int) -> torch.Tensor:
        """The first `count` positions of a row, on the host in float32 -> [count, H] (a copy: on a CPU too, where
        the next step writes the same memory)."""
        return self.buf[row, :count].to("cpu", torch.float32, copy=True)
