"""Target hidden states for training: the final-norm hidden state h_p at every position (what the engine hands the
drafter) and the target's greedy next token argmax(lm_head(h_p)) (what greedy verification compares drafts with).

Computed once with our own target model under no_grad over padded batches (training attention backend, causal
mask) and kept per sequence, so training steps do not pay for the target's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from specserve.engine.forward_batch import ForwardMode
from specserve.train.attention import TrainAttentionBackend, causal_mask, train_forward_batch

_LOGIT_ROWS = 4096  # lm-head rows per chunk when taking the greedy tokens (bounds the [rows, V] logits)


@dataclass
class HiddenStore:
    hidden: list[torch.Tensor]  # per sequence [len, H] target final-norm hidden states
    top1: list[torch.Tensor]  # per sequence [len] int64: target greedy token following each position

    @property
    def num_tokens(self) -> int:
        return sum(t.shape[0] for t in self.top1)


def length_batches(lengths: list[int], max_tokens: int, max_batch: int | None = None) -> list[list[int]]:
    """Indices grouped by similar length so that each padded batch has at most max_tokens (B * L) tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur, cur_max = [], [], 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and (new_max * (len(cur) + 1) > max_tokens or (max_batch and len(cur) >= max_batch)):
            out.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


def pad_ids(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, L] (pad 0) and lengths [B]."""
    n = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), n), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.int64)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return ids.to(device), lens.to(device)


@torch.no_grad()
def target_hidden(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Our target model over a right-padded batch ids [B, L] -> final-norm hidden [B, L, H]."""
    b, n = ids.shape
    backend = TrainAttentionBackend(b, n, causal_mask(n, ids.device))
    pos = torch.arange(n, device=ids.device).repeat(b)  # [B*L] rope position = index
    fb = train_forward_batch(ForwardMode.EXTEND, ids.reshape(-1), pos, backend)
    return target(fb).view(b, n, -1)


@torch.no_grad()
def collect_hidden(target: torch.nn.Module, seqs: list[list[int]], device: torch.device,
                   store_dtype: torch.dtype, store_device: torch.device, max_tokens: int = 16384) -> HiddenStore:
    """Hidden states and greedy tokens for every sequence. Uses no_grad (not inference_mode): the stored tensors are
    inputs of the draft's autograd graph later."""
    hidden: list[torch.Tensor | None] = [None] * len(seqs)
    top1: list[torch.Tensor | None] = [None] * len(seqs)
    batches = length_batches([len(s) for s in seqs], max_tokens)
    for idx in tqdm(batches, desc="Target hidden states", unit="batch", disable=None):
        ids, lens = pad_ids([seqs[i] for i in idx], device)
        h = target_hidden(target, ids)  # [B, L, H]
        flat = h.reshape(-1, h.shape[-1])
        greedy = torch.cat([target.compute_logits(flat[r:r + _LOGIT_ROWS]).argmax(dim=-1)
                            for r in range(0, flat.shape[0], _LOGIT_ROWS)]).view(ids.shape)  # [B, L]
        for b, i in enumerate(idx):
            n = int(lens[b])
            # clone: a slice would keep the whole padded batch alive
            hidden[i] = h[b, :n].to(device=store_device, dtype=store_dtype).clone()
            top1[i] = greedy[b, :n].to(store_device).clone()
    return HiddenStore(hidden, top1)
