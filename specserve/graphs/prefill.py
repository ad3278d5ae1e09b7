"""Prefill as CUDA graphs: the target's extend over prompt chunks and the draft's extend over the same positions,
each captured for a ladder of padded token counts.

An eager prefill of a small model is host-launch bound like any other phase: its host time is many times its kernels'
time, a visible share of a short request's wall time at batch 1. A `PrefillRunner` owns static token buffers of
`max_tokens` tokens and request metadata for `max_rows` requests, and captures the model's variable-length forward once
per token count of `token_ladder(max_tokens)`. A live batch of T tokens is padded to the next count T' by the padding
contract for variable-length batches (graphs/padding.py stage_extend); every padded buffer is rewritten on each replay.
Batches with more tokens or requests than the graphs hold run eagerly, over the same model function.

On CPU there are no graphs; there the runner pads and runs the captured function over its buffers ("static
replay", as the phase runners do) only when asked (`--cuda-graph-max-prefill-tokens` > 0): padding costs compute
on a CPU, so it is for tests.
"""

from __future__ import annotations

import torch

from specserve.batch import ForwardBatch, ForwardMode
from specserve.graphs.capture import GraphLadder, LadderRunner
from specserve.graphs.padding import ExtendBatch, ExtendBuffers, stage_extend
from specserve.graphs.phase_runners import RunnerContext, init_metadata

__all__ = ["ExtendBatch", "PrefillRunner", "token_ladder"]

_MIN_TOKENS = 16


def token_ladder(max_tokens: int) -> list[int]:
    """Padded token counts: 16, 32, 64, 128, then steps of x1.5 and x2 in turn (192, 256, 384, 512, ...), and
    max_tokens itself: at most 1.5x the live tokens above 128."""
    out, t = [], _MIN_TOKENS
    while t < max_tokens:
        out.append(t)
        if t >= 128:
            half = t + t // 2
            if half < max_tokens:
                out.append(half)
        t *= 2
    out.append(max_tokens)
    return sorted(set(out))


class PrefillRunner(LadderRunner):
    """The variable-length forward of one model (the target's EXTEND or the draft's DRAFT_EXTEND over a prompt)."""

    def __init__(self, ctx: RunnerContext, mode: ForwardMode, max_tokens: int, max_rows: int, use_graphs: bool,
                 hidden_width: int | None = None, max_attended: int | None = None):
        """max_tokens: the largest padded batch (0: always eager); max_rows: requests per graph batch;
        hidden_width: the width of the hidden input (drafts), None for the target; max_attended: the most
        (query token, key) pairs a graphed batch may attend over (None: no bound), for attention whose graphed
        prefill walks each token's whole prefix alone (MLA's token rows): longer prefixes run eagerly."""
        self.ctx = ctx
        self.max_attended = max_attended
        self.mode = mode
        self.name = f"prefill_{mode.value}"
        self.ladder = GraphLadder(token_ladder(max_tokens) if max_tokens > 0 else [], ctx.device, use_graphs)
        self.max_tokens = self.ladder.max_size
        self.max_rows = max_rows
        self.buffers = ExtendBuffers.allocate(self.max_tokens, max_rows, hidden_width, ctx.dtype, ctx.device)
        self.backends = ctx.make_backends()  # graph/static-replay metadata lives here
        if self.ladder.enabled:
            for b in self.backends.values():
                b.alloc_varlen_graph_buffers(max_rows + 1)
        self.eager_backends = ctx.make_backends()

    # ------------------------------------------------------------------ the model function
    def forward(self, b: ForwardBatch) -> torch.Tensor:
        return self.ctx.model(b)  # [T, F]

    def _static_batch(self, tokens: int) -> ForwardBatch:
        b = self.buffers
        m = b.meta
        fb = ForwardBatch(
            mode=self.mode, batch_size=self.max_rows + 1, input_ids=b.input_ids[:tokens],
            positions=b.positions[:tokens], out_cache_loc=b.out_cache_loc[:tokens], req_pool_indices=m[0],
            seq_lens=m[1], max_seq_len=self.ctx.graph_max_seq_len, extend_starts=m[2], extend_lens=m[3],
            hidden_in=None if b.hidden is None else b.hidden[:tokens], backends=self.backends,
        )
        init_metadata(fb, graph_mode=True)
        return fb

    def _eager_batch(self, x: ExtendBatch) -> ForwardBatch:
        dev = self.ctx.device
        fb = ForwardBatch(
            mode=self.mode, batch_size=len(x.rows), input_ids=x.input_ids, positions=x.positions,
            out_cache_loc=x.out_cache_loc, req_pool_indices=torch.tensor(x.rows, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(x.seq_lens, dtype=torch.int64, device=dev), max_seq_len=max(x.seq_lens),
            extend_lens_cpu=x.extend_lens, seq_lens_cpu=x.seq_lens, hidden_in=x.hidden,
            input_embeds=x.input_embeds, backends=self.eager_backends,
        )
        init_metadata(fb, graph_mode=False)
        return fb

    # ------------------------------------------------------------------ padding
    def padded_tokens(self, tokens: int) -> int:
        return self.ladder.padded(tokens)

    def fits(self, x: ExtendBatch) -> bool:
        if x.input_embeds is not None or x.positions.dim() == 2:  # image requests: eager (no graph buffers for them)
            return False
        if self.max_attended is not None:  # each new token attends over its prefix and the new tokens before it
            attended = sum(e * (s - e) + e * (e + 1) // 2 for s, e in zip(x.seq_lens, x.extend_lens))
            if attended > self.max_attended:
                return False
        return self.ladder.covers(x.num_tokens) and len(x.rows) <= self.max_rows

    def stage(self, x: ExtendBatch, padded: int) -> None:
        stage_extend(self.buffers, x, padded)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, pool):
        """Capture every token count into the shared graph memory pool `pool`; returns the pool."""
        b = self.buffers

        def prepare(tokens: int):
            empty = ExtendBatch(b.input_ids[:0], b.positions[:0], b.out_cache_loc[:0], [], [], [],
                                None if b.hidden is None else b.hidden[:0])
            self.stage(empty, tokens)  # all padding: dummy row, slot 0
            return lambda: self.forward(self._static_batch(tokens))

        return self.ladder.capture(prepare, pool)

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, x: ExtendBatch) -> torch.Tensor:
        """-> hidden [T, F] of every live token (a view into the graph's output on CUDA: use it before this
        runner's next replay)."""
        if not self.fits(x):
            self.ladder.eager_runs += 1
            return self.forward(self._eager_batch(x))
        padded = self.padded_tokens(x.num_tokens)
        self.stage(x, padded)
        out = self.ladder.replay(padded, lambda: self.forward(self._static_batch(padded)))
        return out[:x.num_tokens]
