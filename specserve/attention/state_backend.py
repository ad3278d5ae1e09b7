"""The recurrent-state backend (DESIGN §2, §3): the metadata a linear-attention layer needs to find its state.

Per forward, for each request of the batch: its state row (gathered on the device from the page-table row through
`StatePool.row_state`) and the slot its step starts from (the row's current slot). The slot a token's state is
written to follows from the mode: in fixed-width modes (decode, verify) token i of a request writes slot i, so
after verify slot i holds the state after verified position i and the accept commit makes slot accept_len current;
a prefill chunk continues from the current slot and writes its final state back into it. Padded graph rows use
page-table row 0, hence state row 0 (the dummy) and its slot.

Like the MHA backends, each runner owns its instance and its graph buffers (a draft runner never writes a target
runner's metadata), built eagerly from the batch or, for graphs, with device ops only into those buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.batch import CacheKind, ForwardBatch
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.kvcache.state_pool import StatePool


@dataclass
class StateMeta:
    state_rows: torch.Tensor  # [bs] int64 state row of each request
    start_slots: torch.Tensor  # [bs] int64 the slot each request's step reads its state from
    width: int | None  # tokens per request in fixed-width modes (token i writes slot i); None: a prefill batch


class RecurrentStateBackend:
    kind = CacheKind.RECURRENT
    captures_varlen = True

    def __init__(self, req_to_token: ReqToTokenPool, pool: StatePool):
        self.req_to_token = req_to_token
        self.pool = pool
        self.graph_buffers: dict[str, torch.Tensor] = {}
        self.meta: StateMeta | None = None

    def _gather(self, rows: torch.Tensor, out_rows: torch.Tensor | None = None,
                out_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        state_rows = self.pool.row_state[rows]  # [bs]
        slots = self.pool.current[state_rows]  # [bs]
        if out_rows is None:
            return state_rows, slots
        out_rows.copy_(state_rows)
        out_slots.copy_(slots)
        return out_rows, out_slots

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.meta = StateMeta(*self._gather(fb.req_pool_indices), fb.width)

    def alloc_graph_buffers(self, max_bs: int, width: int, max_seq_len: int) -> None:
        dev = self.pool.current.device
        self.graph_buffers = {"state_rows": torch.zeros(max_bs, dtype=torch.int64, device=dev),
                              "start_slots": torch.zeros(max_bs, dtype=torch.int64, device=dev)}

    def alloc_varlen_graph_buffers(self, max_rows: int) -> None:
        self.alloc_graph_buffers(max_rows, 0, 0)

    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        rows, slots = self._gather(fb.req_pool_indices, self.graph_buffers["state_rows"][:bs],
                                   self.graph_buffers["start_slots"][:bs])
        self.meta = StateMeta(rows, slots, fb.width)
