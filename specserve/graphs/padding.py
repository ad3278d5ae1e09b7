"""The padding contract, in one place, used by every runner (docs/architecture.md).

Fixed-width batches (decode, verify, the draft phases). A runner's static buffers are sized for `max_bs` requests
of `width` tokens. Before a replay at padded batch size `pbs` >= the live batch size `bs`, `stage` copies the live
rows in and fills rows bs..pbs-1 so that they:
  * use request row 0 (the dummy page-table row, all slot 0) and therefore write only KV slot 0;
  * have rope position 0 on every row (all three mRoPE rows);
  * have the minimal sequence length (= width: each padded query sees only dummy keys, never an empty set);
  * have token id 0 and accept index 0.
Every index-type buffer is re-zeroed past the live rows on every replay, so stale rows of an earlier, larger
batch can never leak into this one.

Variable-length batches (prefill, `stage_extend`): a live batch of T tokens is padded to a captured count T':
  * the live requests keep their page-table rows, KV lengths, first tokens and new-token counts;
  * the T' - T padding tokens form one more request on the dummy row: token id 0, position 0, KV slot 0,
    attending to dummy keys only;
  * the request slots after it have no new tokens (their attention programs exit at once).

The whole-step graph (`stage_step`): padded rows take the dummy row, S = 0 and rope position 0, which gives every
phase the minimal sequence length of its width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.batch import extend_starts

if TYPE_CHECKING:
    from specserve.layers.sampler import SamplingBatch

DUMMY_ROW = 0  # the page-table row (all slot 0), KV slot and state row that padded rows use; never handed out


@dataclass
class StaticBuffers:
    """One runner's private inputs. Sized by tokens (max_bs * width), not requests, where tokens are meant."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] or mRoPE [3, max_tokens] int64
    req_pool_indices: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int64
    accept_len: torch.Tensor  # [max_bs] int64 (draft extend: row to select)
    hidden: torch.Tensor | None  # [max_tokens, H] (draft phases)

    @staticmethod
    def allocate(max_bs: int, width: int, hidden_size: int | None, hidden_dtype: torch.dtype, mrope: bool,
                 device: torch.device) -> StaticBuffers:
        t = max_bs * width
        z = lambda *s: torch.zeros(s, dtype=torch.int64, device=device)
        return StaticBuffers(
            input_ids=z(t),
            positions=z(3, t) if mrope else z(t),
            req_pool_indices=z(max_bs),
            seq_lens=torch.full((max_bs,), width, dtype=torch.int64, device=device),
            accept_len=z(max_bs),
            hidden=None if hidden_size is None else torch.zeros((t, hidden_size), dtype=hidden_dtype,
                                                                  device=device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


@dataclass
class LiveInputs:
    """A phase's live inputs for `batch_size` requests of `width` tokens each."""

    batch_size: int
    input_ids: torch.Tensor  # [bs * w]
    positions: torch.Tensor  # [bs * w] or [3, bs * w]
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs] KV length after this phase's (first) forward
    max_seq_len: int  # host upper bound on seq_lens (+ steps for the draft loop)
    accept_len: torch.Tensor | None = None  # [bs]
    hidden: torch.Tensor | None = None  # [bs * w, H]
    # draft phases run inline in the one-graph spec step: the rows' sampling, to draw drafts from the head's own
    # distribution (layers/sampler.py SamplingBatch; None: deterministic drafts). Never staged into a phase graph.
    draft_sampling: SamplingBatch | None = None


def stage(buf: StaticBuffers, live: LiveInputs, pbs: int, width: int) -> None:
    """Copy live inputs into the runner's buffers and pad rows bs..pbs-1 by the contract above."""
    bs = live.batch_size
    nt, pt = bs * width, pbs * width
    buf.input_ids[:nt].copy_(live.input_ids)
    buf.input_ids[nt:pt].zero_()
    if buf.positions.dim() == 2:
        # mRoPE buffer: live 3-row positions keep their per-row (multimodal) offsets; 1-D text positions are
        # broadcast to all three rows.
        src = live.positions if live.positions.dim() == 2 else live.positions[None, :].expand(3, nt)
        buf.positions[:, :nt].copy_(src)
        buf.positions[:, nt:pt].zero_()
    else:
        src = live.positions if live.positions.dim() == 1 else live.positions[0]
        buf.positions[:nt].copy_(src)
        buf.positions[nt:pt].zero_()
    buf.req_pool_indices[:bs].copy_(live.req_pool_indices)
    buf.req_pool_indices[bs:pbs].fill_(DUMMY_ROW)
    buf.seq_lens[:bs].copy_(live.seq_lens)
    buf.seq_lens[bs:pbs].fill_(width)
    if live.accept_len is not None:
        buf.accept_len[:bs].copy_(live.accept_len)
    buf.accept_len[bs:pbs].zero_()
    if buf.hidden is not None and live.hidden is not None:
        buf.hidden[:nt].copy_(live.hidden)


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
    # [T, H] a batch with image requests: the input embeddings (image rows from the vision encoder); eager only
    input_embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class ExtendBuffers:
    """A prefill runner's private inputs: `max_tokens` tokens and the metadata of `max_rows` requests + the padding
    request."""

    input_ids: torch.Tensor  # [max_tokens]
    positions: torch.Tensor  # [max_tokens]
    out_cache_loc: torch.Tensor  # [max_tokens]
    hidden: torch.Tensor | None  # [max_tokens, F] (drafts)
    meta: torch.Tensor  # [4, max_rows + 1]: rows, KV lengths, first tokens, new tokens

    @staticmethod
    def allocate(max_tokens: int, max_rows: int, hidden_width: int | None, dtype: torch.dtype,
                 device: torch.device) -> ExtendBuffers:
        z = lambda *s: torch.zeros(s, dtype=torch.int64, device=device)
        t = max(max_tokens, 1)
        return ExtendBuffers(z(t), z(t), z(t),
                             None if hidden_width is None else torch.zeros((t, hidden_width), dtype=dtype,
                                                                          device=device),
                             z(4, max_rows + 1))


def stage_extend(buf: ExtendBuffers, x: ExtendBatch, padded: int) -> None:
    """Copy a live prefill batch in and pad it to `padded` tokens (module docstring)."""
    nt, n, r = x.num_tokens, len(x.rows), buf.meta.shape[1]
    for dst, live in ((buf.input_ids, x.input_ids), (buf.positions, x.positions),
                      (buf.out_cache_loc, x.out_cache_loc), (buf.hidden, x.hidden)):
        if dst is None:
            continue
        dst[:nt].copy_(live)
        dst[nt:padded].zero_()
    starts = extend_starts(x.extend_lens)
    pad, idle = padded - nt, r - n - 1
    host = torch.tensor([x.rows + [DUMMY_ROW] * (idle + 1),  # the padding request is on the dummy row
                         x.seq_lens + [pad] + [0] * idle,
                         starts + [nt] + [padded] * idle,
                         x.extend_lens + [pad] + [0] * idle], dtype=torch.int64)  # [4, max_rows + 1]
    buf.meta.copy_(host, non_blocking=True)


def stage_step(buf: torch.Tensor, rows: list[int], seq_lens: list[int], pos0: list[int], pbs: int,
               cont: list[bool] | None = None) -> None:
    """The whole-step graph's inputs [4, max_bs] (page-table row, S, rope position of S, whether the step takes S and
    its position from the row's previous step on the device instead: the overlap schedule's rows in flight) for a
    padded batch; padded rows never continue."""
    n = len(pad := [DUMMY_ROW] * (pbs - len(rows)))
    flags = [int(c) for c in cont] if cont is not None else [0] * len(rows)
    host = torch.tensor([rows + pad, seq_lens + [0] * n, pos0 + [0] * n, flags + [0] * n], dtype=torch.int64)
    buf[:, :pbs].copy_(host, non_blocking=True)
