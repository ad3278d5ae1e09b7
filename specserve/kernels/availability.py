"""Whether the Triton kernels can be used in this process (Triton importable and a CUDA device present)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The module of Triton kernel entry points, or None when Triton or CUDA is missing.

    With Triton and CUDA present, a broken specserve.kernels.triton_ops raises instead of silently falling back
    to the torch references."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        importlib.import_module("triton")
    except ImportError:
        return None
    return importlib.import_module("specserve.kernels.triton_ops")
