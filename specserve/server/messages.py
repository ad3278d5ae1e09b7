"""Messages between the HTTP process and the model process (pickled over two one-way pipes).

HTTP -> model:  AddRequest, AbortRequest, FlushCache, Shutdown.
model -> HTTP:  EngineReady (once, after loading), EngineFailed (load or loop crash, then the process exits),
                StepOutput (after every loop turn that changed something: per-request token deltas, rejected
                requests, answers to FlushCache, and a snapshot of the engine's counters).

Only plain data crosses the pipe (no tensors; an image request's pixels travel as a NumPy array in
multimodal/request_images.py:PreprocessedImages): the HTTP side stays light and the messages stay
small. Token ids are sent as deltas (ids since the last message for that request); the HTTP process keeps the
full sequence and detokenises it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.kvcache.prefix_stats import PrefixCacheStats

if TYPE_CHECKING:
    from specserve.multimodal.request_images import PreprocessedImages


@dataclass
class AddRequest:
    rid: str
    input_ids: list[int]
    sampling: dict  # SGLang sampling names, already validated by the HTTP process
    return_hidden_states: bool = False
    reasoning_end: str | None = None  # a grammar in `sampling` applies after this marker (the reasoning's end)
    return_logprob: bool = False  # each output token's logprob (SGLang's name)
    top_logprobs_num: int = 0  # ... and this many most likely tokens' at each position
    logprob_start_len: int = -1  # the prompt's logprobs from this token on (-1: none)
    # the prompt's images, decoded and preprocessed by the HTTP process; input_ids is then the expanded prompt
    images: PreprocessedImages | None = None


@dataclass
class AbortRequest:
    rid: str


@dataclass
class FlushCache:
    """Empty the prefix cache (/flush_cache), done between steps and only when the engine is idle; answered by a
    FlushCacheResult with the same id in a StepOutput."""

    id: int


@dataclass
class FlushCacheResult:
    id: int
    success: bool  # False: requests were running or waiting, nothing was flushed
    num_running: int = 0  # what the engine held when it was asked
    num_waiting: int = 0


@dataclass
class Shutdown:
    pass


@dataclass
class EngineInfo:
    """Static facts about the loaded engine the HTTP process needs (validation, /get_model_info, metrics)."""

    model_path: str
    architecture: str
    context_len: int
    vocab_size: int
    max_total_tokens: int
    max_running: int
    page_size: int
    capacity_pages: int
    initial_free_pages: int
    default_sampling: dict
    spec_enabled: bool
    load_time: float
    pid: int
    # what the engine resolved (the embedded default speculates without being asked)
    spec_algorithm: str | None = None
    spec_num_steps: int = 0
    draft_model_path: str | None = None
    spec_ngram_lookup: bool = False
    overlap_schedule: bool = False  # decode steps launched before the previous one is read (engine/overlap.py)
    draft_quantization: str | None = None  # "int8" (CPU), else None
    default_max_tokens: int | None = None  # a chat request without max_tokens gets this (None: the context's room)
    prefix_cache: bool = False  # the prefix (radix) cache is on (off: --disable-radix-cache)
    image_token_id: int | None = None  # a vision-language model's <|image_pad|> id (None: the model takes no images)
    image_folder: str | None = None  # ... and the checkpoint folder its preprocessor_config.json is read from


@dataclass
class EngineReady:
    info: EngineInfo


@dataclass
class EngineFailed:
    message: str  # the traceback or error text


@dataclass
class EngineStats:
    """Counters of the scheduler, snapshotted after each loop turn."""

    num_running: int = 0
    num_waiting: int = 0
    free_pages: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_finished: int = 0
    num_retractions: int = 0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    recent_accept_length: float = 0.0  # mean over the last few hundred verifies (0 without speculation)
    spec_plain_steps: int = 0  # plain steps of a speculating engine (adaptive speculation)
    num_overlapped_steps: int = 0  # decode steps launched before the previous one's output was read
    num_overlapped_prefills: int = 0  # prefills launched so, their first tokens read with the next step
    spec_adaptive: dict | None = None  # AdaptiveSpeculation.summary() (None: adaptive speculation off)
    # the prefix cache's counts (its evictable pages are counted in free_pages; all 0 when it is off)
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens per verify since start: accepted drafts + the target's own token."""
        if not self.spec_verify_ct:
            return 0.0
        return (self.spec_accepted_drafts + self.spec_verify_ct) / self.spec_verify_ct


@dataclass
class RequestDelta:
    rid: str
    new_ids: list[int]
    finished_reason: dict | None = None  # {"type": "stop"|"length"|"abort", ...} once finished
    spec_verify_ct: int = 0
    spec_accepted_drafts: int = 0
    hidden_states: list | None = None  # once finished, for a request that returns them (engine/hidden_states.py)
    logprobs: list[float] | None = None  # the new tokens' logprobs (a request that returns them)
    top_logprobs: list | None = None  # per new token [(id, logprob), ...] (top_logprobs_num > 0)
    input_logprobs: list | None = None  # once finished: the prompt's from logprob_start_len ([float | None])
    input_top_logprobs: list | None = None  # ... and their top tokens ([[(id, logprob), ...] | None])
    cached_tokens: int = 0  # prompt tokens the prefix cache gave at admission (meta_info.cached_tokens)


@dataclass
class RequestRejected:
    rid: str
    message: str  # a ValueError from make_request: the request was never queued


@dataclass
class StepOutput:
    deltas: list[RequestDelta] = field(default_factory=list)
    rejected: list[RequestRejected] = field(default_factory=list)
    stats: EngineStats = field(default_factory=EngineStats)
    flushed: list[FlushCacheResult] = field(default_factory=list)  # answers to FlushCache
