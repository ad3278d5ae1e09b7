"""A whole decode step as one CUDA graph per padded batch size and sampling kind: the skeleton (`StepGraph`) shared
by the speculative step (speculative/spec_step.py SpecStepGraph), a speculating engine's plain step
(speculative/plain_step.py PlainStepGraph) and a plain engine's decode step (DecodeStepGraph below).

The host uploads one small tensor (page-table rows, committed lengths S, rope positions of S) and, for sampled
batches, the rows' sampling parameters into static buffers, replays, and reads the result: no host work inside the
step. Three graph sets share one memory pool: greedy batches, sampled batches (per-row temperature, top-k, top-p,
min-p and seeds as static inputs; greedy rows of a mixed batch stay greedy), and sampled batches with the
top-k / top-p / min-p filter (layers/sampler.py; its launches skipped when no row filters). On a CPU the
same function runs over the static buffers (static replay, graphs/capture.py).
"""

from __future__ import annotations

import abc
import logging

import torch

from specserve.graphs.capture import GraphLadder, LadderRunner
from specserve.graphs.padding import LiveInputs, stage_step
from specserve.graphs.phase_runners import DecodeRunner, inline_phase
from specserve.graphs.step_hidden import StepHidden
from specserve.layers.sampler import GREEDY, SamplingBatch, sample

logger = logging.getLogger(__name__)


class StepGraph(LadderRunner, abc.ABC):
    """A step function over static inputs [4, pbs] (rows, S, rope position of S, continuing-row flags: graphs/padding.py
    stage_step) and a sampling batch, captured per
    batch size of `capture_bs` and sampling kind. `ladder` holds the greedy graphs; `sampled` and `filtered` the
    sampling ones. lookahead: how far past S the step writes (its KV length bound is S + lookahead)."""

    def __init__(self, capture_bs: list[int], use_graphs: bool, device: torch.device, vocab_size: int,
                 graph_max_seq_len: int, lookahead: int):
        self.capture_bs = sorted(capture_bs)
        self.max_bs = self.capture_bs[-1] if self.capture_bs else 0
        self.use_graphs = use_graphs and self.max_bs > 0
        # the key-length bound of every phase is then the graph bound, as in the phase runners' own graphs
        self.capture_max_seq_len = graph_max_seq_len - lookahead
        self.ladder = GraphLadder(self.capture_bs, device, self.use_graphs)
        self.sampled = GraphLadder(self.capture_bs, device, self.use_graphs)
        self.filtered = GraphLadder(self.capture_bs, device, self.use_graphs)
        self.inputs = torch.zeros((4, max(self.max_bs, 1)), dtype=torch.int64, device=device)  # rows, S, pos, cont
        self.sampling = SamplingBuffers(max(self.max_bs, 1), vocab_size, device)

    @abc.abstractmethod
    def forward(self, inputs: torch.Tensor, max_seq_len: int, sampling: SamplingBatch = GREEDY) -> torch.Tensor:
        """inputs [4, pbs] (rows, S, rope position of S, continuing flags); max_seq_len bounds S -> the step's output
        [pbs, ...]."""

    @property
    def graphs(self) -> dict:
        """Every captured graph of the three kinds (keyed by (kind, batch size))."""
        return {(kind, bs): g for kind, lad in (("greedy", self.ladder), ("sampled", self.sampled),
                                                ("filtered", self.filtered)) for bs, g in lad.graphs.items()}

    @property
    def replays(self) -> int:
        return self.ladder.replays + self.sampled.replays + self.filtered.replays

    @property
    def replays_by_kind(self) -> dict[str, int]:
        """Replays of each kind's graphs: a sampled kind at 0 while sampled steps ran means they went phase by
        phase (its capture failed: logged once at start)."""
        return {"greedy": self.ladder.replays, "sampled": self.sampled.replays, "filtered": self.filtered.replays}

    def covers(self, bs: int, sampling: SamplingBatch = GREEDY) -> bool:
        """Whether a batch of bs requests with this sampling runs as one graph (on CPU: one static replay)."""
        if not (self.use_graphs and bs <= self.max_bs):
            return False
        ladder = self._ladder(sampling)
        return ladder.enabled or not ladder.on_cuda

    def padded_bs(self, bs: int) -> int:
        return self.ladder.padded(bs)

    def _ladder(self, sampling: SamplingBatch) -> GraphLadder:
        return self.ladder if sampling.all_greedy else (self.filtered if sampling.need_filter else self.sampled)

    @torch.inference_mode()
    def capture(self, pool):
        for kind in (None, False, True):  # greedy, sampled, sampled with the filter
            def prepare(pbs: int, kind=kind):
                stage_step(self.inputs, [], [], [], pbs)  # every row padded
                self.sampling.stage(None, pbs)
                inputs = self.inputs[:, :pbs]
                sampling = GREEDY if kind is None else self.sampling.batch(pbs, need_filter=kind)
                return lambda: self.forward(inputs, self.capture_max_seq_len, sampling)

            ladder = self.ladder if kind is None else (self.filtered if kind else self.sampled)
            try:
                pool = ladder.capture(prepare, pool)
            except RuntimeError as e:
                if kind is None:
                    raise
                # The sampling graphs are an optimisation over the phase-by-phase path: a capture failure there
                # (first seen on a new device or torch) leaves sampled batches on the phases' own graphs.
                logger.warning("sampled %s graphs not captured (%s); sampled batches run phase by phase", self.name, e)
                ladder.sizes, ladder.graphs, ladder.outputs = [], {}, {}
        return pool

    @torch.inference_mode()
    def run(self, rows: list[int], seq_lens: list[int], pos0: list[int], sampling: SamplingBatch = GREEDY,
            cont: list[bool] | None = None) -> torch.Tensor:
        """Host lists of the running requests (bs <= max_bs) and their sampling batch -> [bs, ...] on the device.
        cont: the rows whose S the runner's previous steps advanced on the device (runners that keep it)."""
        bs = len(rows)
        pbs = self.padded_bs(bs)
        stage_step(self.inputs, rows, seq_lens, pos0, pbs, cont)
        static_sampling = GREEDY
        if not sampling.all_greedy:
            self.sampling.stage(sampling, pbs)
            static_sampling = self.sampling.batch(pbs, sampling.need_filter)
        out = self._ladder(sampling).replay(pbs, lambda: self.forward(self.inputs[:, :pbs], max(seq_lens),
                                                                      static_sampling))
        return out[:bs]


