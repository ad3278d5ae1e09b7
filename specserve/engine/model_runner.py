"""ModelRunner: the models, the KV memory, and the phase runners on one device.

It sizes the KV pool, owns the page table and per-row device state, builds one attention backend per runner and
captures the graphs. It knows nothing of requests: the scheduler and the spec worker hand it tensors.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.engine.forward_batch import ForwardMode
from specserve.engine.graph_runner import (
    DecodeRunner,
    DraftDecodeRunner,
    DraftExtendRunner,
    PhaseRunner,
    RunnerContext,
    TargetVerifyRunner,
)
from specserve.engine.prefill_graph import PrefillRunner
from specserve.kvcache.allocator import PageAllocator
from specserve.kvcache.kv_pool import KVPool
from specserve.kvcache.manager import KVManager
from specserve.kvcache.req_to_token import ReqToTokenPool
from specserve.models.config import ModelConfig
from specserve.server_args import ServerArgs
from specserve.spec.spec_step import SpecStepRunner

logger = logging.getLogger(__name__)

_CPU_KV_BYTES = 2 << 30  # default KV budget on CPU when --max-total-tokens is not given
_PREFILL_GRAPH_TOKENS = 2048  # default largest prefill batch run as a CUDA graph (--chunked-prefill-size's default)
_PREFILL_GRAPH_ROWS = 16  # requests per prefill graph batch


def default_capture_bs(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512]
    out = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(out))


@dataclass
class RowState:
    """Per page-table-row device state carried between steps (no host round trip)."""

    last_token: torch.Tensor  # [rows] the newest token (no KV yet)
    draft_token: torch.Tensor  # [rows] d1 for the next spec step
    draft_hidden: torch.Tensor | None  # [rows, H] the draft hidden state that chains into d2
    tokens: torch.Tensor | None = None  # [rows, row width + 1] token history (context lookup drafting only)


class ModelRunner:
    def __init__(self, args: ServerArgs, target: torch.nn.Module, cfg: ModelConfig, draft: torch.nn.Module | None,
                 device: torch.device, dtype: torch.dtype, context_len: int):
        self.args = args
        self.target = target
        self.draft = draft
        if draft is not None and draft.aux_layers:
            target.set_aux_layers(draft.aux_layers)  # extend and verify now also return these layers' outputs
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.context_len = context_len
        self.num_steps = args.num_draft_steps  # N (0 without speculation)
        self.page_size = args.page_size
        kv_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
        self.kv_dtype = kv_dtype

        # ---- sizing
        per_tok = KVPool.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        if draft is not None:
            per_tok += KVPool.bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        self.row_width = -(-(context_len + self.num_steps + 1) // self.page_size) * self.page_size
        self.max_total_tokens = self._kv_tokens(per_tok)
        min_tokens = self.row_width + self.page_size
        if self.max_total_tokens < min_tokens:
            raise ValueError(
                f"KV pool of {self.max_total_tokens} tokens cannot hold one full-context request "
                f"({min_tokens} tokens); lower --context-length or raise --max-total-tokens/--mem-fraction-static"
            )
        num_pages = self.max_total_tokens // self.page_size + 1  # + dummy page 0
        self.max_running = args.max_running_requests or (256 if device.type == "cuda" else 64)
        self.max_running = max(1, min(self.max_running, self.max_total_tokens // max(self.num_steps + 2, 2)))

        # ---- memory
        self.req_to_token = ReqToTokenPool(self.max_running, self.row_width, device)
        self.allocator = PageAllocator(num_pages, self.page_size)
        self.kv = KVManager(self.allocator, self.req_to_token)
        slots = num_pages * self.page_size
        self.target_kv = KVPool(cfg.num_layers, slots, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device)
        self.draft_kv = (KVPool(1, slots, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device)
                         if draft is not None else None)
        rows = self.max_running + 1
        self.rows = RowState(
            last_token=torch.zeros(rows, dtype=torch.int64, device=device),
            draft_token=torch.zeros(rows, dtype=torch.int64, device=device),
            draft_hidden=(torch.zeros((rows, cfg.hidden_size), dtype=dtype, device=device)
                          if draft is not None else None),
            # a spec step writes its N + 1 verified tokens at S+1..S+N+1: one column beyond the page-table row
            tokens=(torch.full((rows, self.row_width + 1), -1, dtype=torch.int64, device=device)
                    if draft is not None and args.speculative_ngram_lookup else None),
        )
        # ---- phase runners
        self.use_graphs = not args.disable_cuda_graph
        max_bs = args.cuda_graph_max_bs or min(self.max_running, 64 if device.type == "cuda" else 16)
        capture = sorted(set(args.cuda_graph_bs)) if args.cuda_graph_bs else default_capture_bs(max_bs)
        capture = [b for b in capture if b <= self.max_running] or [1]
        self.capture_bs = capture
        mrope = cfg.mrope_section is not None
        tctx = RunnerContext(target, self.target_kv, self.req_to_token, self.make_backend, device,
                             cfg.hidden_size, dtype, mrope, self.row_width)
        self.runners: dict[str, PhaseRunner] = {}
        self.draft_context: RunnerContext | None = None
        self.spec_step: SpecStepRunner | None = None  # a greedy spec step as one graph, over the phase runners
        if draft is None:
            self.runners["decode"] = DecodeRunner(tctx, 1, capture, self.use_graphs)
        else:
            n = self.num_steps
            dctx = RunnerContext(draft, self.draft_kv, self.req_to_token, self.make_backend, device,
                                 cfg.hidden_size, dtype, mrope, self.row_width, token_history=self.rows.tokens,
                                 lookup_confidence=args.speculative_ngram_confidence)
            self.draft_context = dctx  # eager draft token choice (prefill) goes through it too
            self.runners["target_verify"] = TargetVerifyRunner(tctx, n + 1, capture, self.use_graphs)
            if n > 1:
                self.runners["draft_decode"] = DraftDecodeRunner(dctx, n - 1, capture, self.use_graphs)
            self.runners["draft_extend"] = DraftExtendRunner(dctx, n + 1, capture, self.use_graphs)
            if not args.disable_spec_step_graph:
                self.spec_step = SpecStepRunner(self, capture, self.use_graphs)
        # prefill: the target's extend, and the draft's over the same positions (engine/prefill_graph.py)
        max_prefill = self._max_prefill_graph_tokens()
        rows = min(self.max_running, _PREFILL_GRAPH_ROWS)
        self.prefill = {"target": PrefillRunner(tctx, ForwardMode.EXTEND, max_prefill, rows, self.use_graphs)}
        if draft is not None:
            self.prefill["draft"] = PrefillRunner(dctx, ForwardMode.DRAFT_EXTEND, max_prefill, rows,
                                                  self.use_graphs, hidden_width=draft.feature_size)

    # ------------------------------------------------------------------ setup
    def _backend_class(self) -> type:
        choice = self.args.attention_backend
        if choice == "auto":
            choice = "triton" if self.device.type == "cuda" else "torch"
        if choice == "triton":
            from specserve.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend
        return TorchAttentionBackend

    def make_backend(self, pool: KVPool):
        return self._backend_class()(self.req_to_token, pool)

    def _max_prefill_graph_tokens(self) -> int:
        """Prefill graphs: --cuda-graph-max-prefill-tokens, by default 2048 on CUDA (bounded by the page-table
        row) and 0 (eager) on CPU, where padding only costs compute."""
        asked = self.args.cuda_graph_max_prefill_tokens
        if self.device.type == "cuda":
            if not self._backend_class().captures_varlen:
                if asked:
                    raise ValueError("--cuda-graph-max-prefill-tokens needs an attention backend that captures "
                                     "variable-length batches (--attention-backend triton)")
                return 0
            asked = _PREFILL_GRAPH_TOKENS if asked is None else asked
        return min(asked or 0, self.row_width)

    def _kv_tokens(self, per_tok: int) -> int:
        if self.args.max_total_tokens:
            return self.args.max_total_tokens
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            frac = self.args.mem_fraction_static or 0.85
            used = total - free
            budget = total * frac - used - (2 << 30)  # keep room for graphs and activations
            return max(int(budget // per_tok), 0)
        return int(min(_CPU_KV_BYTES // per_tok, 1 << 20))

    def capture_graphs(self) -> None:
        if not (self.use_graphs and self.device.type == "cuda"):
            return
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        items = (list(self.runners.values()) + ([self.spec_step] if self.spec_step is not None else [])
                 + list(self.prefill.values()))
        # No garbage collection during capture: a collected cycle that frees CUDA tensors of an earlier runner
        # makes the allocator query events, which invalidates the capture.
        gc.collect()
        gc.disable()
        try:
            for r in tqdm(items, desc=f"Capturing CUDA graphs (bs {self.capture_bs[0]}..{self.capture_bs[-1]})",
                          unit="runner", disable=None):
                r.ctx.graph_pool = pool
                r.capture()
                pool = r.ctx.graph_pool
        finally:
            gc.enable()
        torch.cuda.synchronize()
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / (1 << 30)
        logger.info("captured %d graphs for %s in %.1f s, %.2f GiB", sum(len(r.graphs) for r in items),
                    ", ".join(r.name for r in items), time.perf_counter() - t0, used)
