"""The device side of a speculative step (DESIGN §1), and the runner that captures all of it as one CUDA graph.

`spec_step_device` is the step from the running rows' page-table rows and sequence lengths to the accepted tokens:

    draft decode (N-1 chained steps) -> target verify (N+1 tokens) -> accept -> recurrent-state commit
    -> token history -> draft extend (fixed width N+1) -> per-row state (next d1, draft hidden, last token)

Each phase goes through `phase(name, live)`. The worker (speculative/worker.py) passes the phase runners' `run`,
so every phase replays its own graph with the host glue in between (any batch, any sampling).

`SpecStepRunner` captures the same function once more, end to end, with each phase's `forward_phase` inlined, as
one graph per padded batch size for greedy batches. A step then costs the host one small input copy, one replay and
the one output copy that reads the accepted tokens: no host work between the phases, and the GPU starts on the
step as soon as the inputs land. It uses the phase runners' own attention backends (and their graph metadata
buffers) and their padding contract (graphs/padding.py stage_step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specserve.graphs.capture import GraphLadder, LadderRunner
from specserve.graphs.padding import LiveInputs, stage_step
from specserve.layers.sampler import GREEDY, SamplingBatch, probs_from_logits
from specserve.speculative.accept import verify_greedy, verify_sampling

if TYPE_CHECKING:
    from specserve.speculative.worker import SpecWorker

PhaseFn = Callable[[str, LiveInputs], dict[str, torch.Tensor]]


def spec_step_device(w: SpecWorker, phase: PhaseFn, rows: torch.Tensor, s: torch.Tensor, pos0: torch.Tensor,
                     max_s: int, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One speculative step for page-table rows [bs] whose committed sequences have length S = s [bs] (the last
    token, not yet in the KV, sits at index S); pos0 [bs] is the rope position of index S; max_s bounds s.

    Returns (accept_len [bs] in 0..N, verified [bs, N+1]): the tokens at S+1..S+accept_len+1 are new. No host
    sync."""
    n = w.num_steps
    bs = rows.shape[0]
    dev = rows.device
    row_state = w.state

    # 1. draft decode: d2..dN from (g, d1) at sequence indices S .. S+N-2
    d1 = row_state.draft_token[rows]  # [bs]
    if n > 1:
        live = LiveInputs(bs, d1, pos0, rows, s + 1, max_s + n - 1, hidden=row_state.draft_hidden[rows])
        more = phase("draft_decode", live)["tokens"]  # [bs, N-1]
        drafts = torch.cat((d1[:, None], more), dim=1)  # [bs, N]
    else:
        drafts = d1[:, None]

    # 2. target verify over [last, d1..dN] at sequence indices S..S+N
    width = n + 1
    offs = torch.arange(width, device=dev)
    verify_ids = torch.cat((w.last_token[rows][:, None], drafts), dim=1).reshape(-1)  # [bs * (N + 1)]
    verify_pos = (pos0[:, None] + offs[None, :]).reshape(-1)
    out = phase("target_verify", LiveInputs(bs, verify_ids, verify_pos, rows, s + width, max_s + width))
    logits, hidden = out["logits"], out["hidden"]  # [bs, width, V], [bs, width, F]

    # 3. accept
    if sb.all_greedy:
        accept_len, verified = verify_greedy(drafts, logits)
    else:
        probs = probs_from_logits(logits.reshape(bs * width, -1), sb.repeat(width)).view(bs, width, -1)
        accept_len, verified = verify_sampling(drafts, probs, sb.seeds, s)

    if w.target_state is not None:  # the accept commit: the state after the last accepted token is current
        w.target_state.commit(w.target_state.row_state[rows], accept_len)

    if row_state.tokens is not None:  # token history for context lookup: verified tokens at S+1..S+N+1
        row_state.tokens[rows[:, None], s[:, None] + 1 + offs[None, :]] = verified

    # 4. draft extend over the same N+1 positions with the verified tokens, row accept_len -> next d1, g
    live = LiveInputs(bs, verified.reshape(-1), verify_pos, rows, s + width, max_s + width, accept_len=accept_len,
                      hidden=hidden.reshape(bs * width, -1))
    ext = phase("draft_extend", live)
    row_state.draft_token[rows] = ext["tokens"]
    row_state.draft_hidden[rows] = ext["hidden"].to(row_state.draft_hidden.dtype)
    w.last_token[rows] = verified[torch.arange(bs, device=dev), accept_len]
    return accept_len, verified


class SpecStepRunner(LadderRunner):
    """The greedy speculative step as one graph per captured batch size (CPU: the same function run eagerly over
    the static inputs, as the phase runners' static replay). Output: [bs, 1 + N + 1] = accept_len, verified."""

    name = "spec_step"

    def __init__(self, worker: SpecWorker, capture_bs: list[int], use_graphs: bool):
        self.worker = worker
        self.graph_max_seq_len = worker.runners["target_verify"].ctx.graph_max_seq_len
        self.capture_bs = sorted(capture_bs)
        self.max_bs = self.capture_bs[-1] if self.capture_bs else 0
        self.use_graphs = use_graphs and self.max_bs > 0
        self.ladder = GraphLadder(self.capture_bs, worker.device, self.use_graphs)
        # static inputs: page-table row, S and the rope position of S, per request
        self.inputs = torch.zeros((3, max(self.max_bs, 1)), dtype=torch.int64, device=worker.device)

    def covers(self, bs: int) -> bool:
        return self.use_graphs and bs <= self.max_bs

    def padded_bs(self, bs: int) -> int:
        return self.ladder.padded(bs)

    def forward(self, inputs: torch.Tensor, max_s: int) -> torch.Tensor:
        """inputs [3, pbs] (rows, S, rope position of S) -> [pbs, N + 2]; each phase's forward with its runner's
        graph-mode backends."""
        runners = self.worker.runners

        def phase(name: str, live: LiveInputs) -> dict[str, torch.Tensor]:
            # 1-D text positions also for mRoPE models, which read them as three equal rows (as prefill does)
            r = runners[name]
            return r.forward_phase(live, r.backends, graph_mode=True)

        accept_len, verified = spec_step_device(self.worker, phase, inputs[0], inputs[1], inputs[2], max_s, GREEDY)
        return torch.cat((accept_len[:, None], verified), dim=1)

    @torch.inference_mode()
    def capture(self, pool):
        # the key-length bound of every phase is then the graph bound, as in the phase runners' own graphs
        max_s = self.graph_max_seq_len - (self.worker.num_steps + 1)

        def prepare(pbs: int):
            stage_step(self.inputs, [], [], [], pbs)  # every row padded
            inputs = self.inputs[:, :pbs]
            return lambda: self.forward(inputs, max_s)

        return self.ladder.capture(prepare, pool)

    @torch.inference_mode()
    def run(self, rows: list[int], seq_lens: list[int], pos0: list[int]) -> torch.Tensor:
        """Host lists of the running requests (bs <= max_bs) -> [bs, N + 2] on the device."""
        bs = len(rows)
        pbs = self.padded_bs(bs)
        stage_step(self.inputs, rows, seq_lens, pos0, pbs)
        out = self.ladder.replay(pbs, lambda: self.forward(self.inputs[:, :pbs], max(seq_lens)))
        return out[:bs]
