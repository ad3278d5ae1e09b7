"""Phase runners: static buffers, padding, CUDA-graph capture/replay and CPU "static replay" (docs/architecture.md).

A runner owns its static input buffers and its own backends, one per cache kind of its model (and so its own
metadata buffers). `run()`:
  * graphs enabled and bs <= max_bs: stage the live inputs into the buffers (padding contract, graphs/padding.py),
    then replay the CUDA graph captured for the padded size — or on CPU run the same captured function eagerly over
    the buffers (graphs/capture.py);
  * otherwise: run the same function eagerly on the live, unpadded tensors, with the runner's eager backends.
The function is `forward_phase` of the subclass; it is identical in all three paths, so CPU tests of the static
replay exercise exactly what the GPU graphs run. The target's runners are here (and `TargetPhases`, the model
runner's typed handles to them); the draft's are in speculative/draft_runners.py, over the same base.

A step that chains phases (speculative/spec_step.py, speculative/plain_step.py) calls each phase through a `PhaseCall`:
`replay_phase` (the phase's own graph, or eager beyond its sizes), `inline_phase` (its function inlined into an
enclosing step graph) or `eager_phase` (tests' reference).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from specserve.batch import CacheKind, ForwardBatch, ForwardMode, fixed_width_out_cache_loc
from specserve.graphs.capture import GraphLadder, LadderRunner
from specserve.graphs.padding import LiveInputs, StaticBuffers, stage
from specserve.kvcache.req_to_token import ReqToTokenPool

logger = logging.getLogger(__name__)

Backends = Mapping[CacheKind, object]


@dataclass
class RunnerContext:
    """What every runner of one model shares: the model, the page table, a factory of backends (one per cache kind
    of the model's pools, each a fresh instance with its own metadata), and the static shape bounds."""

    model: torch.nn.Module
    req_to_token: ReqToTokenPool
    make_backends: Callable[[], dict[CacheKind, object]]
    device: torch.device
    hidden_size: int
    dtype: torch.dtype
    mrope: bool
    graph_max_seq_len: int  # static key-length bound used when capturing


def init_metadata(fb: ForwardBatch, graph_mode: bool) -> None:
    """Every backend of the batch builds its metadata: eagerly, or from device tensors only (capturable)."""
    for backend in fb.backends.values():
        if graph_mode:
            backend.init_forward_metadata_graph(fb)
        else:
            backend.init_forward_metadata(fb)


class PhaseRunner(LadderRunner):
    name = "phase"
    mode = ForwardMode.IDLE
    needs_hidden = False
    hidden_from_target = False  # its hidden input is the target's features (the draft's feature_size wide)

    def __init__(self, ctx: RunnerContext, width: int, capture_bs: list[int], use_graphs: bool):
        self.ctx = ctx
        self.width = width
        self.capture_bs = sorted(capture_bs)
        self.max_bs = self.capture_bs[-1] if self.capture_bs else 0
        self.use_graphs = use_graphs and self.max_bs > 0
        self.ladder = GraphLadder(self.capture_bs, ctx.device, self.use_graphs)
        hidden_width = ctx.model.feature_size if self.hidden_from_target else ctx.hidden_size
        self.buffers = StaticBuffers.allocate(max(self.max_bs, 1), width,
                                              hidden_width if self.needs_hidden else None, ctx.dtype,
                                              ctx.mrope, ctx.device)
        self.backends = ctx.make_backends()  # graph/static-replay metadata lives here
        for b in self.backends.values():
            b.alloc_graph_buffers(max(self.max_bs, 1), width, ctx.graph_max_seq_len)
        self.eager_backends = ctx.make_backends()

    # ------------------------------------------------------------------ subclass hook
    def forward_phase(self, t: LiveInputs, backends: Backends, graph_mode: bool) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared helpers
    def make_batch(self, mode: ForwardMode, t: LiveInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                   seq_lens: torch.Tensor, hidden: torch.Tensor | None, backends: Backends,
                   graph_mode: bool, max_seq_len: int) -> ForwardBatch:
        table = self.ctx.req_to_token.table
        fb = ForwardBatch(
            mode=mode, batch_size=t.batch_size, input_ids=input_ids, positions=positions,
            out_cache_loc=fixed_width_out_cache_loc(table, t.req_pool_indices, seq_lens, self.width),
            req_pool_indices=t.req_pool_indices, seq_lens=seq_lens, max_seq_len=max_seq_len, width=self.width,
            hidden_in=hidden, backends=backends,
        )
        init_metadata(fb, graph_mode)
        return fb

    def _static_inputs(self, pbs: int, max_seq_len: int) -> LiveInputs:
        b, w = self.buffers, self.width
        return LiveInputs(
            batch_size=pbs, input_ids=b.input_ids[:pbs * w],
            positions=b.positions[..., :pbs * w], req_pool_indices=b.req_pool_indices[:pbs],
            seq_lens=b.seq_lens[:pbs], max_seq_len=max_seq_len, accept_len=b.accept_len[:pbs],
            hidden=None if b.hidden is None else b.hidden[:pbs * w],
        )

    def padded_bs(self, bs: int) -> int:
        return self.ladder.padded(bs)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, pool):
        """Capture every batch size into the shared graph memory pool `pool`; returns the pool."""
        def prepare(pbs: int):
            empty = LiveInputs(0, self.buffers.input_ids[:0], self.buffers.positions[..., :0],
                               self.buffers.req_pool_indices[:0], self.buffers.seq_lens[:0], 0)
            stage(self.buffers, empty, pbs, self.width)  # every row padded: dummy row, slot 0
            inputs = self._static_inputs(pbs, self.ctx.graph_max_seq_len)
            return lambda: self.forward_phase(inputs, self.backends, graph_mode=True)

        return self.ladder.capture(prepare, pool)

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, live: LiveInputs) -> dict[str, torch.Tensor]:
        bs = live.batch_size
        if not self.use_graphs or bs > self.max_bs:
            self.ladder.eager_runs += 1
            return self.forward_phase(live, self.eager_backends, graph_mode=False)
        pbs = self.padded_bs(bs)
        stage(self.buffers, live, pbs, self.width)
        # CPU static replay: the key-length bound is the live one (the CPU has no graph to fix it), so small
        # batches stay cheap.
        out = self.ladder.replay(pbs, lambda: self.forward_phase(self._static_inputs(pbs, live.max_seq_len),
                                                                 self.backends, graph_mode=True))
        return {k: v[:bs] for k, v in out.items()}


