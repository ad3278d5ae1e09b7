"""The overlap schedule's one step in flight: step k+1 is launched before step k's output is read.

A decode step needs nothing from the host that the host does not already know: its tokens stay on the device
(the target's last-token rows, written by the step itself) and every running request grows by exactly one position.
So the scheduler launches step k+1 first and then waits for step k's tokens, and the host's work between steps
(stop checks, streaming, admission, the next step's staging and launches) runs while the device computes. A
request that step k finishes (a stop token) has already been given a place in step k+1: that token is dropped.
Requests that step k finishes by length are left out of step k+1, which the host knows before launching it.

A speculative step run as one graph keeps its state on the device too (drafts, hidden states, last tokens, the
recurrent commit), but each request grows by its accept length + 1, which only the step's output tells. The graph
therefore also leaves each row's next S on the device (speculative/spec_step.py SpecStepGraph.row_s), and step k+1
takes S from there for the rows continuing from step k; the host reserves pages for the longest outcome of both
steps (S + 2(N + 1) positions) and learns the lengths when it reads step k. Requests that step k may bring within
N + 1 positions of the context wait for that read; those it may finish by max_new_tokens run on, their tokens
dropped if it did. Anything else (a prefill, a switch between adaptive speculation's plain and speculative steps with
its draft catch-up, a step outside the graphs, a retraction) reads the step in flight first and runs synchronously.
Runs of plain steps of a speculating engine overlap as a plain engine's do.

A prefill is overlapped the same way: its first tokens (t0) stay on the device as the rows' last tokens, and the
draft's state after its extend too, so the prefill is launched, then the step in flight read, and the t0s are read
with the next step, which may already decode the new requests (a request that t0 finishes by length is left out of
it, as above; one that t0 stops has its token of that step dropped).

Everything runs on one stream, so pages, page-table rows and state rows freed while a step is in flight can only be
reused by work queued after it. The host reads a step's tokens from one of two pinned buffers, filled by an
asynchronous copy queued right after the step (before the next step overwrites the graph's output).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.request import Req


@dataclass
class PendingTokens:
    host: torch.Tensor  # [bs] int64, filled by a copy queued on the stream
    done: torch.cuda.Event | None  # recorded after the copy (None on a CPU: the copy was synchronous)

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class TokenReadback:
    """A step's output (int64 [bs] or [bs, w]) -> host without a device sync: two pinned buffers used in turn (at
    most one step is in flight while the next one's copy is queued)."""

    def __init__(self, max_elems: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.bufs = [torch.empty(max_elems, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]  # one per buffer
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> PendingTokens:
        """tokens [bs] or [bs, w] on the device -> their copy, under way."""
        n = tokens.numel()
        if n > self.bufs[0].shape[0]:
            raise ValueError(f"{n} values, readback buffers of {self.bufs[0].shape[0]}")
        host = self.bufs[self.turn][:n].view(tokens.shape)
        done = self.events[self.turn]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=self.cuda)
        if done is not None:
            done.record()
        return PendingTokens(host, done)


@dataclass
class InFlightDecode:
    """A launched decode step whose output the host has not read yet."""

    reqs: list[Req]  # in batch order
    tokens: PendingTokens  # plain: [bs] tokens; speculative: [bs, 1 + N + 1] accept lengths and verified tokens
    spec: bool = False  # a speculative step (its requests' seq_len advance when it is read), else a plain one (the
    # seq_len of each of its requests already counts its token)
    launched: float = 0.0  # perf_counter at launch
    prefill: bool = False  # a prefill: reqs are its final chunks' requests (already running), tokens their t0
    steady: bool = False  # launched while a decode step of the same kind was in flight (no switch, no drain)
