"""Arrival counters for kernels whose last-arriving program finishes a reduction (the attention's split merge, the
router's top-k, the MoE's one-token sum, the sampler's passes, the q/k-normed GEMV epilogue).

Each owner keeps one zero-initialised int32 buffer per device, made on first use (eager: graphs/capture.py's warm-up
calls run before a capture, so no buffer is made inside one) and never replaced (a captured graph keeps its address).
Every launch leaves the counters it used at 0 again, so they need no reset between calls or graph replays. Launches
that could overlap on one owner's buffer (several streams) would break: the engine runs its layers on one stream, in
order.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(owner: str, device: torch.device, size: int) -> torch.Tensor:
    """owner's [size] int32 counters on device (all 0 between launches)."""
    key = (owner, device)
    c = _BUFFERS.get(key)
    if c is None:
        c = _BUFFERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    assert c.numel() == size, f"{owner}: counters of {c.numel()}, asked for {size}"
    return c
