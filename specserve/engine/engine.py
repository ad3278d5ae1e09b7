"""Engine: the offline API. `Engine(model_path=..., **server_args).generate(...)`.

The engine core (`EngineCore`) is also what the HTTP server's model process drives: add_request / step / abort.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Sequence

import torch

from specserve.defaults import EMBEDDED_GENERATION_CONFIG, embedded_draft_path, embedded_model_path
from specserve.distributed.tp import TP1
from specserve.engine.grammar import GrammarBackend
from specserve.engine.hidden_states import hidden_states_output
from specserve.engine.loading import load_models, resolve_device
from specserve.engine.logit_rules import RowRules
from specserve.engine.model_runner import ModelRunner
from specserve.engine.request import Req
from specserve.engine.sampling_params import SamplingParams, check_logprob_args, input_logprobs_meta, logprobs_meta
from specserve.engine.scheduler import Scheduler
from specserve.engine.stop import StopChecker, output_text
from specserve.engine.tp_ranks import TPLeader
from specserve.models.loader import ModelSource
from specserve.multimodal.image_inputs import ImageLimits, check_image_count
from specserve.multimodal.image_processing import QwenImageProcessor
from specserve.multimodal.request_images import (
    PreprocessedImages,
    load_request_images,
    prepare_request_images,
    request_images_from,
)
from specserve.server_args import ServerArgs
from specserve.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)


class EngineCore:
    """Model, tokenizer, memory and scheduler in one process (rank 0 of a tensor-parallel engine, whose other
    ranks it starts and drives: engine/tp_ranks.py)."""

    def __init__(self, args: ServerArgs):
        t_start = time.perf_counter()
        self.device = resolve_device(args.device)
        args = args.with_embedded_defaults(embedded_draft_path(), self.device.type)
        self.args = args
        self.model_path = args.model_path or embedded_model_path()
        self.tp_leader = TPLeader(args, self.device) if args.tp_size > 1 else None
        try:
            models = load_models(args, self.device, self.tp_leader.tp if self.tp_leader else TP1)
            src, target, draft = models.src, models.target, models.draft
            self.dtype, self.context_len = models.dtype, models.context_len
            self.model_config = target.config
            self.model_folder = src.folder
            self.tokenizer = load_tokenizer(src, args.tokenizer_path, args.chat_template)
            self.generation_config = _generation_config(src, embedded=args.model_path is None)
            eos = eos_token_ids(self.tokenizer, target.config.eos_token_ids, self.generation_config)
            self.model_runner = ModelRunner(args, target.model, target.config, draft, self.device, self.dtype,
                                            self.context_len)
            self.model_runner.capture_graphs()
            if self.tp_leader is not None:
                self.tp_leader.check_same_pools(self.model_runner)
        except BaseException:
            self.close()
            raise
        self.scheduler = Scheduler(self.model_runner, StopChecker(self.tokenizer, eos), args.chunked_prefill_size)
        # structured output: grammars compile on the backend's thread (engine/grammar.py)
        self.grammar = (GrammarBackend(self.tokenizer, target.config.vocab_size, sorted(eos))
                        if args.grammar_backend != "none" and self.tokenizer is not None else None)
        self.scheduler.tp_leader = self.tp_leader
        self.default_sampling = self._default_sampling()
        self._rng = random.Random(args.random_seed)
        self._image_processor: QwenImageProcessor | None = None  # read from the checkpoint at the first image
        # offline callers are trusted: local image files anywhere unless --allowed-local-media-path narrows it
        self.image_limits = ImageLimits(max_images=args.max_images_per_request, max_pixels=args.max_image_pixels,
                                        max_bytes=int(args.max_encoded_image_mb * (1 << 20)),
                                        local_root=args.allowed_local_media_path or os.sep)
        self.load_time = time.perf_counter() - t_start
        logger.info(
            "engine ready: %s on %s (%s), context %d, KV %d tokens, max running %d, %s, graphs %s (%.1f s)",
            target.config.architecture, self.device, str(self.dtype).replace("torch.", ""), self.context_len,
            self.model_runner.max_total_tokens, self.model_runner.max_running,
            (f"{args.speculative_algorithm} N={args.speculative_num_steps}"
             f"{' + context lookup' if args.speculative_ngram_lookup else ''}"
             f"{' (int8 draft)' if args.speculative_draft_model_quantization == 'int8' else ''}") if args.spec_enabled
            else "no speculation",
            "off" if args.disable_cuda_graph else f"bs<={self.model_runner.capture_bs[-1]}", self.load_time,
        )

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank) and the grammar thread. Idempotent."""
        if getattr(self, "grammar", None) is not None:
            self.grammar.shutdown()
        if getattr(self, "tp_leader", None) is not None:
            self.tp_leader.stop()

    def _default_sampling(self) -> dict:
        if self.args.sampling_defaults != "model":
            return {}
        keys = ("temperature", "top_p", "top_k", "min_p")
        return {k: self.generation_config[k] for k in keys if k in self.generation_config}

    @property
    def default_max_tokens(self) -> int | None:
        """The answer length of a chat request that gives none (the generation config's max_new_tokens; None: all
        the room the context leaves)."""
        if self.args.sampling_defaults != "model":
            return None
        return self.generation_config.get("max_new_tokens")

    # ------------------------------------------------------------------ requests
    def make_request(self, input_ids: list[int], sampling: dict | SamplingParams | None,
                     rid: str | None = None, return_hidden_states: bool = False,
                     reasoning_end: str | None = None, return_logprob: bool = False, top_logprobs_num: int = 0,
                     logprob_start_len: int = -1, images: Sequence | None = None) -> Req:
        """Validate and build a request (raises ValueError; nothing is queued on error). return_hidden_states: the
        result carries the target's hidden states (engine/hidden_states.py; needs --enable-return-hidden-states).
        reasoning_end: the marker (text) that ends the model's reasoning; a grammar applies after it.
        return_logprob, top_logprobs_num: each output token's logprob, and the top_logprobs_num most likely tokens'
        (SGLang's names; engine/logit_rules.py says of which distribution); logprob_start_len >= 0 (with
        return_logprob): also the prompt's, from that token on (engine/steps.py record_prompt_logprobs).
        images: the prompt's images (PIL images, data URLs, base64 or local paths; multimodal/request_images.py),
        one `<|image_pad|>` in input_ids per image, expanded here (ImageInputError, a ValueError, when they do not
        match or an image is unusable); or PreprocessedImages (the server's: decoded, preprocessed, and input_ids
        already expanded)."""
        if return_hidden_states and not self.args.enable_return_hidden_states:
            raise ValueError("this server does not return hidden states: start it with --enable-return-hidden-states")
        if isinstance(sampling, SamplingParams):
            sp = sampling
            sp.validate()
        else:
            sp = SamplingParams.from_dict(sampling, self.default_sampling)
        if not input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in input_ids):
            raise ValueError(f"input_ids must be integers in [0, {vocab})")
        req_images, mrope_delta = None, 0
        if images:
            input_ids, req_images, mrope_delta = self._prepare_images(input_ids, images)
        if len(input_ids) >= self.context_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens; the context length is {self.context_len} "
                "(the prompt must leave room for at least one new token)"
            )
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        check_logprob_args(return_logprob, top_logprobs_num, logprob_start_len, len(input_ids))
        if any(t >= vocab for t, _ in sp.bias_items):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        req = Req(rid=rid or uuid.uuid4().hex, origin_input_ids=list(input_ids), sampling=sp, seed=seed,
                  return_hidden_states=return_hidden_states, return_logprob=bool(return_logprob),
                  top_logprobs_num=top_logprobs_num if return_logprob else 0,
                  logprob_start_len=logprob_start_len if return_logprob else -1, mrope_delta=mrope_delta,
                  images=req_images)
        if sp.has_logit_rules:
            if self.tp_leader is not None:
                raise ValueError("penalties, logit_bias and grammars are not supported with --tp-size > 1 yet")
            req.rules = RowRules(sp)
        if sp.grammar is not None:
            if self.grammar is None:
                raise ValueError("this server constrains no output (--grammar-backend none)")
            end_ids = self.tokenizer.encode(reasoning_end, add_special_tokens=False) if reasoning_end else None
            req.grammar_future = self.grammar.start(*sp.grammar, reasoning_end=end_ids)
        return req

    def _prepare_images(self, input_ids: list[int], images: Sequence):
        """(expanded input ids, RequestImages, mrope_delta) of a prompt and its images (make_request)."""
        model = self.model_runner.target
        if getattr(model, "visual", None) is None:
            raise ValueError(f"{self.model_config.architecture}: this model takes no images (its checkpoint has no "
                             "vision tower)")
        if self.tp_leader is not None:
            raise ValueError("image inputs are not supported with --tp-size > 1 yet")
        if isinstance(images, PreprocessedImages):  # the HTTP process decoded, preprocessed and expanded them
            check_image_count(len(images), self.image_limits, param="image_data")
            req_images, delta = request_images_from(input_ids, images, model.image_token_id,
                                                    self.model_config.vocab_size)
            return list(input_ids), req_images, delta
        if self._image_processor is None:
            self._image_processor = QwenImageProcessor.from_model_dir(self.model_folder)
        decoded = load_request_images(list(images), self.image_limits)
        return prepare_request_images(input_ids, decoded, self._image_processor, model.image_token_id,
                                      self.model_config.vocab_size)

    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("the prompt is empty")
        return self.tokenizer.encode(prompt)

    def result(self, req: Req) -> dict:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,  # prompt tokens the prefix cache gave (SGLang's)
            "finish_reason": req.finished_reason,
            "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival_time,
        }
        if self.args.spec_enabled:
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = req.spec_accept_length
        if req.return_hidden_states:
            meta["hidden_states"] = hidden_states_output(req)
        if req.return_logprob:
            meta.update(logprobs_meta(req.output_ids, req.output_logprobs, req.output_top_logprobs,
                                      req.top_logprobs_num))
            if req.logprob_start_len >= 0:
                meta.update(input_logprobs_meta(req.origin_input_ids[req.logprob_start_len:], req.input_logprobs,
                                                req.input_top_logprobs, req.top_logprobs_num))
        return {"text": output_text(self.tokenizer, req) if self.tokenizer else "",
                "output_ids": list(req.output_ids), "meta_info": meta}

    @staticmethod
    def hidden_states(req: Req) -> list:
        """A finished request's meta_info.hidden_states (engine/hidden_states.py), for the HTTP process."""
        return hidden_states_output(req)

    def run_until_done(self, reqs: list[Req]) -> None:
        for r in reqs:
            self.scheduler.add_request(r)
        pending = {r.rid for r in reqs if not r.finished}
        while pending:
            for r in self.scheduler.step():
                if r.finished:
                    pending.discard(r.rid)
            if pending and not self.scheduler.has_work:
                raise RuntimeError("scheduler went idle with unfinished requests")


