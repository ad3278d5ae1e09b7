"""The forward steps the scheduler runs: prefill (target extend, + the worker's draft extend when speculating), a
plain engine's decode step, and a speculating engine's speculative or plain step (the worker's). Which decode step
runs, and whether overlapped, is engine/decode_plan.py's choice.

Each step takes requests whose KV capacity the scheduler has already ensured, runs on the device, and returns the
new tokens as host lists (the one host sync of a step), or, launched (`launch_*`), as device tensors for the overlap
schedule to read later (engine/overlap.py). Request bookkeeping stays in the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.hidden_states import record_hidden
from specserve.engine.logit_rules import LogitAdjuster, logit_adjuster
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
    cached: int = 0  # positions [0, start) came from the prefix cache at this admission (the request's first chunk)

    @property
    def is_final(self) -> bool:
        return self.end == self.req.prefill_len


def sampling_batch(model_runner: ModelRunner, reqs: list[Req]) -> SamplingBatch:
    return SamplingBatch.build([r.sampling for r in reqs], [r.seed for r in reqs], model_runner.cfg.vocab_size,
                               model_runner.device)


def adjuster(model_runner: ModelRunner, reqs: list[Req]) -> LogitAdjuster | None:
    """The logit rules of a step's requests (engine/logit_rules.py), or None when none carries any."""
    return logit_adjuster(reqs, model_runner.cfg.vocab_size, model_runner.device)


@torch.inference_mode()
def run_prefill(model_runner: ModelRunner, chunks: list[Chunk]) -> list[int | None]:
    """launch_prefill, read back at once (the step's host sync): t0 per chunk (None for non-final chunks); the
    logprobs of the t0 of requests that return them are recorded."""
    final = [i for i, c in enumerate(chunks) if c.is_final]
    adjust = adjuster(model_runner, [chunks[i].req for i in final])
    t0 = launch_prefill(model_runner, chunks, adjust)
    out: list[int | None] = [None] * len(chunks)
    if t0 is not None:
        toks = t0.tolist()
        for i, tok in zip(final, toks):
            out[i] = tok
        if adjust is not None:
            adjust.record_logprobs([[t] for t in toks])
    return out


def prefill_reads_logits(chunks: list[Chunk]) -> bool:
    """Whether a prefill needs the host (a final chunk's request returns logprobs, or a chunk's request its prompt's):
    it is then run and read at once, not launched under the overlap schedule."""
    return any((c.is_final and c.req.return_logprob) or c.req.input_logprobs_pending for c in chunks)


PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are made at once (a [rows, V] float32 block)


def record_prompt_logprobs(model_runner: ModelRunner, chunks: list[Chunk], hidden: torch.Tensor) -> None:
    """The prompt's logprobs of the chunks' requests that ask for them (logprob_start_len >= 0): the token at index
    q gets log_softmax of the target's raw logits at q - 1 (temperature 1, no rules: the model's own distribution, as
    vLLM's prompt logprobs), the first token None. Each token once, whatever the chunking or a retraction's
    re-prefill. hidden [T, F]: the prefill's features in chunk order. One host sync per slice."""
    rows, targets, owners = [], [], []
    start = 0
    for c in chunks:
        req = c.req
        if req.input_logprobs_pending:
            prompt = req.origin_input_ids
            if req.logprob_start_len == 0 and not req.input_logprobs:
                req.input_logprobs.append(None)  # the first token has no context
                req.input_top_logprobs.append(None)
            q = req.logprob_start_len + len(req.input_logprobs)  # the next token owed
            for p in range(max(c.start, q - 1), min(c.end, len(prompt) - 1)):
                rows.append(start + p - c.start)
                targets.append(prompt[p + 1])
                owners.append(req)
        start += c.end - c.start
    for i in range(0, len(rows), PROMPT_LOGPROB_ROWS):
        sl = slice(i, i + PROMPT_LOGPROB_ROWS)
        idx = torch.tensor([rows[sl], targets[sl]], dtype=torch.int64).to(model_runner.device, non_blocking=True)
        lp = torch.log_softmax(model_runner.target.compute_logits(hidden[idx[0]]).float(), dim=-1)  # [R, V]
        chosen = lp.gather(1, idx[1][:, None])[:, 0].tolist()
        k = max(r.top_logprobs_num for r in owners[sl])
        top_v, top_i = (lp.topk(k, dim=-1) if k else (None, None))
        top_v, top_i = (top_v.tolist(), top_i.tolist()) if k else ([], [])
        for j, req in enumerate(owners[sl]):
            req.input_logprobs.append(chosen[j])
            n = req.top_logprobs_num
            req.input_top_logprobs.append(list(zip(top_i[j][:n], top_v[j][:n])) if n else None)


