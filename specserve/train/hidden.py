"""Target states for training: the target's features at every position (its final-norm hidden state h_p, what
the engine hands the drafter, followed by the outputs of the aux layers an EAGLE-3 style head reads) and the
target's greedy next token argmax(lm_head(h_p)) (what greedy verification compares drafts with).

Two sources with one interface, `batch(idx, ids) -> (features [B, L, F], top1 [B, L])`:
  * HiddenStore: computed once with our own target under no_grad over padded batches (training attention backend,
    causal mask) and kept per sequence, so training steps do not pay for the target's forward;
  * LiveTargetStates: the target's forward per training batch, for data whose features do not fit in memory
    (a large corpus's features of several target layers run to tens of GB); on a GPU the target's forward per
    training step costs little next to the step itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from tqdm import tqdm

from specserve.batch import ForwardMode
from specserve.train.attention import TrainAttentionBackend, causal_mask, train_forward_batch

_LOGIT_ROWS = 4096  # lm-head rows per chunk when taking the greedy tokens (bounds the [rows, V] logits)


@dataclass
class HiddenStore:
    hidden: list[torch.Tensor]  # per sequence [len, F] target features
    top1: list[torch.Tensor]  # per sequence [len] int64: target greedy token following each position

    @property
    def num_tokens(self) -> int:
        return sum(t.shape[0] for t in self.top1)

    def subset(self, idx: list[int]) -> HiddenStore:
        return HiddenStore([self.hidden[i] for i in idx], [self.top1[i] for i in idx])

    def batch(self, idx: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences idx (ids [B, L] right-padded, on the training device) -> features [B, L, F], top1 [B, L]
        (zero-padded to ids' length, on the store's device)."""
        n = ids.shape[1]
        hidden = pad_sequence([self.hidden[i] for i in idx], batch_first=True)  # [B, longest, F]
        top1 = pad_sequence([self.top1[i] for i in idx], batch_first=True)
        return F.pad(hidden, (0, 0, 0, n - hidden.shape[1])), F.pad(top1, (0, n - top1.shape[1]))


@dataclass
class LiveTargetStates:
    """The same as HiddenStore.batch, computed by the target for each batch (padding positions hold whatever the
    target makes of token 0: they are never labels)."""

    target: torch.nn.Module

    def subset(self, idx: list[int]) -> LiveTargetStates:
        return self

    @torch.no_grad()
    def batch(self, idx: list[int], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = target_hidden(self.target, ids)  # [B, L, F]
        return h, greedy_tokens(self.target, h.reshape(-1, h.shape[-1])).view(ids.shape)


def pad_multiple(device: torch.device) -> int:
    """Padded batch lengths are rounded up to this. On CUDA a handful of batch shapes instead of one per length:
    attention and GEMM kernels plan (cuDNN) or tune (Triton) per new shape, which costs as much as a training step
    of a small head."""
    return 64 if device.type == "cuda" else 1


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


def pad_ids(seqs: list[list[int]], device: torch.device, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [B, L] (pad 0; L a multiple of `multiple`) and lengths [B]."""
    n = round_up(max(len(s) for s in seqs), multiple)
    ids = torch.zeros((len(seqs), n), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.int64)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return ids.to(device), lens.to(device)


def greedy_tokens(target: torch.nn.Module, features: torch.Tensor) -> torch.Tensor:
    """The target's greedy token after each row of features [T, F] -> [T] (lm-head in chunks of rows)."""
    return torch.cat([target.compute_logits(features[r:r + _LOGIT_ROWS]).argmax(dim=-1)
                      for r in range(0, features.shape[0], _LOGIT_ROWS)])


@torch.no_grad()
def target_hidden(target: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Our target model over a right-padded batch ids [B, L] -> features [B, L, F] (final-norm hidden, then the aux
    layers' outputs when the target has any: models/base.py CausalLM.set_aux_layers)."""
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
    multiple = pad_multiple(device)
    batches = length_batches([round_up(len(s), multiple) for s in seqs], max_tokens)
    for idx in tqdm(batches, desc="Target hidden states", unit="batch", disable=None):
        ids, lens = pad_ids([seqs[i] for i in idx], device, multiple)
        h, greedy = LiveTargetStates(target).batch(idx, ids)  # [B, L, F], [B, L]
        for b, i in enumerate(idx):
            n = int(lens[b])
            # clone: a slice would keep the whole padded batch alive
            hidden[i] = h[b, :n].to(device=store_device, dtype=store_dtype).clone()
            top1[i] = greedy[b, :n].to(store_device).clone()
    return HiddenStore(hidden, top1)