class DecodeStepGraph(StepGraph):
    """A plain engine's decode step as one graph: the target decode over each row's last token, sampling, and the
    last-token update -> tokens [pbs]. Replaces, for batches it covers, the decode runner's graph plus the eager
    sampling and bookkeeping around it, whose host launches are a visible share of a small model's step."""

    name = "decode_step"

    def __init__(self, decode: DecodeRunner, last_token: torch.Tensor, capture_bs: list[int], use_graphs: bool,
                 step_hidden: StepHidden | None = None):
        """decode: the target's decode runner (its backends and graph metadata are used); last_token [rows]: the
        target's per-row newest token (read and written); step_hidden: where the step keeps its hidden states
        (graphs/step_hidden.py; None: nowhere)."""
        ctx = decode.ctx
        super().__init__(capture_bs, use_graphs, ctx.device, ctx.model.config.vocab_size, ctx.graph_max_seq_len, 1)
        self.decode = decode
        self.last_token = last_token
        self.step_hidden = step_hidden

    def forward(self, inputs: torch.Tensor, max_seq_len: int, sampling: SamplingBatch = GREEDY) -> torch.Tensor:
        rows, seq_lens, pos0 = inputs[0], inputs[1], inputs[2]
        # 1-D text positions also for mRoPE models, which read them as three equal rows (as the spec step does)
        live = LiveInputs(rows.shape[0], self.last_token[rows], pos0, rows, seq_lens + 1, max_seq_len + 1)
        out = inline_phase(self.decode, live)
        if self.step_hidden is not None:
            self.step_hidden.write(rows, out["hidden"])
        tokens = sample(out["logits"], sampling, seq_lens + 1)  # [pbs] the token at index S + 1
        self.last_token[rows] = tokens
        return tokens


class SamplingBuffers:
    """Per-row sampling parameters as static graph inputs. Padded rows are greedy (temperature 1, no filter), so
    they cost no sampling and can never produce NaNs."""

    def __init__(self, max_bs: int, vocab_size: int, device: torch.device):
        f = lambda v: torch.full((max_bs,), v, dtype=torch.float32, device=device)  # noqa: E731
        self.vocab_size = vocab_size
        self.temperature, self.top_p, self.min_p = f(1.0), f(1.0), f(0.0)
        self.top_k = torch.full((max_bs,), vocab_size, dtype=torch.int64, device=device)
        self.seeds = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.greedy = torch.ones(max_bs, dtype=torch.bool, device=device)
        self._staged: SamplingBatch | None = None  # the batch staged last, and its padded size
        self._staged_pbs = 0

    def stage(self, sampling: SamplingBatch | None, pbs: int) -> None:
        """Copy a live batch's rows in (None: none) and reset rows bs..pbs-1 to the padding values. The batch staged
        last is not copied again (the engine reuses one SamplingBatch while the running requests stay the same:
        engine/sampling_cache.py), which saves a sampled step twelve small launches."""
        if sampling is not None and sampling is self._staged and pbs == self._staged_pbs:
            return
        self._staged, self._staged_pbs = sampling, pbs
        bs = 0 if sampling is None else sampling.temperature.shape[0]
        if sampling is not None:
            for name in ("temperature", "top_p", "top_k", "min_p", "seeds", "greedy"):
                getattr(self, name)[:bs].copy_(getattr(sampling, name))
        self.temperature[bs:pbs].fill_(1.0)
        self.top_p[bs:pbs].fill_(1.0)
        self.min_p[bs:pbs].fill_(0.0)
        self.top_k[bs:pbs].fill_(self.vocab_size)
        self.seeds[bs:pbs].zero_()
        self.greedy[bs:pbs].fill_(True)

    def batch(self, pbs: int, need_filter: bool) -> SamplingBatch:
        return SamplingBatch(self.temperature[:pbs], self.top_p[:pbs], self.top_k[:pbs], self.min_p[:pbs],
                             self.seeds[:pbs], self.greedy[:pbs], all_greedy=False, need_filter=need_filter)
