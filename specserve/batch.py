"""The plain types every floor shares (docs/architecture.md): ForwardBatch (everything one forward of one model
needs), its modes, the cache kinds, and index helpers for fixed-width and variable-length batches."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


class CacheKind(enum.Enum):
    """What a layer keeps between forwards (docs/architecture.md). Token-indexed kinds share the one page table; the
    recurrent kind is row-indexed (state slots per request row)."""

    MHA = "mha"  # K and V per token (MHA / GQA)
    MLA = "mla"  # one latent row per token (kv_lora_rank + rope dim; no separate V)
    INDEX_KEYS = "index_keys"  # the sparse-attention indexer's key per token
    RECURRENT = "recurrent"  # conv window + SSM state of a linear-attention layer, per request row and slot

    @property
    def token_indexed(self) -> bool:
        return self is not CacheKind.RECURRENT


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill chunk(s): variable new tokens per request
    DECODE = "decode"  # one token per request
    TARGET_VERIFY = "target_verify"  # N + 1 tokens per request
    DRAFT_EXTEND = "draft_extend"  # draft over N + 1 verified positions (fixed width)
    DRAFT_DECODE = "draft_decode"  # one draft token per request, inside the multi-step loop
    IDLE = "idle"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] or mRoPE [3, T] rope positions
    out_cache_loc: torch.Tensor  # [T] KV slot written by each token
    req_pool_indices: torch.Tensor  # [bs] page-table rows
    seq_lens: torch.Tensor  # [bs] KV length after this forward (prefix + new tokens)
    max_seq_len: int  # host bound on seq_lens (static for graph replays)
    width: int | None = None  # tokens per request in fixed-width modes
    extend_lens_cpu: list[int] | None = None  # eager variable-length batches: new tokens per request
    seq_lens_cpu: list[int] | None = None  # eager variable-length batches
    extend_starts: torch.Tensor | None = None  # [bs] graph variable-length batches: first token of each request
    extend_lens: torch.Tensor | None = None  # [bs] graph variable-length batches: new tokens per request
    hidden_in: torch.Tensor | None = None  # [T, H] drafts: the hidden state fed next to each token
    # [T, H] eager extends of vision-language requests: the input embeddings to use instead of embedding input_ids
    # (token embeddings with the image placeholders' rows replaced by the vision encoder's output)
    input_embeds: torch.Tensor | None = None
    # one backend per cache kind of the model, each with this runner's metadata and its pool (attention/)
    backends: Mapping[CacheKind, object] = field(default_factory=dict)

    def backend(self, kind: CacheKind):
        """The backend that serves layers keeping `kind` (a clear error when the runner built none)."""
        try:
            return self.backends[kind]
        except KeyError:
            raise RuntimeError(f"this forward has no {kind.value} backend; the runner builds one per cache kind "
                               "that the model declares (cache_specs)") from None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def fixed_width_kv_index(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """Sequence index of every token of a fixed-width batch: [bs] -> [bs * width].

    Request b's new tokens sit at seq_lens[b] - width .. seq_lens[b] - 1.
    """
    offs = torch.arange(width, device=seq_lens.device, dtype=seq_lens.dtype)
    return (seq_lens[:, None] - width + offs[None, :]).reshape(-1)


def fixed_width_out_cache_loc(table: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                              width: int) -> torch.Tensor:
    """KV slots written by a fixed-width batch, gathered from the page table on the device: [bs * width]."""
    idx = fixed_width_kv_index(seq_lens, width).view(-1, width)  # [bs, w]
    return table[req_pool_indices[:, None], idx].reshape(-1)


def extend_starts(extend_lens: list[int]) -> list[int]:
    """First token of each request of a variable-length batch (the requests' new tokens back to back)."""
    return list(itertools.accumulate(extend_lens, initial=0))[:-1]
