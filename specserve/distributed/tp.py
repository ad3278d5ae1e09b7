"""The tensor-parallel group a model is built for: this rank, the group's size, its torch.distributed process group,
and the collectives the parallel layers (layers/parallel.py) need. Size 1 (the default, `TP1`) makes every
collective the identity and every shard the whole tensor, so single-device code paths are untouched.

NCCL on GPUs, gloo on CPUs: whatever backend the process group was created with (`init_tp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup; None: the default group (or no group at size 1)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not valid")

    def split(self, n: int, what: str) -> int:
        """n divided over the ranks (a clear error when it does not divide)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size

    def shard(self, tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """This rank's equal slice of `tensor` along `dim`."""
        n = self.split(tensor.shape[dim], what)
        return tensor.narrow(dim, self.rank * n, n)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; x at size 1."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim` (rank order); x at size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


TP1 = TPGroup()


def init_tp(rank: int, size: int, init_method: str, backend: str | None = None,
            timeout: timedelta | None = None) -> TPGroup:
    """Join (or create) the default process group of `size` ranks and return this rank's TPGroup. backend: "nccl"
    or "gloo" (default: nccl when CUDA is available, else gloo); timeout: how long a collective may wait for a
    rank before it fails (torch's default otherwise)."""
    if size == 1:
        return TP1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        kw = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, **kw)
    return TPGroup(rank, size, None)
