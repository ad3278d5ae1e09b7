"""The padding contract, in one place, used by every phase runner (DESIGN §3).

A runner's static buffers are sized for `max_bs` requests of `width` tokens. Before a replay at padded batch size
`pbs` >= the live batch size `bs`, `stage` copies the live rows in and fills rows bs..pbs-1 so that they:
  * use request row 0 (the dummy page-table row, all slot 0) and therefore write only KV slot 0;
  * have rope position 0 on every row (all three mRoPE rows);
  * have the minimal sequence length (= width: each padded query sees only dummy keys, never an empty set);
  * have token id 0 and accept index 0.
Every index-type buffer is re-zeroed past the live rows on every replay, so stale rows of an earlier, larger
batch can never leak into this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    buf.req_pool_indices[bs:pbs].zero_()
    buf.seq_lens[:bs].copy_(live.seq_lens)
    buf.seq_lens[bs:pbs].fill_(width)
    if live.accept_len is not None:
        buf.accept_len[:bs].copy_(live.accept_len)
    buf.accept_len[bs:pbs].zero_()
    if buf.hidden is not None and live.hidden is not None:
        buf.hidden[:nt].copy_(live.hidden)
