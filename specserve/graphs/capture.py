"""The one capture/replay skeleton (docs/architecture.md), used by every runner: the phase runners, the prefill
runners and the step graphs.

A `GraphLadder` holds one function over a runner's static buffers, captured as a CUDA graph per size of a ladder
(batch sizes, or token counts for prefill) into one memory pool shared by all runners and passed explicitly from
one capture to the next. `replay(size, fn)` replays the graph on CUDA; on a CPU, where there are no graphs, it
runs `fn` itself over the same static buffers ("static replay"), so CPU tests exercise exactly what the GPU graphs
run. Graph outputs are views into the pool: consume or clone them before the next replay of any runner.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


def padded_size(sizes: list[int], n: int) -> int:
    """The smallest size >= n of a sorted ladder (n <= sizes[-1])."""
    return sizes[bisect.bisect_left(sizes, n)]


def capture_graph(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object, object]:
    """Capture fn() (over static inputs) as a CUDA graph in memory pool `pool` (None: a new one).
    Returns (graph, its outputs, the pool)."""
    # Warm up on a side stream, as capture runs on one: per-stream library state (cuBLAS workspaces) and Triton
    # compilation happen here, not inside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    return g, out, pool if pool is not None else g.pool()


class GraphLadder:
    """Graphs of one runner, one per size of `sizes` (empty when graphs are off), with replay counters."""

    def __init__(self, sizes: list[int], device: torch.device, enabled: bool):
        self.sizes = sorted(set(sizes)) if enabled else []
        self.on_cuda = device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, object] = {}
        self.replays = 0  # runs over the static buffers (CUDA replays, or CPU static replays)
        self.eager_runs = 0  # runs on live, unpadded tensors

    @property
    def enabled(self) -> bool:
        return bool(self.sizes)

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    def covers(self, n: int) -> bool:
        return 0 < n <= self.max_size

    def padded(self, n: int) -> int:
        return padded_size(self.sizes, n)

    def capture(self, prepare: Callable[[int], Callable[[], object]], pool):
        """On CUDA, capture every size, largest first (smaller graphs reuse the pool's memory). prepare(size)
        stages an all-padding batch of that size and returns the function to capture. Returns the pool."""
        if not (self.sizes and self.on_cuda):
            return pool
        for size in reversed(self.sizes):
            fn = prepare(size)
            self.graphs[size], self.outputs[size], pool = capture_graph(fn, pool)
        return pool

    def replay(self, size: int, static_fn: Callable[[], object]):
        """The outputs for the buffers staged at padded size `size`: the CUDA graph's, or static_fn() on CPU."""
        self.replays += 1
        if self.on_cuda:
            self.graphs[size].replay()
            return self.outputs[size]
        return static_fn()


class LadderRunner:
    """What every runner shows of its ladder: its graphs and run counters (tests and benchmarks read them)."""

    ladder: GraphLadder

    @property
    def graphs(self) -> dict[int, torch.cuda.CUDAGraph]:
        return self.ladder.graphs

    @property
    def replays(self) -> int:
        return self.ladder.replays

    @property
    def eager_runs(self) -> int:
        return self.ladder.eager_runs
