"""ModelRunner: the target model, the memory, and the target's phase runners on one device.

It sizes every cache pool from one memory budget (the target's and the draft's per-layer cache specs: token slots
for the token-indexed kinds, state rows for the recurrent kind), owns the page table, the target's pools and the
per-row last token, builds the backends (one per cache kind, a fresh set per runner) and captures the graphs. With
a drafter it creates the speculative worker (speculative/worker.py), which owns everything of the draft. It knows
nothing of requests: the scheduler's steps hand it tensors.
"""

from __future__ import annotations

import gc
import logging
import time

import torch
from tqdm import tqdm

from specserve.attention.state_backend import RecurrentStateBackend
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.attention.torch_mla_backend import (
    TorchIndexBackend,
    TorchMLABackend,
    TritonIndexBackend,
    TritonMLABackend,
)
from specserve.batch import CacheKind, ForwardMode
from specserve.engine.sampling_cache import SamplingCache
from specserve.graphs.phase_runners import (
    DecodeRunner,
    PlainVerifyRunner,
    RunnerContext,
    TargetPhases,
    TargetVerifyRunner,
)
from specserve.graphs.prefill import PrefillRunner
from specserve.graphs.step_graph import DecodeStepGraph
from specserve.graphs.step_hidden import StepHidden
from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.cache_spec import bytes_per_state_row, bytes_per_token, is_fp8
from specserve.kvcache.caches import ModelCaches
from specserve.kvcache.manager import KVManager
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.layers.sampler import check_sampling_kernels
from specserve.models.config import ModelConfig
from specserve.models.decoder_layer import set_decode_gemv
from specserve.server_args import KV_CACHE_TORCH_NAMES, ServerArgs
from specserve.speculative.draft_lag import DraftLag
from specserve.speculative.worker import SpecWorker, WorkerSettings

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 2 << 30  # default KV budget on CPU when --max-total-tokens is not given
_PREFILL_GRAPH_TOKENS = 2048  # default largest prefill batch run as a CUDA graph (--chunked-prefill-size's default)
# most float32 index scores a DSA prefill graph holds ([padded tokens, page-table row], 256 MiB): at a 32k row it
# still takes 2048 tokens, at DeepSeek's 160k 409
_INDEX_SCORES_ELEMS = 1 << 26
# most (query token, key) pairs an MLA prefill graph attends over (2048 new tokens after a prefix of ~7k; not yet
# measured against the eager prefill at long prefixes, so the graphs keep to the short, launch-bound prefills)
_PREFILL_GRAPH_ATTENDED = 1 << 24
_PREFILL_GRAPH_ROWS = 16  # requests per prefill graph batch


