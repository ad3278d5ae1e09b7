"""A generation request and its life in the scheduler."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from specserve.engine.logit_rules import RowRules
from specserve.engine.sampling_params import SamplingParams
from specserve.kvcache.manager import KVHandle
from specserve.multimodal.request_images import RequestImages


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV
    PREFILLING = "prefilling"  # part of its prompt has KV (chunked prefill)
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler's list membership tests must not compare every field
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    kv: KVHandle = field(default_factory=KVHandle)
    seq_len: int = 0  # tokens whose K/V (target and draft) are written
    prefill_len: int = 0  # tokens to prefill: the prompt, plus outputs after a retraction
    cached_tokens: int = 0  # prompt tokens the prefix cache gave at its (last) admission (meta_info.cached_tokens)
    mrope_delta: int = 0  # rope position = sequence index + delta for generated text (mRoPE models)
    images: RequestImages | None = None  # a vision-language request's images (multimodal/request_images.py)
    finished_reason: dict | None = None
    # speculative statistics
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    # timing
    first_token_time: float | None = None
    finish_time: float | None = None
    retractions: int = 0
    # streaming cursor for incremental outputs
    sent_output_len: int = 0
    # the target's hidden state at each position it ran, for a request that returns them (engine/hidden_states.py)
    return_hidden_states: bool = False
    hidden_states: list = field(default_factory=list)  # [H] float32 host tensors, by position
    # penalties, logit bias, grammar (engine/logit_rules.py); None: the logits are sampled as they are
    rules: RowRules | None = None
    grammar_future: Future | None = None  # the grammar being compiled (engine/grammar.py); None once it is ready
    # log-probabilities of the output tokens (engine/logit_rules.py record_logprobs), aligned with output_ids
    return_logprob: bool = False
    top_logprobs_num: int = 0  # also the most likely tokens at each position, as (token id, logprob)
    output_logprobs: list = field(default_factory=list)  # [float] per output token
    output_top_logprobs: list = field(default_factory=list)  # [[(id, logprob), ...]] per output token
    # the prompt's logprobs from token logprob_start_len on (-1: none), computed once by prefill (engine/steps.py)
    logprob_start_len: int = -1
    input_logprobs: list = field(default_factory=list)  # [float | None] (None for the prompt's first token)
    input_top_logprobs: list = field(default_factory=list)  # [[(id, logprob), ...] | None]

    @property
    def input_logprobs_pending(self) -> bool:
        """Whether prefill still owes this request prompt logprobs."""
        return self.logprob_start_len >= 0 and (self.logprob_start_len + len(self.input_logprobs)
                                                < len(self.origin_input_ids))

    @property
    def needs_host_logits(self) -> bool:
        """Whether the steps must hand this request's logits to the host side (logit rules, logprobs): it then runs
        phase by phase and synchronously (engine/decode_plan.py)."""
        return self.rules is not None or self.return_logprob

    @property
    def fill_ids(self) -> list[int]:
        """The token sequence whose KV the request needs (prompt + outputs so far)."""
        return self.origin_input_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """fill_ids as the prefix cache keys them: each image's tokens replaced by an id of its picture
        (multimodal/request_images.py), so requests share cached pages only where their images are the same."""
        return self.fill_ids if self.images is None else self.images.cache_key(self.fill_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens produced per verify: accepted drafts + the target's own token."""
        if self.spec_verify_ct == 0:
            return 0.0
        return (self.spec_accepted_drafts + self.spec_verify_ct) / self.spec_verify_ct
