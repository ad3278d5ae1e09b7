"""Whether the Triton kernels can be used in this process (Triton importable and a CUDA device present)."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def triton_kernels() -> ModuleType | None:
    """The module of Triton kernel entry points, or None when Triton or CUDA is missing."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        importlib.import_module("triton")
    except ImportError:
        return None
    try:
        return importlib.import_module("specserve.kernels.triton_ops")
    except ImportError:
        # The Triton implementations arrive with the GPU work; until then every op takes its reference.
        return None
