"""Where a train-mtp step goes on the GPU: times each part of one training step of the SmolLM2 aux head (live target
states, chained loss forward, backward, optimiser) on synthetic 16k-token batches, then prints torch.profiler's top
kernels and ops for one step. On a CPU it runs a small smoke batch.

    python3 scripts/gpu/profile_train_step.py /tmp/smollm2.gguf specserve/assets/smollm2-135m-mtp [--output-file PATH]

Printed: seconds per part of a step (summed over the timed steps), then torch.profiler's tables sorted by device
time (CPU time on a CPU).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.bench.tee import tee_stdout_to
from specserve.models.loader import ModelSource, load_hf_config, load_target
from specserve.train.hidden import LiveTargetStates
from specserve.train.objective import (
    ObjectiveConfig,
    TrainBatch,
    build_draft,
    chained_loss,
    init_draft_from_checkpoint,
    init_draft_from_target,
)
from specserve.train.vocab import vocab_of_checkpoint


@dataclass
class Step:
    """One training step over a fixed batch ids [B, L], timed per part when `record`."""

    draft: torch.nn.Module
    states: LiveTargetStates
    opt: torch.optim.Optimizer
    to_draft: torch.Tensor
    target_head: torch.Tensor
    ids: torch.Tensor
    dtype: torch.dtype
    timings: dict[str, float] = field(default_factory=dict)

    def _mark(self, name: str, t: float, record: bool) -> float:
        if self.ids.is_cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if record:
            self.timings[name] = self.timings.get(name, 0.0) + now - t
        return now

    def __call__(self, record: bool) -> None:
        b, n = self.ids.shape
        dev = self.ids.device
        t = time.perf_counter()
        hidden, top1 = self.states.batch([], self.ids)
        t = self._mark("target states", t, record)
        batch = TrainBatch(self.ids, torch.full((b,), n, device=dev), torch.full((b,), n // 4, device=dev),
                           hidden.to(self.dtype), top1)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = chained_loss(self.draft, batch, self.to_draft, self.target_head, ObjectiveConfig(chain_steps=4))
        t = self._mark("loss forward", t, record)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        t = self._mark("backward", t, record)
        params = [p for p in self.draft.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.opt.step()
        self._mark("optimiser", t, record)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_path", help="the target (a GGUF file or a Hugging Face folder)")
    p.add_argument("head", help="the draft head's folder (its weights initialise the draft)")
    p.add_argument("--output-file", default=None, help="also write what is printed to this file (text)")
    args = p.parse_args()
    tee_stdout_to(args.output_file)
    model_path, head = args.model_path, args.head
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    max_len = 2048
    src = ModelSource.resolve(model_path)
    target = load_target(src, dtype, dev, max_len + 8, load_hf_config(src))
    target.model.set_aux_layers([1, 14, 26])
    cfg = target.config
    vocab = vocab_of_checkpoint(head, [[1, 2, 3]], cfg.vocab_size)
    draft = build_draft(cfg, max_len + 8, vocab, dev, [1, 14, 26])
    init_draft_from_target(draft, target.model, vocab, 0.01, 0)
    init_draft_from_checkpoint(draft, target, head, max_len + 8)
    draft.lm_head.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-5, fused=cuda)
    g = torch.Generator().manual_seed(0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for b, n in ((8, 2048), (32, 512)) if cuda else ((2, 64),):
        ids = torch.randint(0, 16000, (b, n), generator=g).to(dev)
        step = Step(draft, LiveTargetStates(target.model), opt, vocab.to_draft_index(cfg.vocab_size, dev),
                    target.model.lm_head.weight[vocab.ids.to(dev)], ids, dtype)
        for _ in range(3):
            step(False)
        reps = 5
        for _ in range(reps):
            step(True)
        print(f"\n== batch {b} x {n}: {sum(step.timings.values()) / reps * 1e3:.1f} ms/step ==")
        for k, v in step.timings.items():
            print(f"  {k:14s} {v / reps * 1e3:8.1f} ms")
        with profile(activities=activities) as prof:
            step(False)
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
    # New batch shapes against the same shapes again: the cost of a shape seen for the first time (kernel plans,
    # autotuning), which train-mtp's length-grouped batches paid at nearly every step before padded lengths were
    # rounded up to a multiple of 64.
    lengths = [1999, 1873, 1701, 1533, 1287, 1031, 777, 555] if cuda else [33, 47]
    for attempt in ("first time", "again"):
        for n in lengths:
            ids = torch.randint(0, 16000, (max(1, 16384 // n), n), generator=g).to(dev)
            step = Step(draft, LiveTargetStates(target.model), opt, vocab.to_draft_index(cfg.vocab_size, dev),
                        target.model.lm_head.weight[vocab.ids.to(dev)], ids, dtype)
            step(True)
            print(f"shape {tuple(ids.shape)} {attempt}: {sum(step.timings.values()) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
