"""Phase runners: static buffers, padding, CUDA-graph capture/replay and CPU "static replay" (DESIGN §3).

A runner owns its static input buffers and its own attention backend (and so its own metadata buffers). `run()`:
  * graphs enabled and bs <= max_bs: stage the live inputs into the buffers (padding contract), then replay the
    CUDA graph captured for the padded size — or on CPU run the same captured function eagerly over the buffers;
  * otherwise: run the same function eagerly on the live, unpadded tensors.
The function is `forward_phase` of the subclass; it is identical in all three paths, so CPU tests of the static
replay exercise exactly what the GPU graphs run.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.attention.backend import AttentionBackend
from specserve.engine.forward_batch import ForwardBatch, ForwardMode, fixed_width_out_cache_loc
from specserve.engine.padding import LiveInputs, StaticBuffers, stage
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.spec.ngram import history_tail, lookup_drafts

logger = logging.getLogger(__name__)


@dataclass
class RunnerContext:
    model: torch.nn.Module
    kv_pool: KVPool
    req_to_token: ReqToTokenPool
    make_backend: Callable[[KVPool], AttentionBackend]
    device: torch.device
    hidden_size: int
    dtype: torch.dtype
    mrope: bool
    graph_max_seq_len: int  # static key-length bound used when capturing
    graph_pool: object | None = None  # shared CUDA graph memory pool
    token_history: torch.Tensor | None = None  # [rows, W] draft phases with context lookup (spec/ngram.py)
    lookup_confidence: float = 0.5

    def history_rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The token history of page-table rows [B] -> [B, W] (None when context lookup is off)."""
        return None if self.token_history is None else self.token_history[rows]

    def draft_tokens(self, hidden: torch.Tensor, hist: torch.Tensor | None, last: torch.Tensor,
                     pattern: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The draft model's tokens for hidden [B, H]; with a token history hist [B, W] (history_rows), the
        context lookup's choice for rows whose committed tokens end at index last [B], continuing `pattern`
        (p2, p1, p0; default: the last three committed tokens)."""
        if hist is None:
            return self.model.draft_tokens(hidden)
        head, conf = self.model.draft_tokens_and_confidence(hidden)
        pattern = pattern if pattern is not None else history_tail(hist, last)
        return lookup_drafts(hist, last, *pattern, head, conf, self.lookup_confidence)


def padded_size(sizes: list[int], n: int) -> int:
    """The smallest captured size >= n (sizes sorted; n <= sizes[-1])."""
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


class PhaseRunner:
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
        self.on_cuda = ctx.device.type == "cuda"
        hidden_width = ctx.model.feature_size if self.hidden_from_target else ctx.hidden_size
        self.buffers = StaticBuffers.allocate(max(self.max_bs, 1), width,
                                              hidden_width if self.needs_hidden else None, ctx.dtype,
                                              ctx.mrope, ctx.device)
        self.backend = ctx.make_backend(ctx.kv_pool)  # graph/static-replay metadata lives here
        self.backend.alloc_graph_buffers(max(self.max_bs, 1), width, ctx.graph_max_seq_len)
        self.eager_backend = ctx.make_backend(ctx.kv_pool)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, dict[str, torch.Tensor]] = {}
        self.replays = 0
        self.eager_runs = 0

    # ------------------------------------------------------------------ subclass hook
    def forward_phase(self, t: LiveInputs, backend: AttentionBackend, graph_mode: bool) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared helpers
    def make_batch(self, mode: ForwardMode, t: LiveInputs, input_ids: torch.Tensor, positions: torch.Tensor,
                   seq_lens: torch.Tensor, hidden: torch.Tensor | None, backend: AttentionBackend,
                   graph_mode: bool, max_seq_len: int) -> ForwardBatch:
        table = self.ctx.req_to_token.table
        fb = ForwardBatch(
            mode=mode, batch_size=t.batch_size, input_ids=input_ids, positions=positions,
            out_cache_loc=fixed_width_out_cache_loc(table, t.req_pool_indices, seq_lens, self.width),
            req_pool_indices=t.req_pool_indices, seq_lens=seq_lens, max_seq_len=max_seq_len, width=self.width,
            hidden_in=hidden, attn_backend=backend, kv_pool=self.ctx.kv_pool,
        )
        if graph_mode:
            backend.init_forward_metadata_graph(fb)
        else:
            backend.init_forward_metadata(fb)
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
        return padded_size(self.capture_bs, bs)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> None:
        if not (self.use_graphs and self.on_cuda):
            return
        for pbs in reversed(self.capture_bs):
            empty = LiveInputs(0, self.buffers.input_ids[:0], self.buffers.positions[..., :0],
                               self.buffers.req_pool_indices[:0], self.buffers.seq_lens[:0], 0)
            stage(self.buffers, empty, pbs, self.width)  # every row padded: dummy row, slot 0
            inputs = self._static_inputs(pbs, self.ctx.graph_max_seq_len)
            self.graphs[pbs], self.graph_outputs[pbs], self.ctx.graph_pool = capture_graph(
                lambda inputs=inputs: self.forward_phase(inputs, self.backend, graph_mode=True), self.ctx.graph_pool)

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, live: LiveInputs) -> dict[str, torch.Tensor]:
        bs = live.batch_size
        if not self.use_graphs or bs > self.max_bs:
            self.eager_runs += 1
            return self.forward_phase(live, self.eager_backend, graph_mode=False)
        pbs = self.padded_bs(bs)
        stage(self.buffers, live, pbs, self.width)
        self.replays += 1
        if self.on_cuda:
            self.graphs[pbs].replay()
            out = self.graph_outputs[pbs]
        else:
            # CPU "static replay": the captured function, run over the static buffers at the padded size. The
            # key-length bound is the live one (the CPU has no graph to fix it) so small batches stay cheap.
            out = self.forward_phase(self._static_inputs(pbs, live.max_seq_len), self.backend, graph_mode=True)
        return {k: v[:bs] for k, v in out.items()}


class DecodeRunner(PhaseRunner):
    """Target decode: one token per request -> logits [bs, V]."""

    name = "decode"
    mode = ForwardMode.DECODE

    def forward_phase(self, t, backend, graph_mode):
        fb = self.make_batch(self.mode, t, t.input_ids, t.positions, t.seq_lens, None, backend, graph_mode,
                             t.max_seq_len)
        hidden = self.ctx.model(fb)
        return {"logits": self.ctx.model.compute_logits(hidden)}


class TargetVerifyRunner(PhaseRunner):
    """Target verify: N + 1 tokens per request -> logits [bs, N+1, V] and the target's features for the draft
    [bs, N+1, F] (F = H, or wider with aux hidden layers)."""

    name = "target_verify"
    mode = ForwardMode.TARGET_VERIFY

    def forward_phase(self, t, backend, graph_mode):
        fb = self.make_batch(self.mode, t, t.input_ids, t.positions, t.seq_lens, None, backend, graph_mode,
                             t.max_seq_len)
        hidden = self.ctx.model(fb)
        logits = self.ctx.model.compute_logits(hidden)
        w = self.width
        return {"logits": logits.view(-1, w, logits.shape[-1]), "hidden": hidden.view(-1, w, hidden.shape[-1])}


class DraftDecodeRunner(PhaseRunner):
    """The whole N - 1 step draft loop in one function (one graph): chained through the draft's own hidden state,
    positions (all mRoPE rows) and sequence lengths advancing by one per step -> tokens [bs, N-1]."""

    name = "draft_decode"
    mode = ForwardMode.DRAFT_DECODE
    needs_hidden = True

    def __init__(self, ctx, num_steps: int, capture_bs, use_graphs):
        self.num_steps = num_steps  # N - 1 forwards
        super().__init__(ctx, 1, capture_bs, use_graphs)

    def forward_phase(self, t, backend, graph_mode):
        ids, hidden = t.input_ids, t.hidden
        last = t.seq_lens - 1  # committed tokens end at S (the input is d1 at S+1)
        hist = self.ctx.history_rows(t.req_pool_indices)  # gathered once for all N - 1 steps
        pattern = None
        if hist is not None:
            p2, p1, _ = history_tail(hist, last)
            pattern = (p2, p1, ids)  # (x_{S-1}, x_S, d1): the next draft continues it
        tokens = []
        for i in range(self.num_steps):
            fb = self.make_batch(self.mode, t, ids, t.positions + i, t.seq_lens + i, hidden, backend, graph_mode,
                                 t.max_seq_len)
            hidden = self.ctx.model(fb)
            ids = self.ctx.draft_tokens(hidden, hist, last, pattern)
            if pattern is not None:
                pattern = (pattern[1], pattern[2], ids)
            tokens.append(ids)
        return {"tokens": torch.stack(tokens, dim=1)}


class DraftExtendRunner(PhaseRunner):
    """Draft over the N + 1 verified positions at fixed width (rejected rows included: they are overwritten
    later), then the row of the last accepted token -> next d1 [bs] and its hidden state [bs, H]."""

    name = "draft_extend"
    mode = ForwardMode.DRAFT_EXTEND
    needs_hidden = True
    hidden_from_target = True

    def forward_phase(self, t, backend, graph_mode):
        fb = self.make_batch(self.mode, t, t.input_ids, t.positions, t.seq_lens, t.hidden, backend, graph_mode,
                             t.max_seq_len)
        hidden = self.ctx.model(fb).view(t.batch_size, self.width, -1)
        sel = hidden[torch.arange(t.batch_size, device=hidden.device), t.accept_len]  # [bs, H]
        # committed tokens now end at S + accept_len + 1 (seq_lens = S + width here; the history holds them)
        last = t.seq_lens - self.width + t.accept_len + 1
        hist = self.ctx.history_rows(t.req_pool_indices)
        return {"tokens": self.ctx.draft_tokens(sel, hist, last), "hidden": sel}