def _generation_config(src: ModelSource, embedded: bool = False) -> dict:
    if embedded:
        return dict(EMBEDDED_GENERATION_CONFIG)
    if src.is_gguf:
        return {}
    path = os.path.join(src.folder, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _images_per_prompt(image_data: Sequence | None, single: bool, num_prompts: int) -> list[list | None]:
    """Engine.generate's image_data -> each prompt's image list (None: none)."""
    if image_data is None:
        return [None] * num_prompts
    if not isinstance(image_data, list | tuple):
        raise ValueError("image_data must be a list of images (one prompt) or a list of such lists (one per prompt)")
    if single:
        if len(image_data) == 1 and isinstance(image_data[0], list | tuple):
            return [list(image_data[0])]
        return [list(image_data)]
    if len(image_data) != num_prompts:
        raise ValueError(f"image_data has {len(image_data)} entries for {num_prompts} prompts: give one list of "
                         "images (or None) per prompt")
    out = []
    for k, x in enumerate(image_data):
        if x is not None and not isinstance(x, list | tuple):
            raise ValueError(f"image_data[{k}] must be a list of images or None")
        out.append(None if x is None else list(x))
    return out


class Engine:
    """Offline engine. `generate` accepts a prompt, a list of prompts, or input ids (one list or a batch)."""

    def __init__(self, model_path: str | None = None, **kwargs):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.core = EngineCore(self.server_args)
        self.tokenizer = self.core.tokenizer

    def generate(self, prompt: str | Sequence[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 return_hidden_states: bool = False, return_logprob: bool = False,
                 top_logprobs_num: int = 0, logprob_start_len: int = -1,
                 image_data: Sequence | None = None) -> dict | list[dict]:
        """Generate for a prompt, a list of prompts, or input ids; image_data (SGLang's name; a vision-language
        checkpoint): one list of images per prompt (None or [] for a text prompt), or a single list for a single
        prompt, each image a PIL image, a data URL, base64 or a local path, and one `<|image_pad|>` in the prompt per
        image (the chat template writes it); return_hidden_states (with
        --enable-return-hidden-states): meta_info.hidden_states, as SGLang's (engine/hidden_states.py);
        return_logprob / top_logprobs_num: meta_info.output_token_logprobs / output_top_logprobs, as SGLang's."""
        self._check_running()
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if not prompts:
                raise ValueError("the prompt list is empty")
            ids = [self.core.tokenize(p) for p in prompts]
        else:
            single = len(input_ids) == 0 or not isinstance(input_ids[0], list | tuple)
            ids = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError("sampling_params list must match the number of prompts")
            sps = sampling_params
        else:
            sps = [sampling_params] * len(ids)
        per_prompt = _images_per_prompt(image_data, single, len(ids))
        # validates all before queueing any
        reqs = [self.core.make_request(i, sp, return_hidden_states=return_hidden_states, return_logprob=return_logprob,
                                       top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
                                       images=imgs)
                for i, sp, imgs in zip(ids, sps, per_prompt)]
        self.core.run_until_done(reqs)
        refused = [r.finished_reason["message"] for r in reqs if r.finished_reason.get("status_code") == 400]
        if refused:  # a grammar that does not compile
            raise ValueError(refused[0])
        out = [self.core.result(r) for r in reqs]
        return out[0] if single else out

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        """The chat template's text of the messages (SGLang's Engine API). Offline callers are trusted: text that
        spells a special token stays one when the result is passed as a prompt (the server's chat route tokenises
        client text as plain text instead: server/control_tokens.py)."""
        self._check_running()
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's Engine.flush_cache); False while requests are in flight."""
        self._check_running()
        return self.core.scheduler.flush_cache()

    def _check_running(self) -> None:
        if self.core is None:
            raise RuntimeError("the engine is shut down")

    def shutdown(self) -> None:
        """Abort what is in flight and release the model, the pools and the graphs (device memory included), so
        another Engine fits in this process again. Idempotent."""
        if self.core is None:
            return
        sched = self.core.scheduler
        for rid in list(sched.reqs):
            sched.abort(rid)
        del sched  # (a live local would keep the whole engine through the collection below)
        self.core.close()
        self.core = None
        self.tokenizer = None
        # The runners and the speculative worker refer to each other (the whole-step graph holds its worker): only
        # the cycle collector frees them, and with them the graphs' memory pool and the KV pools.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