@torch.inference_mode()
def launch_prefill(model_runner: ModelRunner, chunks: list[Chunk], adjust: LogitAdjuster | None | bool = True
                   ) -> torch.Tensor | None:
    """Target extend over the chunks; for final chunks sample t0 (left on the device as the rows' last tokens); with
    a drafter, the worker's draft extend over the same positions (prompt shifted left by one, t0 appended) fills the
    draft KV and produces d1 and its hidden state. Returns t0 [F] of the final chunks in chunk order on the device,
    without waiting for it (None when no chunk is final). adjust: the final chunks' logit rules (True: made here)."""
    dev = model_runner.device
    table = model_runner.req_to_token.table
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
    imaged = any(c.req.images is not None for c in chunks)
    if imaged:  # mRoPE rows of the image requests; text requests' indices on all three rows
        positions = torch.cat([c.req.images.chunk_positions(c.start, c.end, c.req.mrope_delta)
                               if c.req.images is not None
                               else torch.arange(c.start, c.end, dtype=torch.int64)[None].expand(3, -1)
                               for c in chunks], dim=1).to(dev, non_blocking=True)  # [3, T]
    else:
        positions = torch.tensor(pos_host, dtype=torch.int64).to(dev, non_blocking=True)
    loc_r, loc_c = torch.tensor(loc_rows, device=dev), torch.tensor(loc_cols, device=dev)
    out_loc = table[loc_r, loc_c]
    spec = model_runner.spec
    if spec is not None:
        spec.record_tokens(loc_r, loc_c, input_ids)  # the token history of context lookup drafting
        _record_cached_tokens(spec, chunks, dev)
    embeds = image_embeds(model_runner, chunks, input_ids, 0) if imaged else None
    batch = ExtendBatch(input_ids, positions, out_loc, rows, seq_lens, ext, input_embeds=embeds)
    hidden = model_runner.prefill.run(batch)  # [T, F] (a graph's output: used before the next prefill)
    _keep_prefill_hidden(chunks, hidden, model_runner.cfg.hidden_size)
    if any(c.req.input_logprobs_pending for c in chunks):
        record_prompt_logprobs(model_runner, chunks, hidden)

    ends = torch.tensor(ext, device=dev).cumsum(0) - 1  # last token of each chunk
    final = [i for i, c in enumerate(chunks) if c.is_final]
    t0 = fidx = frows = new_pos = None
    if final:
        fidx = ends[torch.tensor(final, device=dev)]
        logits = model_runner.target.compute_logits(hidden[fidx])  # [F, V]
        freqs = [chunks[i].req for i in final]
        new_pos = torch.tensor([chunks[i].end for i in final], dtype=torch.int64, device=dev)
        if adjust is True:
            adjust = adjuster(model_runner, freqs)
        if adjust is not None:
            logits = adjust(logits[:, None])[:, 0]
        t0 = sample(logits, sampling_batch(model_runner, freqs), new_pos, masked=adjust is not None)  # [F]
        frows = torch.tensor([chunks[i].req.kv.row for i in final], device=dev)
        model_runner.last_token[frows] = t0
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
        # the draft's input at p embeds token p + 1: where that is an image token, the encoder's row for it (the
        # target's input embedding there), as the target saw it
        draft_embeds = image_embeds(model_runner, chunks, draft_ids, 1, spec.draft.embed) if imaged else None
        spec.prefill_draft(batch, draft_ids, hidden, fidx, frows, new_pos, draft_embeds)
    return t0


def image_embeds(model_runner: ModelRunner, chunks: list[Chunk], input_ids: torch.Tensor, shift: int,
                 embed=None) -> torch.Tensor:
    """Input embeddings [T, H] of a prefill batch with image requests: the tokens' embeddings, with each image
    token's row (sequence index in [start + shift, end + shift) of its chunk) replaced by the vision encoder's row for
    it. shift 0: the target's input; 1: the draft's (each chunk shifted left by one; embed: the draft's own token
    embedding, used for its text rows). Each request's images are encoded once, at its first chunk, and kept on its
    RequestImages."""
    target = model_runner.target
    embeds = (embed or target.embed_tokens)(input_ids)  # [T, H]
    dst, src = [], []
    start = 0
    for c in chunks:
        imgs = c.req.images
        if imgs is not None:
            if imgs.embeds is None:
                imgs.embeds = target.encode_images(imgs.pixel_values, imgs.grid_thw).to(embeds.dtype)
            rows, which = imgs.chunk_rows(c.start + shift, c.end + shift)
            if rows.numel():
                dst.append(rows + start)
                src.append((imgs.embeds, which))
        start += c.end - c.start
    for d, (table, which) in zip(dst, src):
        embeds[d.to(embeds.device)] = table[which.to(table.device)]
    return embeds


def _record_cached_tokens(spec, chunks: list[Chunk], dev: torch.device) -> None:
    """Context lookup's token history over the prefixes prefix-cache hits skipped (the prefill writes the rest)."""
    hit = [c for c in chunks if c.cached]
    if not hit:
        return
    rows = [c.req.kv.row for c in hit for _ in range(c.cached)]
    cols = [p for c in hit for p in range(c.cached)]
    toks = [t for c in hit for t in c.req.fill_ids[:c.cached]]
    spec.record_tokens(torch.tensor(rows, device=dev), torch.tensor(cols, device=dev),
                       torch.tensor(toks, dtype=torch.int64).to(dev, non_blocking=True))


