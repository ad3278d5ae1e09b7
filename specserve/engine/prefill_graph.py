"""Prefill as CUDA graphs: the target's extend over prompt chunks and the draft's extend over the same positions,
each captured for a ladder of padded token counts.

An eager prefill of a small model is host-launch bound like any other phase: SmolLM2-135M on the H200 spent
15-30 ms of host time on ~1 ms of kernels for one 64..1024-token prompt, a fifth of a speculative request's wall
time at batch 1 (BENCHMARKS.md section 8). A `PrefillRunner` owns static token buffers of `max_tokens` tokens and
request metadata for `max_rows` requests, and captures the model's variable-length forward once per token count
of `token_ladder(max_tokens)`. A live batch of T tokens is padded to the next count T' by the padding contract of
DESIGN §3, for variable-length batches:
  * the live requests keep their page-table rows, KV lengths, first tokens and new-token counts;
  * the T' - T padding tokens form one more request on the dummy page-table row 0: token id 0, position 0, KV
    slot 0, attending to dummy keys only;
  * the request slots after it have no new tokens (their attention programs exit at once).
Every padded buffer is rewritten on each replay. Batches with more tokens or requests than the graphs hold run
eagerly, over the same model function.

On CPU there are no graphs; there the runner pads and runs the captured function over its buffers ("static
replay", as the phase runners do) only when asked (`--cuda-graph-max-prefill-tokens` > 0): padding costs compute
on a CPU, so it is for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.forward_batch import ForwardBatch, ForwardMode, extend_starts
from specserve.engine.graph_runner import RunnerContext, capture_graph, padded_size

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


@dataclass
class ExtendBatch:
    """One prefill forward: requests' new tokens back to back."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 rope positions (text: the sequence index)
    out_cache_loc: torch.Tensor  # [T] int64 KV slot written by each token
    rows: list[int]  # page-table row of each request
    seq_lens: list[int]  # KV length of each request after this forward (prefix + new)
    extend_lens: list[int]  # new tokens of each request
    hidden: torch.Tensor | None = None  # [T, F] drafts: the target features fed with each token

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class PrefillRunner:
    """The variable-length forward of one model (the target's EXTEND or the draft's DRAFT_EXTEND over a prompt)."""

    def __init__(self, ctx: RunnerContext, mode: ForwardMode, max_tokens: int, max_rows: int, use_graphs: bool,
                 hidden_width: int | None = None):
        """max_tokens: the largest padded batch (0: always eager); max_rows: requests per graph batch;
        hidden_width: the width of the hidden input (drafts), None for the target."""
        self.ctx = ctx
        self.mode = mode
        self.name = f"prefill_{mode.value}"
        self.ladder = token_ladder(max_tokens) if max_tokens > 0 and use_graphs else []
        self.max_tokens = self.ladder[-1] if self.ladder else 0
        self.max_rows = max_rows
        self.on_cuda = ctx.device.type == "cuda"
        dev = ctx.device
        z = lambda *s: torch.zeros(s, dtype=torch.int64, device=dev)
        t = max(self.max_tokens, 1)
        self.input_ids = z(t)  # [max_tokens]
        self.positions = z(t)  # [max_tokens]
        self.out_cache_loc = z(t)  # [max_tokens]
        self.hidden = (None if hidden_width is None
                       else torch.zeros((t, hidden_width), dtype=ctx.dtype, device=dev))  # [max_tokens, F]
        # rows, KV lengths, first tokens, new tokens of max_rows requests + the padding request
        self.meta = z(4, max_rows + 1)  # [4, max_rows + 1]
        self.backend = ctx.make_backend(ctx.kv_pool)  # graph/static-replay metadata lives here
        if self.ladder:
            self.backend.alloc_varlen_graph_buffers(max_rows + 1)
        self.eager_backend = ctx.make_backend(ctx.kv_pool)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.eager_runs = 0

    # ------------------------------------------------------------------ the model function
    def forward(self, b: ForwardBatch) -> torch.Tensor:
        return self.ctx.model(b)  # [T, F]

    def _static_batch(self, tokens: int) -> ForwardBatch:
        m = self.meta
        fb = ForwardBatch(
            mode=self.mode, batch_size=self.max_rows + 1, input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens], out_cache_loc=self.out_cache_loc[:tokens], req_pool_indices=m[0],
            seq_lens=m[1], max_seq_len=self.ctx.graph_max_seq_len, extend_starts=m[2], extend_lens=m[3],
            hidden_in=None if self.hidden is None else self.hidden[:tokens], attn_backend=self.backend,
            kv_pool=self.ctx.kv_pool,
        )
        self.backend.init_forward_metadata_graph(fb)
        return fb

    def _eager_batch(self, x: ExtendBatch) -> ForwardBatch:
        dev = self.ctx.device
        fb = ForwardBatch(
            mode=self.mode, batch_size=len(x.rows), input_ids=x.input_ids, positions=x.positions,
            out_cache_loc=x.out_cache_loc, req_pool_indices=torch.tensor(x.rows, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(x.seq_lens, dtype=torch.int64, device=dev), max_seq_len=max(x.seq_lens),
            extend_lens_cpu=x.extend_lens, seq_lens_cpu=x.seq_lens, hidden_in=x.hidden,
            attn_backend=self.eager_backend, kv_pool=self.ctx.kv_pool,
        )
        self.eager_backend.init_forward_metadata(fb)
        return fb

    # ------------------------------------------------------------------ padding
    def padded_tokens(self, tokens: int) -> int:
        return padded_size(self.ladder, tokens)

    def fits(self, x: ExtendBatch) -> bool:
        return 0 < x.num_tokens <= self.max_tokens and len(x.rows) <= self.max_rows

    def stage(self, x: ExtendBatch, padded: int) -> None:
        """Copy the live batch in and pad it to `padded` tokens (module docstring)."""
        nt, n, r = x.num_tokens, len(x.rows), self.max_rows + 1
        for buf, live in ((self.input_ids, x.input_ids), (self.positions, x.positions),
                          (self.out_cache_loc, x.out_cache_loc), (self.hidden, x.hidden)):
            if buf is None:
                continue
            buf[:nt].copy_(live)
            buf[nt:padded].zero_()
        starts = extend_starts(x.extend_lens)
        pad, idle = padded - nt, r - n - 1
        host = torch.tensor([x.rows + [0] * (idle + 1),  # the padding request is on dummy row 0
                             x.seq_lens + [pad] + [0] * idle,
                             starts + [nt] + [padded] * idle,
                             x.extend_lens + [pad] + [0] * idle], dtype=torch.int64)  # [4, max_rows + 1]
        self.meta.copy_(host, non_blocking=True)

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self) -> None:
        if not (self.ladder and self.on_cuda):
            return
        for tokens in reversed(self.ladder):
            empty = ExtendBatch(self.input_ids[:0], self.positions[:0], self.out_cache_loc[:0], [], [], [],
                                None if self.hidden is None else self.hidden[:0])
            self.stage(empty, tokens)  # all padding: dummy row, slot 0
            self.graphs[tokens], self.graph_outputs[tokens], self.ctx.graph_pool = capture_graph(
                lambda tokens=tokens: self.forward(self._static_batch(tokens)), self.ctx.graph_pool)

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, x: ExtendBatch) -> torch.Tensor:
        """-> hidden [T, F] of every live token (a view into the graph's output on CUDA: use it before this
        runner's next replay)."""
        if not self.fits(x):
            self.eager_runs += 1
            return self.forward(self._eager_batch(x))
        padded = self.padded_tokens(x.num_tokens)
        self.stage(x, padded)
        self.replays += 1
        if self.on_cuda:
            self.graphs[padded].replay()
            out = self.graph_outputs[padded]
        else:
            out = self.forward(self._static_batch(padded))
        return out[:x.num_tokens]