def default_capture_bs(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]
    out = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(out))


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype's torch dtype: auto is the model's; fp8_e4m3 / fp8_e5m2 (SGLang's names) are
    float8_e4m3fn / float8_e5m2; the others are torch's own names."""
    if name == "auto":
        return model_dtype
    return getattr(torch, KV_CACHE_TORCH_NAMES.get(name, name))


def token_kind_dtypes(indexer_cache_dtype: str, kv_dtype: torch.dtype,
                      model_dtype: torch.dtype) -> dict[CacheKind, torch.dtype]:
    """Token-indexed kinds kept in another dtype than --kv-cache-dtype's: the DSA indexer's keys follow
    --indexer-cache-dtype alone (fp8_e4m3: e4m3 with a scale per key; auto: the KV cache's 16-bit dtype, the model's
    under an fp8 KV cache, whose MLA latents are fp8 with group scales while the index keys stay unquantised)."""
    if indexer_cache_dtype == "fp8_e4m3":
        return {CacheKind.INDEX_KEYS: torch.float8_e4m3fn}
    return {CacheKind.INDEX_KEYS: model_dtype} if is_fp8(kv_dtype) else {}


class ModelRunner:
    def __init__(self, args: ServerArgs, target: torch.nn.Module, cfg: ModelConfig, draft: torch.nn.Module | None,
                 device: torch.device, dtype: torch.dtype, context_len: int):
        self.args = args
        self.target = target
        self.draft = draft
        if draft is not None and draft.aux_layers:
            target.set_aux_layers(draft.aux_layers)  # extend and verify now also return these layers' outputs
        if draft is not None:
            draft.set_chain_prenorm(args.speculative_mtp_chain == "prenorm")
        if device.type == "cuda":  # decode rows through the fused Triton GEMVs (kernels/gemv_policy.py)
            for model in (target, draft):
                if model is not None:
                    set_decode_gemv(model, args.decode_gemv)
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.context_len = context_len
        self.num_steps = args.num_draft_steps  # N (0 without speculation)
        self.page_size = args.page_size
        kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
        self.kv_dtype = kv_dtype

        # ---- sizing: one budget for every pool (token slots of target and draft, then state rows)
        target_specs = target.cache_specs()
        draft_specs = draft.cache_specs() if draft is not None else []
        self.kind_dtypes = token_kind_dtypes(args.indexer_cache_dtype, kv_dtype, dtype)
        if args.mla_prefill == "mha" and any(s.kind is CacheKind.INDEX_KEYS for s in target_specs):
            logger.warning("--mla-prefill mha: sparse-attention (DSA) layers attend each query's top-k rows, "
                           "absorbed as in every other phase; only dense MLA layers prefill decompressed")
        per_tok = bytes_per_token(target_specs + draft_specs, kv_dtype, self.kind_dtypes)
        self.row_width = -(-(context_len + self.num_steps + 1) // self.page_size) * self.page_size
        self.max_running = args.max_running_requests or (256 if device.type == "cuda" else 64)
        per_row = bytes_per_state_row(target_specs, self.num_steps + 1)
        budget = self._cache_budget()
        if per_row:
            # state rows first: each running request needs one; never more than a third of the budget
            fit = int(budget // 3 // per_row) if budget is not None else self.max_running
            if fit < 1:
                raise ValueError("the memory budget cannot hold one request's recurrent state; raise "
                                 "--mem-fraction-static")
            self.max_running = min(self.max_running, fit)
            if budget is not None:
                budget -= self.max_running * per_row
        # the prefix cache's recurrent-state snapshots (kvcache/state_snapshots.py): one state slot each, as many
        # as requests run (with tensor parallelism the cache is off for such models: the followers would have to
        # snapshot their shards in step)
        self.prefix_cache = not args.disable_radix_cache and (not per_row or args.tp_size == 1)
        self.num_state_snapshots = self.max_running if per_row and self.prefix_cache else 0
        if self.num_state_snapshots and budget is not None:
            budget -= self.num_state_snapshots * (per_row // (self.num_steps + 1))
        self.adaptive_spec = draft is not None and (args.speculative_adaptive if args.speculative_adaptive is not None
                                                    else device.type == "cuda")
        if self.adaptive_spec and budget is not None:  # the draft's lag after plain steps (speculative/draft_lag.py)
            budget -= (self.max_running + 1) * DraftLag.bytes_per_row(draft.feature_size, dtype)
        self.max_total_tokens = self._kv_tokens(per_tok, budget)
        min_tokens = self.row_width + self.page_size
        if self.max_total_tokens < min_tokens:
            raise ValueError(
                f"KV pool of {self.max_total_tokens} tokens cannot hold one full-context request "
                f"({min_tokens} tokens); lower --context-length or raise --max-total-tokens/--mem-fraction-static"
                f"{self._memory_note()}"
            )
        num_pages = self.max_total_tokens // self.page_size + 1  # + dummy page 0
        self.max_running = max(1, min(self.max_running, self.max_total_tokens // max(self.num_steps + 2, 2)))

        # ---- memory
        self.req_to_token = ReqToTokenPool(self.max_running, self.row_width, device)
        self.allocator = PageAllocator(num_pages, self.page_size)
        self.num_slots = num_pages * self.page_size
        self.caches = ModelCaches(target_specs, self.num_slots, kv_dtype, device, state_rows=self.max_running,
                                  state_slots=self.num_steps + 1, kind_dtypes=self.kind_dtypes)
        self.kv = KVManager(self.allocator, self.req_to_token, self.caches.state)
        if self.prefix_cache:  # unless --disable-radix-cache (kvcache/radix_cache.py)
            self.kv.enable_prefix_cache(check_draft_next=draft is not None, snapshots=self.num_state_snapshots)
        self.last_token = torch.zeros(self.max_running + 1, dtype=torch.int64, device=device)  # [rows]
        # each decode step's hidden states, for requests that return them (graphs/step_hidden.py)
        self.step_hidden = (StepHidden.allocate(self.req_to_token.table.shape[0], self.num_steps + 1, cfg.hidden_size,
                                                dtype, device) if args.enable_return_hidden_states else None)

        # ---- phase runners
        self.use_graphs = not args.disable_cuda_graph
        max_bs = args.cuda_graph_max_bs or min(self.max_running, 64 if device.type == "cuda" else 16)
        capture = sorted(set(args.cuda_graph_bs)) if args.cuda_graph_bs else default_capture_bs(max_bs)
        capture = [b for b in capture if b <= self.max_running] or [1]
        self.capture_bs = capture
        mrope = cfg.mrope_section is not None
        target_ctx = RunnerContext(target, self.req_to_token, self.backend_factory(self.caches), device,
                                   cfg.hidden_size, dtype, mrope, self.row_width)
        self.phases = TargetPhases()  # the target's phase runners
        max_prefill = self._max_prefill_graph_tokens()
        prefill_rows = min(self.max_running, _PREFILL_GRAPH_ROWS)
        self.spec: SpecWorker | None = None  # the speculative worker: draft model, pools, runners, state
        # a plain engine's decode step as one graph (graphs/step_graph.py)
        self.decode_step_graph: DecodeStepGraph | None = None
        self.decode_sampling = SamplingCache(cfg.vocab_size, device)  # the running batch's, per composition
        if draft is None:
            self.phases.decode = DecodeRunner(target_ctx, 1, capture, self.use_graphs)
            self.decode_step_graph = DecodeStepGraph(self.phases.decode, self.last_token, capture, self.use_graphs,
                                                     self.step_hidden)
        else:
            n = self.num_steps
            self.phases.target_verify = TargetVerifyRunner(target_ctx, n + 1, capture, self.use_graphs)
            if self.adaptive_spec:  # plain steps in a speculating engine (engine/adaptive_spec.py)
                self.phases.plain_verify = PlainVerifyRunner(target_ctx, 1, capture, self.use_graphs)
            self.spec = SpecWorker(draft, target_ctx, self.phases.target_verify, self.last_token, self.caches.state,
                                   self.num_slots, kv_dtype,
                                   lambda caches: self.backend_factory(caches, draft=True), WorkerSettings(
                                       num_steps=n, capture_bs=capture, use_graphs=self.use_graphs,
                                       spec_step_graph=not args.disable_spec_step_graph,
                                       ngram_lookup=args.speculative_ngram_lookup,
                                       lookup_confidence=args.speculative_ngram_confidence,
                                       prefill_graph_tokens=max_prefill, prefill_graph_rows=prefill_rows,
                                       prefill_graph_attended=self._prefill_graph_attended(),
                                       kind_dtypes=self.kind_dtypes,
                                       draft_sampling=args.speculative_draft_sampling == "sample",
                                       step_hidden=self.step_hidden),
                                   self.phases.plain_verify)
        # prefill: the target's extend (the draft's over the same positions is the worker's)
        self.prefill = PrefillRunner(target_ctx, ForwardMode.EXTEND, max_prefill, prefill_rows, self.use_graphs,
                                     max_attended=self._prefill_graph_attended())

    # ------------------------------------------------------------------ setup
    def _backend_class(self, draft: bool = False) -> type:
        """draft: the draft model's (--speculative-draft-attention-backend; auto: the target's)."""
        choice = self.args.attention_backend
        if draft and self.args.speculative_draft_attention_backend != "auto":
            choice = self.args.speculative_draft_attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from specserve.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend
        return TorchAttentionBackend

    def _token_backend_classes(self, draft: bool = False) -> dict[CacheKind, type]:
        """The backend class of each token-indexed cache kind: the Triton kernels where --attention-backend is
        triton, or auto on CUDA (MLA and index keys too: faster than the torch reference there); else the torch
        reference. draft: the draft model's."""
        mha = self._backend_class(draft)
        triton = mha is not TorchAttentionBackend
        return {CacheKind.MHA: mha,
                CacheKind.MLA: TritonMLABackend if triton else TorchMLABackend,
                CacheKind.INDEX_KEYS: TritonIndexBackend if triton else TorchIndexBackend}

    def backend_factory(self, caches: ModelCaches, draft: bool = False):
        """A function that makes a fresh set of backends over `caches`, one per cache kind (each runner calls it
        twice: for its graph metadata and for its eager path). draft: the draft model's backends."""
        chunked = self.args.linear_attn_prefill == "chunked"
        token = self._token_backend_classes(draft)
        mla, mla_prefill = token[CacheKind.MLA], self.args.mla_prefill
        classes = {**token, CacheKind.MLA: lambda table, pool: mla(table, pool, mla_prefill),
                   CacheKind.RECURRENT: lambda table, pool: RecurrentStateBackend(table, pool, chunked)}
        missing = [k.value for k in caches.kinds if k not in classes]
        if missing:
            raise ValueError(f"no attention backend serves cache kind(s) {', '.join(missing)} yet")
        return lambda: {kind: classes[kind](self.req_to_token, pool) for kind, pool in caches.pools.items()}

    def _prefill_graph_attended(self) -> int | None:
        """MLA families' prefill graphs run each token as a row over its whole prefix (attention/torch_mla_backend.py
        TokenRows): graphed only up to _PREFILL_GRAPH_ATTENDED (query, key) pairs, where launches dominate;
        longer prefixes (chunked long prompts) take the eager prefill."""
        return _PREFILL_GRAPH_ATTENDED if CacheKind.MLA in self._token_kinds() else None

    def _token_kinds(self) -> set[CacheKind]:
        """The cache kinds of the target and the draft."""
        return set(self.caches.kinds) | (set(s.kind for s in self.draft.cache_specs()) if self.draft else set())

    def _max_prefill_graph_tokens(self) -> int:
        """Prefill graphs: --cuda-graph-max-prefill-tokens, by default 2048 on CUDA (bounded by the page-table
        row) and 0 (eager) on CPU, where padding only costs compute."""
        asked = self.args.cuda_graph_max_prefill_tokens
        if self.device.type == "cuda":
            # every token-indexed kind must capture variable-length attention (the MLA reference cannot yet)
            # (the draft's with its own backends: --speculative-draft-attention-backend)
            draft_kinds = {s.kind for s in self.draft.cache_specs()} if self.draft else set()
            pairs = ((self.caches.kinds, self._token_backend_classes()),
                     (draft_kinds, self._token_backend_classes(draft=True)))
            if not all(classes[k].captures_varlen for kinds, classes in pairs for k in kinds if k in classes):
                if asked:
                    raise ValueError("--cuda-graph-max-prefill-tokens needs an attention backend that captures "
                                     "variable-length batches (--attention-backend triton)")
                return 0
            asked = _PREFILL_GRAPH_TOKENS if asked is None else asked
        most = self.row_width
        if CacheKind.INDEX_KEYS in self._token_kinds():  # the Triton index backend's [tokens, row] graph scores
            most = min(most, max(16, _INDEX_SCORES_ELEMS // self.row_width))
        return min(asked or 0, most)

    def _memory_note(self) -> str:
        """Where the device memory is, for an error message (CUDA only): free and total, and what the fraction
        leaves for the caches."""
        if self.device.type != "cuda" or self.args.max_total_tokens:
            return ""
        free, total = torch.cuda.mem_get_info(self.device)
        frac = self.args.mem_fraction_static or 0.85
        gib = 1 << 30
        return (f". The GPU has {free / gib:.1f} GiB free of {total / gib:.1f} GiB; --mem-fraction-static {frac} "
                f"keeps {total * frac / gib:.1f} GiB for this process, of which {(total - free) / gib:.1f} GiB are "
                "already in use (the model, or memory held by another engine or process)")

    def _cache_budget(self) -> float | None:
        """Bytes for all cache pools (None: --max-total-tokens fixes the KV size; recurrent state comes on top)."""
        if self.args.max_total_tokens:
            return None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = self.args.mem_fraction_static or 0.85
            used = total - free
            return max(total * frac - used - (2 << 30), 0)  # keep room for graphs and activations
        return float(_CPU_KV_BYTES)

    def _kv_tokens(self, per_tok: int, budget: float | None) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        if per_tok == 0:
            return 1 << 20  # no token-indexed layer: slots only back the page table
        if self.device.type == "cuda":
            return max(int(budget // per_tok), 0)
        return int(min(budget // per_tok, 1 << 20))

    def _plain_step_runners(self) -> list:
        """The width-1 runners of a speculating engine's plain steps (none when adaptive speculation is off)."""
        if not self.adaptive_spec or self.spec is None or self.spec.plain_step_ctx is None:
            return []
        graph = [self.spec.plain_step_graph] if self.spec.plain_step_graph is not None else []
        return [self.phases.plain_verify] + graph

    def _drop_plain_steps(self) -> None:
        self.adaptive_spec = False
        self.phases.plain_verify = None
        if self.spec is not None:
            self.spec.plain_step_ctx = None
            self.spec.plain_step_graph = None

    def capture_graphs(self) -> None:
        if not (self.use_graphs and self.device.type == "cuda"):
            return
        check_sampling_kernels(self.device)  # before the sampled graphs capture them (layers/sampler.py)
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        items = (self.phases.all() + ([self.decode_step_graph] if self.decode_step_graph is not None else [])
                 + [self.prefill] + (self.spec.graph_runners() if self.spec else []))
        plain = {id(r) for r in self._plain_step_runners()}
        # No garbage collection during capture: a collected cycle that frees CUDA tensors of an earlier runner
        # makes the allocator query events, which invalidates the capture.
        gc.collect()
        gc.disable()
        try:
            for r in tqdm(items, desc=f"Capturing CUDA graphs (bs {self.capture_bs[0]}..{self.capture_bs[-1]})",
                          unit="runner", disable=None):
                if id(r) not in plain:
                    pool = r.capture(pool)
                elif self.adaptive_spec:  # the optional plain-step graphs: on failure, speculate every step
                    try:
                        pool = r.capture(pool)
                    except Exception:
                        if r is self.spec.plain_step_graph:  # its phases' own graphs still serve plain steps
                            logger.exception("capturing %s failed: plain steps run phase by phase", r.name)
                            self.spec.plain_step_graph = None
                            continue
                        logger.exception("capturing %s failed: adaptive speculation is off", r.name)
                        self._drop_plain_steps()
        finally:
            gc.enable()
        torch.cuda.synchronize()
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / (1 << 30)
        logger.info("captured %d graphs for %s in %.1f s, %.2f GiB", sum(len(r.graphs) for r in items),
                    ", ".join(r.name for r in items), time.perf_counter() - t0, used)
