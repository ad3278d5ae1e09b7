"""The draft head's initialisation and its chained ("training-time test") objective.

Notation for one sequence x_0 .. x_{n-1} with target final-norm hidden states h_i:
  depth 1 at index i:  (h_i, x_{i+1})            -> g_1,i   predicts x_{i+2}
  depth k at index i:  (g_{k-1,i-1}, x_{i+1})    -> g_k,i   predicts x_{i+2}
which is what the engine does at inference (docs/architecture.md): draft step k at index S+k-2 takes the draft's
own hidden state from the step before at the index before, and the previous draft token, which equals the true token
whenever the drafts are accepted. Each depth attends through `chain_mask` to exactly the keys inference would have in
the draft KV cache; gradients flow through all depths.

Labels: with loss "kl" the target's distribution softmax(lm_head(h_{i+1})) restricted to the draft vocabulary
(forward KL); with "ce" the token x_{i+2}. Positions count when x_{i+2} is a response token (the target's own text),
exists, and is learnable (the target's greedy token, resp. x_{i+2}, is inside the draft vocabulary). Top-1 accuracy
is measured against the target's greedy token: the draft token greedy verification would accept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.batch import ForwardMode
from specserve.models.config import ModelConfig
from specserve.models.mtp import MTPDraftModel
from specserve.train.attention import TrainAttentionBackend, chain_mask, train_forward_batch
from specserve.train.vocab import DraftVocab

LOSSES = ("kl", "ce")


@dataclass
class ObjectiveConfig:
    chain_steps: int = 4  # training depth K
    depth_decay: float = 0.8  # loss weight of depth k is depth_decay ** (k - 1)
    loss: str = "kl"


@dataclass
class TrainBatch:
    ids: torch.Tensor  # [B, L] int64, right-padded with 0
    lens: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]
    hidden: torch.Tensor  # [B, L, F] target features: final-norm hidden states [.., :H], then aux layers
    top1: torch.Tensor  # [B, L] target greedy token following each position


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, depth-weighted
    depth_loss: torch.Tensor  # [K] float32 (detached)
    depth_top1: torch.Tensor  # [K] float32 fraction of positions where the draft token = target greedy token
    depth_count: torch.Tensor  # [K] positions counted


# ---------------------------------------------------------------------------------------------------- the head
def build_draft(cfg: ModelConfig, max_positions: int, vocab: DraftVocab, device: torch.device,
                aux_layers: list[int] | None = None) -> MTPDraftModel:
    """An uninitialised draft head in float32 (master weights) on `device`: call init_draft_from_target next.
    aux_layers: target layers whose outputs the head reads beside the final hidden state (models/mtp.py)."""
    dcfg = dataclasses.replace(cfg, aux_hidden_layers=list(aux_layers or []))
    with torch.device(device):
        return MTPDraftModel(dcfg, max_positions, draft_vocab_size=None if vocab.ids is None else vocab.size)


@torch.no_grad()
def init_draft_from_target(draft: MTPDraftModel, target: torch.nn.Module, vocab: DraftVocab, noise_std: float,
                           seed: int, residual_scale: float = 0.0) -> None:
    """Start the head as "the target's own prediction": enorm/hnorm/final_norm = ones, eh_proj passes the hidden
    half through ([noise | I]), and the decoder block is the target's last block with its two residual-branch
    output projections (o_proj, down_proj) scaled by `residual_scale` (0: the block starts as the identity).

    With scale 0 the head outputs h_p / rms(h_p), i.e. the target's distribution for x_{p+1} at a mild temperature:
    a sensible first guess for x_{p+2} (measured on SmolLM2: initial KL ~7.6 against ~39 for an exact copy of the
    last block, and better top-1 after the same steps). The copied q/k/v/gate/up projections give the block useful
    features from the first step; a reduced head starts from the target's lm-head rows of its tokens. With aux
    hidden layers, aux_fc starts as [I | noise]: it passes the final hidden state through, so the head starts as
    the same function, and learns what to take from the other layers."""
    draft.decoder.load_state_dict(target.model.layers[-1].state_dict())
    draft.decoder.self_attn.o_proj.weight.mul_(residual_scale)
    draft.decoder.mlp.down_proj.weight.mul_(residual_scale)
    draft.final_norm.weight.fill_(1.0)
    draft.enorm.weight.fill_(1.0)
    draft.hnorm.weight.fill_(1.0)
    h = draft.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((h, 2 * h), generator=g) * noise_std  # [H, 2H]: columns [embedding | hidden]
    w[:, h:] += torch.eye(h)
    draft.eh_proj.weight.copy_(w)
    if draft.aux_fc is not None:
        fc = torch.randn(draft.aux_fc.weight.shape, generator=g) * noise_std  # [H, (1 + k) H]: [final | aux ..]
        fc[:, :h] = torch.eye(h)
        draft.aux_fc.weight.copy_(fc)
    if vocab.ids is not None:
        draft.lm_head.weight.copy_(target.lm_head.weight[vocab.ids.to(target.lm_head.weight.device)])
        draft.draft_vocab.copy_(vocab.ids)
    draft.share_target(target.embed_tokens, target.lm_head)


@torch.no_grad()
def init_draft_from_checkpoint(draft: MTPDraftModel, target, path: str, max_positions: int) -> None:
    """Overwrite the head's weights with a draft checkpoint's (loaded as the engine loads it, float32), to continue
    a training run. The checkpoint must have the same shapes and draft vocabulary; one without aux hidden layers
    may start a head with them (aux_fc keeps its initialisation: the head starts as the checkpoint's function)."""
    from specserve.models.loader import load_mtp_draft

    src = load_mtp_draft(target, path, torch.float32, draft.eh_proj.weight.device, max_positions)
    if src.aux_layers and src.aux_layers != draft.aux_layers:
        raise ValueError(f"{path}: aux hidden layers {src.aux_layers} differ from the head's {draft.aux_layers}")
    theirs = dict(src.named_parameters()) | dict(src.named_buffers())
    for name, t in list(draft.named_parameters()) + list(draft.named_buffers()):
        other = theirs.get(name)
        if other is None and name.startswith("aux_fc.") and not src.aux_layers:
            continue
        if other is None or other.shape != t.shape:
            raise ValueError(f"{path}: {name} {None if other is None else tuple(other.shape)} does not fit the "
                             f"head being trained ({tuple(t.shape)}): another target or draft vocabulary?")
        if name == "draft_vocab" and not torch.equal(other.to(t.device), t):
            raise ValueError(f"{path}: its draft vocabulary differs from the one built from this data")
        t.copy_(other.to(dtype=t.dtype))


# ---------------------------------------------------------------------------------------------------- forward
def chained_forward(draft: MTPDraftModel, ids: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """ids [B, L] (x), hidden [B, L, F] (the target's features h) -> [g_1, .., g_depth], each [B, L, H] (draft
    final-norm outputs)."""
    b, n, _ = hidden.shape
    h = draft.config.hidden_size
    dev = ids.device
    ids_next = torch.cat((ids[:, 1:], torch.zeros_like(ids[:, :1])), dim=1).reshape(-1)  # [B*L] x_{i+1}
    pos = torch.arange(n, device=dev).repeat(b)  # [B*L] rope position = index, at every depth
    backend = TrainAttentionBackend(b, n, chain_mask(n, 1, dev), keep_keys=True)
    h_in = hidden
    outs = []
    for k in range(1, depth + 1):
        backend.set_mask(chain_mask(n, k, dev))
        mode = ForwardMode.DRAFT_EXTEND if k == 1 else ForwardMode.DRAFT_DECODE
        g = draft(train_forward_batch(mode, ids_next, pos, backend, h_in.reshape(b * n, -1))).view(b, n, h)
        outs.append(g)
        # g_{k,i-1} feeds index i at depth k+1; index 0 has no predecessor (never a valid depth>1 query)
        h_in = torch.cat((torch.zeros_like(g[:, :1]), g[:, :-1]), dim=1)
    return outs


def _shift_left(x: torch.Tensor, by: int, fill: int = 0) -> torch.Tensor:
    """x[:, i + by] at index i (padded with `fill`): [B, L, ...] -> same shape."""
    pad = torch.full_like(x[:, :by], fill)
    return torch.cat((x[:, by:], pad), dim=1)


def chained_loss(draft: MTPDraftModel, batch: TrainBatch, to_draft: torch.Tensor, target_head: torch.Tensor,
                 cfg: ObjectiveConfig) -> LossOutput:
    """Depth-weighted loss of the chained draft over one batch.

    to_draft [V]: target id -> draft index (-1 outside); target_head [Vd, H]: the target's lm-head rows of the draft
    vocabulary (for the KL labels)."""
    ids, dev = batch.ids, batch.ids.device
    b, n = ids.shape
    idx = torch.arange(n, device=dev)[None, :]  # [1, L]
    valid = (idx <= batch.lens[:, None] - 3) & (idx >= batch.prompt_lens[:, None] - 2)  # x_{i+2}: a response token
    greedy_next = to_draft[_shift_left(batch.top1, 1)]  # [B, L] draft index of the target's greedy x_{i+2}
    label = to_draft[_shift_left(ids, 2)]  # [B, L] draft index of x_{i+2}
    valid &= (greedy_next >= 0) if cfg.loss == "kl" else (label >= 0)
    rows = valid.reshape(-1).nonzero().squeeze(1)  # [Nb] flat positions with a label
    row_idx = idx.expand(b, n).reshape(-1)[rows]  # [Nb] their index in the sequence
    greedy_rows = greedy_next.reshape(-1)[rows]  # [Nb]
    if cfg.loss == "kl":
        with torch.no_grad():
            hs = draft.config.hidden_size  # the final hidden state: the first H features
            h_next = _shift_left(batch.hidden[..., :hs], 1).reshape(b * n, -1)[rows]  # [Nb, H] h_{i+1}
            t_logp = F.log_softmax(F.linear(h_next.to(target_head.dtype), target_head).float(), dim=-1)  # [Nb, Vd]
            t_p = t_logp.exp()  # shared by all depths (saved once for backward)
            t_neg_entropy = (t_p * t_logp).sum(-1)  # [Nb]: turns the cross-entropy into the KL
            del t_logp
    else:
        label_rows = label.reshape(-1)[rows]

    outs = chained_forward(draft, ids, batch.hidden, cfg.chain_steps)
    weights = [cfg.depth_decay ** k for k in range(cfg.chain_steps)]
    total = outs[0].new_zeros((), dtype=torch.float32)
    losses, top1s, counts = [], [], []
    for k, g in enumerate(outs, start=1):
        # Depth k at index i needs the chain g_1 .. g_{k-1} at i-k+1 .. i-1. Rows failing that (i < k-1) would
        # sit in the prompt anyway, so all depths share the same rows and only weight them out.
        w = (row_idx >= k - 1).float()  # [Nb]
        cnt = w.sum()
        d_logits = draft.compute_logits(g.reshape(b * n, -1)[rows])  # [Nb, Vd] float32
        d_logp = F.log_softmax(d_logits, dim=-1)
        if cfg.loss == "kl":
            per_row = t_neg_entropy - (t_p * d_logp).sum(-1)  # [Nb] KL(target || draft)
        else:
            per_row = -d_logp.gather(1, label_rows[:, None]).squeeze(1)
        loss_k = (per_row * w).sum() / cnt.clamp(min=1)
        total = total + weights[k - 1] * loss_k
        losses.append(loss_k.detach())
        top1s.append(((d_logits.argmax(-1) == greedy_rows).float() * w).sum() / cnt.clamp(min=1))
        counts.append(cnt)
    return LossOutput(total / sum(weights), torch.stack(losses), torch.stack(top1s), torch.stack(counts))
