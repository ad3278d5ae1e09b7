"""K/V tensors of one model (target or draft). Both index the same slots through the shared page table."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # [num_slots, kv_heads, head_dim] per layer; separate tensors so one layer's write never touches another's.
        self.k = [torch.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype, device=device) for _ in
                  range(num_layers)]
        self.v = [torch.zeros((num_slots, num_kv_heads, head_dim), dtype=dtype, device=device) for _ in
                  range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
