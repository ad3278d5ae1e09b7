"""Recurrent-state snapshots for the prefix cache (kvcache/radix_cache.py): a bounded pool of (conv, SSM) states of
every recurrent layer, each the state after a cached prefix's last token, owned by the tree node that ends there.

A hybrid model's cached prefix is only usable with the recurrent state at its end: K/V pages say nothing about it.
The state pool (kvcache/state_pool.py) already holds each row's committed state in its current slot, so a snapshot
is one device copy of that slot (no host read: the slot index stays on the device), taken where a prefill chunk
ends or a request leaves, and a hit is one copy back into the new request's row (slot 0, made current). Only
committed states are ever copied: the slots a verify wrote for rejected positions are never current.
"""

from __future__ import annotations

import torch

from specserve.kvcache.state_pool import StatePool


class StateSnapshots:
    def __init__(self, pool: StatePool, count: int):
        """count: snapshots held at most (slot 0 is unused: 0 means "none" in the tree)."""
        if count < 1:
            raise ValueError("a snapshot pool needs at least one snapshot")
        self.pool = pool
        self.count = count
        n, dev = count + 1, pool.conv.device
        self.conv = torch.zeros((pool.num_layers, n, *pool.conv.shape[3:]), dtype=pool.conv.dtype,
                                device=dev)  # [L, count + 1, *conv]
        self.ssm = torch.zeros((pool.num_layers, n, *pool.ssm.shape[3:]), dtype=pool.ssm.dtype,
                               device=dev)  # [L, count + 1, *ssm]
        self._free: list[int] = list(range(count, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, state_row: int) -> int:
        """Copy state row `state_row`'s committed state into a free snapshot; its index (0: none free)."""
        if not self._free:
            return 0
        sid = self._free.pop()
        slot = self.pool.current[state_row:state_row + 1]  # [1] on the device: no host read
        self.conv[:, sid] = self.pool.conv[:, state_row].index_select(1, slot)[:, 0]
        self.ssm[:, sid] = self.pool.ssm[:, state_row].index_select(1, slot)[:, 0]
        return sid

    def restore(self, sid: int, state_row: int) -> None:
        """Make snapshot `sid` the committed state of state row `state_row` (its slot 0)."""
        self.pool.conv[:, state_row, 0] = self.conv[:, sid]
        self.pool.ssm[:, state_row, 0] = self.ssm[:, sid]
        self.pool.current[state_row] = 0

    def free(self, sid: int) -> None:
        if not 0 < sid <= self.count or sid in self._free:
            raise ValueError(f"snapshot {sid} is not held")
        self._free.append(sid)