def _keep_prefill_hidden(chunks: list[Chunk], hidden: torch.Tensor, hidden_size: int) -> None:
    """The prefill's hidden states [T, F] of the chunks whose requests return them, kept on the host now (the
    graph's output is gone at the next replay): one device sync, only when such a request is in the batch."""
    start = 0
    for c in chunks:
        n = c.end - c.start
        if c.req.return_hidden_states:
            # a copy (on a CPU too: the prefill graph's output is rewritten by the next prefill)
            record_hidden(c.req, c.start, hidden[start:start + n, :hidden_size].to("cpu", torch.float32, copy=True))
        start += n


@torch.inference_mode()
def run_decode(model_runner: ModelRunner, reqs: list[Req]) -> list[int]:
    """A plain engine's decode step, read back at once (the step's host sync); logprobs recorded."""
    adjust = adjuster(model_runner, reqs)
    tokens = launch_decode(model_runner, reqs, adjust).tolist()
    if adjust is not None:
        adjust.record_logprobs([[t] for t in tokens])
    return tokens


@torch.inference_mode()
def launch_decode(model_runner: ModelRunner, reqs: list[Req], adjust: LogitAdjuster | None | bool = True
                  ) -> torch.Tensor:
    """A plain engine's decode step: one token per request — as one graph (decode, sampling, last-token update) when
    the batch fits the decode-step graphs, else through the decode runner (graph), then sampling. Returns the tokens
    [bs] on the device without waiting for them (a graph's static output: read or copy it before the next step).
    adjust: the requests' logit rules (True: made here; their presence runs the step outside the graphs)."""
    sampling = model_runner.decode_sampling.get(reqs)
    graph = model_runner.decode_step_graph
    if adjust is True:
        adjust = adjuster(model_runner, reqs)
    if graph is not None and adjust is None and graph.covers(len(reqs), sampling):
        return graph.run([r.kv.row for r in reqs], [r.seq_len for r in reqs],
                         [r.seq_len + r.mrope_delta for r in reqs], sampling)
    dev = model_runner.device
    rows = torch.tensor([r.kv.row for r in reqs], dtype=torch.int64).to(dev, non_blocking=True)
    seq_lens_host = [r.seq_len for r in reqs]
    seq_lens = torch.tensor(seq_lens_host, dtype=torch.int64).to(dev, non_blocking=True)
    live = LiveInputs(batch_size=len(reqs), input_ids=model_runner.last_token[rows],
                      positions=seq_lens + rope_offsets(reqs, dev), req_pool_indices=rows, seq_lens=seq_lens + 1,
                      max_seq_len=max(seq_lens_host) + 1)
    out = model_runner.phases.decode.run(live)
    if model_runner.step_hidden is not None:
        model_runner.step_hidden.write(rows, out["hidden"])
    logits = out["logits"] if adjust is None else adjust(out["logits"][:, None])[:, 0]
    tokens = sample(logits, sampling, seq_lens + 1, masked=adjust is not None)
    model_runner.last_token[rows] = tokens
    return tokens


@torch.inference_mode()
def run_spec_step(model_runner: ModelRunner, reqs: list[Req]) -> SpecStepResult:
    """One speculative step for every running request, by the worker (speculative/worker.py SpecWorker.step)."""
    adjust = adjuster(model_runner, reqs)
    res = model_runner.spec.step([r.kv.row for r in reqs], [r.seq_len for r in reqs],
                                 [r.seq_len + r.mrope_delta for r in reqs], model_runner.decode_sampling.get(reqs),
                                 adjust)
    if adjust is not None:
        adjust.record_logprobs(res.tokens)
    return res


@torch.inference_mode()
def run_plain_step(model_runner: ModelRunner, reqs: list[Req]) -> SpecStepResult:
    """Adaptive speculation's plain step for every running request (one token each, no draft forward: the draft
    lags), by the worker (SpecWorker.plain_step)."""
    adjust = adjuster(model_runner, reqs)
    res = model_runner.spec.plain_step([r.kv.row for r in reqs], [r.seq_len for r in reqs],
                                       [r.seq_len + r.mrope_delta for r in reqs],
                                       model_runner.decode_sampling.get(reqs), adjust)
    if adjust is not None:
        adjust.record_logprobs(res.tokens)
    return res


def rope_offsets(reqs: list[Req], dev: torch.device) -> torch.Tensor | int:
    """mRoPE position offsets of generated text (0 for text-only requests: no tensor needed)."""
    if all(r.mrope_delta == 0 for r in reqs):
        return 0
    return torch.tensor([r.mrope_delta for r in reqs], dtype=torch.int64, device=dev)
