"""The forward steps the scheduler runs: prefill (target extend, + the worker's draft extend when speculating),
plain decode, and the speculative step (the worker's).

Each step takes requests whose KV capacity the scheduler has already ensured, runs on the device, and returns the
new tokens as host lists (the one host sync of a step), or, launched (`launch_*`), as device tensors for the overlap
schedule to read later (engine/overlap.py). Request bookkeeping stays in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.graphs.padding import ExtendBatch, LiveInputs
from specserve.layers.sampler import SamplingBatch, sample
from specserve.speculative.worker import SpecStepResult


@dataclass
class Chunk:
    req: Req
    start: int  # first sequence index prefilled now
    end: int  # one past the last

    @property
    def is_final(self) -> bool:
        return self.end == self.req.prefill_len


def sampling_batch(mr: ModelRunner, reqs: list[Req]) -> SamplingBatch:
    return SamplingBatch.build([r.sampling for r in reqs], [r.seed for r in reqs], mr.cfg.vocab_size, mr.device)


@torch.inference_mode()
def run_prefill(mr: ModelRunner, chunks: list[Chunk]) -> list[int | None]:
    """launch_prefill, read back at once (the step's host sync): t0 per chunk (None for non-final chunks)."""
    t0 = launch_prefill(mr, chunks)
    out: list[int | None] = [None] * len(chunks)
    if t0 is not None:
        final = [i for i, c in enumerate(chunks) if c.is_final]
        for i, tok in zip(final, t0.tolist()):
            out[i] = tok
    return out


@torch.inference_mode()
def launch_prefill(mr: ModelRunner, chunks: list[Chunk]) -> torch.Tensor | None:
    """Target extend over the chunks; for final chunks sample t0 (left on the device as the rows' last tokens); with
    a drafter, the worker's draft extend over the same positions (prompt shifted left by one, t0 appended) fills the
    draft KV and produces d1 and its hidden state. Returns t0 [F] of the final chunks in chunk order on the device,
    without waiting for it (None when no chunk is final)."""
    dev = mr.device
    table = mr.req_to_token.table
    ids_host, pos_host, rows, seq_lens, ext = [], [], [], [], []
    loc_rows, loc_cols = [], []
    for c in chunks:
        fill = c.req.fill_ids
        ids_host.extend(fill[c.start:c.end])
        pos_host.extend(range(c.start, c.end))  # text prompt: rope position = sequence index
        rows.append(c.req.kv.row)
        seq_lens.append(c.end)
        ext.append(c.end - c.start)
        loc_rows.extend([c.req.kv.row] * (c.end - c.start))
        loc_cols.extend(range(c.start, c.end))
    input_ids = torch.tensor(ids_host, dtype=torch.int64).to(dev, non_blocking=True)
    positions = torch.tensor(pos_host, dtype=torch.int64).to(dev, non_blocking=True)
    loc_r, loc_c = torch.tensor(loc_rows, device=dev), torch.tensor(loc_cols, device=dev)
    out_loc = table[loc_r, loc_c]
    spec = mr.spec
    if spec is not None:
        spec.record_tokens(loc_r, loc_c, input_ids)  # the token history of context lookup drafting
    batch = ExtendBatch(input_ids, positions, out_loc, rows, seq_lens, ext)
    hidden = mr.prefill.run(batch)  # [T, F] (a graph's output: used before the next prefill)

    ends = torch.tensor(ext, device=dev).cumsum(0) - 1  # last token of each chunk
    final = [i for i, c in enumerate(chunks) if c.is_final]
    t0 = fidx = frows = new_pos = None
    if final:
        fidx = ends[torch.tensor(final, device=dev)]
        logits = mr.target.compute_logits(hidden[fidx])  # [F, V]
        freqs = [chunks[i].req for i in final]
        new_pos = torch.tensor([chunks[i].end for i in final], dtype=torch.int64, device=dev)
        t0 = sample(logits, sampling_batch(mr, freqs), new_pos)  # [F]
        frows = torch.tensor([chunks[i].req.kv.row for i in final], device=dev)
        mr.last_token[frows] = t0
        if spec is not None:
            spec.record_tokens(frows, new_pos, t0)

    if spec is not None:
        # Draft input at position p is (hidden_p, token_{p+1}): shift each chunk left by one and append the next
        # prompt token, or t0 for a final chunk.
        shifted = []
        for c in chunks:
            fill = c.req.fill_ids
            shifted.extend(fill[c.start + 1:c.end])
            shifted.append(fill[c.end] if not c.is_final else 0)
        draft_ids = torch.tensor(shifted, dtype=torch.int64).to(dev, non_blocking=True)
        if final:
            draft_ids[fidx] = t0
        spec.prefill_draft(batch, draft_ids, hidden, fidx, frows, new_pos)
    return t0


@torch.inference_mode()
def run_decode(mr: ModelRunner, reqs: list[Req]) -> list[int]:
    """Plain decode, read back at once (the step's host sync)."""
    return launch_decode(mr, reqs).tolist()


@torch.inference_mode()
def launch_decode(mr: ModelRunner, reqs: list[Req]) -> torch.Tensor:
    """Plain decode: one token per request — as one graph (decode, sampling, last-token update) when the batch fits
    the plain-step graphs, else through the decode runner (graph), then sampling. Returns the tokens [bs] on the
    device without waiting for them (a graph's static output: read or copy it before the next step)."""
    sb = mr.decode_sampling.get(reqs)
    one = mr.plain_step
    if one is not None and one.covers(len(reqs), sb):
        return one.run([r.kv.row for r in reqs], [r.seq_len for r in reqs],
                       [r.seq_len + r.mrope_delta for r in reqs], sb)
    dev = mr.device
    rows = torch.tensor([r.kv.row for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
    s_host = [r.seq_len for r in reqs]
    s = torch.tensor(s_host, dtype=torch.int64).to(dev, non_blocking=True)
    live = LiveInputs(batch_size=len(reqs), input_ids=mr.last_token[rows], positions=s + rope_offsets(reqs, dev),
                      req_pool_indices=rows, seq_lens=s + 1, max_seq_len=max(s_host) + 1)
    logits = mr.runners["decode"].run(live)["logits"]
    tokens = sample(logits, sb, s + 1)
    mr.last_token[rows] = tokens
    return tokens


@torch.inference_mode()
def run_spec_step(mr: ModelRunner, reqs: list[Req], plain: bool = False) -> SpecStepResult:
    """One speculative step for every running request, by the worker (DESIGN §1); plain: the worker's plain step
    instead (one token each, the draft kept in step; adaptive speculation)."""
    step = mr.spec.plain_step if plain else mr.spec.step
    return step([r.kv.row for r in reqs], [r.seq_len for r in reqs], [r.seq_len + r.mrope_delta for r in reqs],
                mr.decode_sampling.get(reqs))


def rope_offsets(reqs: list[Req], dev: torch.device) -> torch.Tensor | int:
    """mRoPE position offsets of generated text (0 for text-only requests: no tensor needed)."""
    if all(r.mrope_delta == 0 for r in reqs):
        return 0
    return torch.tensor([r.mrope_delta for r in reqs], dtype=torch.int64, device=dev)
