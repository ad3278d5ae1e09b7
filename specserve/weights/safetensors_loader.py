"""Read HF safetensors checkpoints (single file or sharded with an index), one tensor at a time.

Shards are opened one after the other and each tensor is read on its own, so a loader that copies every tensor into
its device parameter as it arrives holds about one shard of host memory at a time (the memory-mapped shard and the
tensor being copied), not the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return [os.path.join(folder, f) for f in files]


def tensor_names(folder: str) -> dict[str, str]:
    """Every tensor name of the checkpoint -> its shard file (read from the headers only)."""
    out = {}
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = path
    return out


def iter_safetensors(folder: str, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor, or only those in `names`, shard by shard (shards without any of them
    are not opened)."""
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            keys = [k for k in f.keys() if names is None or k in names]  # noqa: SIM118
            for name in keys:
                yield name, f.get_tensor(name)
