"""NextN / MTP draft layer (docs/architecture.md), for every family: its decoder block is the family's own
(`mtp_block`: the family's attention and MLP kind, e.g. the MoE MLP of an MoE target), its weight names the
family's (the hooks of models/base.py CausalLM).

    e = enorm(embed(token_{p+1}))         h = hnorm(hidden_p)        (hidden_p: target's final-norm hidden,
    x = eh_proj([e ; h])                                              or the draft's own output when chaining)
    x = decoder_layer(x)                   (the target family's block, with its own caches)
    out = final_norm(x)  -> lm_head -> logits for token_{p+2}; `out` is also the next chained hidden state.

With aux hidden layers (config `aux_hidden_state_layer_ids`, EAGLE-3 style) the target hands over more than its
final hidden state: features [final | output of layer a_1 | ... | a_k], each block RMS-normalised and projected
back to H by `aux_fc` before hnorm. Only the first draft step of a chain (DRAFT_EXTEND: prefill and the draft
extend after verify) sees target features; the chained steps (DRAFT_DECODE) get the draft's own H-wide output.
Why: the final hidden state is shaped to predict one token and carries little of the current one, so a one-layer
head cannot copy from the context; an early layer's output still encodes the token at each position (what an
induction-style copy needs), a middle one the phrase.

Embedding and lm-head are the target's unless the draft checkpoint ships its own. A draft checkpoint may also
carry a reduced draft vocabulary (`draft_vocab` [Vd] of target ids), which shrinks the per-step lm-head cost.

Checkpoint layouts read by `load_weights`:
  * DeepSeek-V3 / GLM: `model.layers.{L}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,embed_tokens}`
    and the block's own `model.layers.{L}.{self_attn,mlp,input_layernorm,post_attention_layernorm}.*`
    (L = num_hidden_layers in a target checkpoint; the single layer index in a separate draft folder).
  * Qwen3-Next / Qwen3.5: `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}` and `mtp.layers.0.*`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.batch import ForwardBatch, ForwardMode
from specserve.kernels import ops
from specserve.kvcache.cache_spec import CacheSpec
from specserve.layers.embedding import LMHead, VocabEmbedding
from specserve.layers.linear import Linear
from specserve.models import tensor_loading
from specserve.models.config import ModelConfig
from specserve.models.registry import model_class

_DEEPSEEK_HEAD = {
    "aux_fc": "aux_fc", "enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "final_norm",
    "shared_head.head": "lm_head", "embed_tokens": "embed_tokens",
}
_QWEN_NEXT_HEAD = {
    "fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "final_norm",
}


class MTPDraftModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, own_embed: bool = False, own_head: bool = False,
                 draft_vocab_size: int | None = None):
        super().__init__()
        self.config = cfg
        # the target's family (models/base.py CausalLM hooks): its block, norms, rotary and weight names
        self.family = model_class(cfg.architecture)
        hidden_size = cfg.hidden_size
        self.enorm = self.family.make_norm(cfg, hidden_size)
        self.hnorm = self.family.make_norm(cfg, hidden_size)
        self.eh_proj = Linear(2 * hidden_size, hidden_size)
        self.rotary = self.family.make_rotary(cfg, max_positions)
        self.decoder = self.family.mtp_block(cfg, self.rotary)
        self.final_norm = self.family.make_norm(cfg, hidden_size)
        self.aux_layers = list(cfg.aux_hidden_layers)
        if self.aux_layers != sorted(set(self.aux_layers)) or any(i < 0 for i in self.aux_layers):
            raise ValueError(f"aux_hidden_state_layer_ids must be increasing layer indices, got {self.aux_layers}")
        # [(1 + k) H] target features -> [H]; None: the draft reads the final hidden state only
        self.aux_fc = Linear((1 + len(self.aux_layers)) * hidden_size, hidden_size) if self.aux_layers else None
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, hidden_size) if own_embed else None
        head_rows = draft_vocab_size or cfg.vocab_size
        self.lm_head = LMHead(head_rows, hidden_size) if (own_head or draft_vocab_size) else None
        if draft_vocab_size:
            # draft index -> target token id; a buffer so it moves with .to(device)
            self.register_buffer("draft_vocab", torch.arange(head_rows, dtype=torch.int64))
        else:
            self.draft_vocab = None
        self._shared: tuple[VocabEmbedding, LMHead] | None = None
        # the hidden state chained into the next draft step: after the final norm (False) or before it (True);
        # engines disagree (issue 14), so it is a serving choice (--speculative-mtp-chain)
        self.chain_prenorm = False

    def share_target(self, embed: VocabEmbedding, lm_head: LMHead) -> None:
        # Kept outside the module tree so the target's weights are not registered (or saved) twice.
        self._shared = (embed, lm_head)

    def set_chain_prenorm(self, prenorm: bool) -> None:
        """Chain the pre-norm residual stream instead of the normed output: forward() then returns [normed |
        pre-norm] [T, 2H]; logits read the first half, `chained` the second."""
        self.chain_prenorm = prenorm

    def chained(self, out: torch.Tensor) -> torch.Tensor:
        """forward()'s output -> the hidden state fed to the next draft step [..., H]."""
        return out[..., self.config.hidden_size:] if self.chain_prenorm else out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self._shared[0])(ids)

    @property
    def head(self) -> LMHead:
        """The LM head the draft's logits come from: its own, or the target's it shares."""
        return self.lm_head or self._shared[1]

    def cache_specs(self) -> list[CacheSpec]:
        """The draft's own caches: its block's (kvcache/cache_spec.py)."""
        return self.decoder.cache_specs()

    @property
    def feature_size(self) -> int:
        """Width of the target features this draft reads (hidden_in of a DRAFT_EXTEND batch)."""
        return self.config.hidden_size * (1 + len(self.aux_layers))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """fb.input_ids [T] (token at p+1), fb.hidden_in (at p): target features [T, feature_size] in DRAFT_EXTEND,
        the draft's own output [T, H] in DRAFT_DECODE -> draft hidden [T, H]."""
        embedded = self.enorm(self.embed(fb.input_ids) if fb.input_embeds is None else fb.input_embeds)
        hidden = fb.hidden_in.to(embedded.dtype)
        if self.aux_fc is not None and fb.mode is ForwardMode.DRAFT_EXTEND:
            num_tokens, hidden_size = hidden.shape[0], self.config.hidden_size
            blocks = F.rms_norm(hidden.view(num_tokens, -1, hidden_size), (hidden_size,),
                                eps=self.config.rms_norm_eps)  # [T, 1 + k, H]
            hidden = self.aux_fc(blocks.reshape(num_tokens, -1))  # [T, H]
        hidden = self.eh_proj(torch.cat((embedded, self.hnorm(hidden)), dim=-1))
        hidden, residual = self.decoder(fb.positions, hidden, None, fb)
        normed, stream = self.final_norm(hidden, residual)  # stream: the residual sum the norm reads
        return torch.cat((normed, stream), dim=-1) if self.chain_prenorm else normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] (or forward()'s [T, 2H] with chain_prenorm: its normed half) -> [T, Vd] float32 (Vd = the draft
        vocabulary, the target's unless reduced)."""
        hidden_size = self.config.hidden_size
        if hidden.shape[-1] != hidden_size:
            hidden = hidden[..., :hidden_size].contiguous()
        return self.head(hidden)

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Propose only the target tokens `ids` [Vd] (int64, ascending; models/token_map.py): the head becomes
        those rows of the current one (its own or the target's it shares), a copy of Vd x H, so a draft step's
        lm-head reads Vd / V of the bytes. Call before graphs are captured."""
        if self.draft_vocab is not None:
            raise ValueError(f"the draft head already has a reduced vocabulary of {self.draft_vocab.numel()} tokens "
                             "(its checkpoint's draft_vocab); a token map cannot replace it")
        source = self.head
        if type(source) is not LMHead:  # a vocab-parallel head holds 1 / tp of the rows
            raise ValueError(f"a token map needs the whole lm-head on this rank, not a {type(source).__name__}")
        weight = source.weight
        ids = ids.to(device=weight.device, dtype=torch.int64)
        head = LMHead(ids.numel(), self.config.hidden_size).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight[ids])
        self.lm_head = head.requires_grad_(False)
        del self.draft_vocab  # the plain None attribute, replaced by a buffer that moves with the module
        self.register_buffer("draft_vocab", ids)

    def draft_vocab_size(self) -> int:
        """Vd: the tokens the head can propose (its reduced vocabulary, else the target's)."""
        return self.draft_vocab.numel() if self.draft_vocab is not None else self.config.vocab_size

    def draft_candidates(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's k most likely tokens for hidden [T, H] -> (logits [T, k] float32 descending, target ids
        [T, k], logsumexp of all its logits [T]): what a sampled draft is drawn from (k <= draft_vocab_size())."""
        logits = self.compute_logits(hidden)  # [T, Vd]
        vals, idx = ops.row_topk(logits, k)
        ids = idx if self.draft_vocab is None else self.draft_vocab[idx]
        return vals, ids, torch.logsumexp(logits, dim=-1)

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft token ids (target vocabulary) for hidden [T, H] -> [T]. Drafts are deterministic: the
        verifier treats the draft distribution as one-hot (docs/architecture.md)."""
        return ops.row_top1(self.compute_logits(hidden), self.draft_vocab)[0]

    def draft_tokens_and_confidence(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """draft_tokens, plus the head's probability of each: hidden [T, H] -> ids [T], top probability [T]."""
        return ops.row_top1(self.compute_logits(hidden), self.draft_vocab, with_prob=True)  # [T, Vd] logits

    # ------------------------------------------------------------------ loading
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], layer_index: int | None) -> set[str]:
        """Load the MTP tensors among `weights` (other names are skipped). `layer_index`: L for the DeepSeek
        layout inside a target checkpoint; None in a draft folder (the one layer index present is used)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            ours = self.map_name(name, layer_index)
            if ours is None:
                continue
            if ours == "draft_vocab":
                self.draft_vocab.copy_(tensor.to(torch.int64))
                loaded.add(ours)
                continue
            target, tensor = tensor_loading.load_fp8_or_plain(self, ours, tensor)
            if target is None:
                target = self.family.load_tensor(self, params, ours, tensor)
            if target is None:
                raise ValueError(f"MTP tensor {name!r} (as {ours!r}) matches no draft parameter")
            loaded.add(target)
        loaded = self.family.finish_loading(self, loaded)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"MTP checkpoint lacks: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        return loaded

    def map_name(self, name: str, layer_index: int | None) -> str | None:
        if name in ("draft_vocab", "d2t_ids"):
            return "draft_vocab"
        match = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
        if match:
            if layer_index is not None and int(match.group(1)) != layer_index:
                return None
            return self._map_rest(match.group(2), _DEEPSEEK_HEAD)
        match = re.match(r"mtp\.layers\.0\.(.+)$", name)
        if match:
            return self._map_rest(match.group(1), {})
        match = re.match(r"mtp\.(.+)$", name)
        if match:
            return self._map_rest(match.group(1), _QWEN_NEXT_HEAD)
        if layer_index is None and name == "model.embed_tokens.weight":
            return "embed_tokens.weight"
        if layer_index is None and name == "lm_head.weight":
            return "lm_head.weight"
        return None

    @staticmethod
    def _map_rest(rest: str, head_map: dict[str, str]) -> str:
        for src, dst in head_map.items():
            if rest.startswith(src + "."):
                return dst + rest[len(src):]
        return "decoder." + rest
