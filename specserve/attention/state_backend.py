"""The recurrent-state backend (docs/architecture.md): the metadata a linear-attention layer needs to find its state.

Per forward, for each request of the batch: its state row (gathered on the device from the page-table row through
`StatePool.row_state`), the slot its step starts from (the row's current slot), and its tokens' range in the batch
(`starts`, `lens`). Where states are written follows from the mode: in target verify (`per_position`) token i of
a request writes slot i, so after verify slot i holds the state after verified position i and the accept commit
makes slot accept_len current; a prefill chunk and a plain decode step continue from the current slot and write
their final state back into it (a decode step of a speculative engine thus needs no commit). Padded graph rows use
page-table row 0, hence state row 0 (the dummy) and its slot; the padding request of a prefill graph too, and the
idle request slots after it have no tokens.

Like the MHA backends, each runner owns its instance and its graph buffers (a draft runner never writes a target
runner's metadata), built eagerly from the batch or, for graphs, with device ops only into those buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.batch import CacheKind, ForwardBatch, ForwardMode, extend_starts
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.kvcache.state_pool import StatePool

# the modes of a target with recurrent layers (drafts have none: speculative/worker.py refuses them)
_STATE_MODES = (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


@dataclass
class StateMeta:
    state_rows: torch.Tensor  # [bs] int64 state row of each request
    start_slots: torch.Tensor  # [bs] int64 the slot each request's step reads its state from
    starts: torch.Tensor  # [bs] int64 first token of each request in the batch
    lens: torch.Tensor  # [bs] int64 tokens of each request (0: an idle graph slot)
    per_position: bool  # token i of a request writes slot i (verify); else the final state goes to the start slot
    chunked: bool = False  # a prefill batch to run with the chunk-parallel kernels (else token by token)


class RecurrentStateBackend:
    kind = CacheKind.RECURRENT
    captures_varlen = True

    def __init__(self, req_to_token: ReqToTokenPool, pool: StatePool, chunked_prefill: bool = True):
        """chunked_prefill: prefill batches take the chunk-parallel kernels (--linear-attn-prefill chunked)."""
        self.req_to_token = req_to_token
        self.pool = pool
        self.chunked_prefill = chunked_prefill
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

    @staticmethod
    def _per_position(fb: ForwardBatch) -> bool:
        if fb.mode not in _STATE_MODES:
            raise ValueError(f"recurrent layers do not run in {fb.mode.value} batches (the MTP layer is full "
                             "attention)")
        return fb.mode is ForwardMode.TARGET_VERIFY

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        dev = fb.req_pool_indices.device
        if fb.width is not None:
            starts = torch.arange(fb.batch_size, dtype=torch.int64, device=dev) * fb.width
            lens = torch.full((fb.batch_size,), fb.width, dtype=torch.int64, device=dev)
        else:
            starts = torch.tensor(extend_starts(fb.extend_lens_cpu), dtype=torch.int64, device=dev)
            lens = torch.tensor(fb.extend_lens_cpu, dtype=torch.int64, device=dev)
        self.meta = StateMeta(*self._gather(fb.req_pool_indices), starts, lens, self._per_position(fb),
                              chunked=self.chunked_prefill and fb.width is None)

    def alloc_graph_buffers(self, max_bs: int, width: int, max_seq_len: int) -> None:
        dev = self.pool.current.device
        z = lambda: torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.graph_buffers = {"state_rows": z(), "start_slots": z(),
                              # fixed-width batches: request b's tokens are b * width .. (b + 1) * width - 1
                              "starts": torch.arange(max_bs, dtype=torch.int64, device=dev) * width,
                              "lens": torch.full((max_bs,), width, dtype=torch.int64, device=dev)}

    def alloc_varlen_graph_buffers(self, max_rows: int) -> None:
        self.alloc_graph_buffers(max_rows, 0, 0)

    def init_forward_metadata_graph(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        buf = self.graph_buffers
        rows, slots = self._gather(fb.req_pool_indices, buf["state_rows"][:bs], buf["start_slots"][:bs])
        if fb.width is not None:
            starts, lens = buf["starts"][:bs], buf["lens"][:bs]
        else:  # a prefill graph: the staged request table (graphs/padding.py stage_extend)
            starts, lens = fb.extend_starts, fb.extend_lens
        self.meta = StateMeta(rows, slots, starts, lens, self._per_position(fb),
                              chunked=self.chunked_prefill and fb.width is None)