class DecodeRunner(PhaseRunner):
    """Target decode: one token per request -> logits [bs, V] and the final-norm hidden state [bs, H]."""

    name = "decode"
    mode = ForwardMode.DECODE

    def forward_phase(self, t, backends, graph_mode):
        fb = self.make_batch(self.mode, t, t.input_ids, t.positions, t.seq_lens, None, backends, graph_mode,
                             t.max_seq_len)
        hidden = self.ctx.model(fb)
        return {"logits": self.ctx.model.compute_logits(hidden), "hidden": hidden}


class TargetVerifyRunner(PhaseRunner):
    """Target verify: N + 1 tokens per request -> logits [bs, N+1, V] and the target's features for the draft
    [bs, N+1, F] (F = H, or wider with aux hidden layers)."""

    name = "target_verify"
    mode = ForwardMode.TARGET_VERIFY

    def forward_phase(self, t, backends, graph_mode):
        fb = self.make_batch(self.mode, t, t.input_ids, t.positions, t.seq_lens, None, backends, graph_mode,
                             t.max_seq_len)
        hidden = self.ctx.model(fb)
        logits = self.ctx.model.compute_logits(hidden)
        w = self.width
        return {"logits": logits.view(-1, w, logits.shape[-1]), "hidden": hidden.view(-1, w, hidden.shape[-1])}


class PlainVerifyRunner(TargetVerifyRunner):
    """A speculating engine's plain step on the target: the verify pass at width 1 (the last token alone) ->
    logits [bs, 1, V] and the features [bs, 1, F] the draft needs to catch up later (speculative/plain_step.py)."""

    name = "plain_verify"


@dataclass
class TargetPhases:
    """The target's phase runners of one model runner, by what they run. A plain engine has `decode`; a speculating
    one has `target_verify`, and `plain_verify` when adaptive speculation may take plain steps."""

    decode: DecodeRunner | None = None  # a plain engine's decode step: one token per request
    target_verify: TargetVerifyRunner | None = None  # the speculative step's verify: N + 1 tokens per request
    plain_verify: PlainVerifyRunner | None = None  # the plain step's verify at width 1

    def all(self) -> list[PhaseRunner]:
        """The runners that exist, in capture order."""
        return [r for r in (self.decode, self.target_verify, self.plain_verify) if r is not None]


PhaseCall = Callable[[PhaseRunner, LiveInputs], dict[str, torch.Tensor]]  # how a step runs one of its phases


def replay_phase(runner: PhaseRunner, live: LiveInputs) -> dict[str, torch.Tensor]:
    """The phase on its own graph (or eagerly beyond its captured sizes): a step run phase by phase."""
    return runner.run(live)


def inline_phase(runner: PhaseRunner, live: LiveInputs) -> dict[str, torch.Tensor]:
    """The phase's function with its graph-mode backends, inlined into an enclosing step graph."""
    return runner.forward_phase(live, runner.backends, graph_mode=True)


def eager_phase(runner: PhaseRunner, live: LiveInputs) -> dict[str, torch.Tensor]:
    """The phase's function eagerly on the live tensors (the reference the graphs are tested against)."""
    return runner.forward_phase(live, runner.eager_backends, graph_mode=False)

