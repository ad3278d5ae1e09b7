"""Held-out acceptance of a draft head, measured through the engine: greedy speculative decoding of chat-templated
prompts, mean accept length (accepted drafts + 1 per verify, weighted by verifies) per prompt file and N."""

from __future__ import annotations

import gc
import logging
import os

import torch
from tqdm import tqdm

from specserve.train.data import load_prompts, prompt_token_ids, select_prompts

logger = logging.getLogger(__name__)


def accept_length(results: list[dict]) -> float:
    """Verify-weighted mean accept length over engine results (the engine's per-request means, recombined)."""
    verifies = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    if verifies == 0:
        return 0.0
    tokens = sum(r["meta_info"]["spec_accept_length"] * r["meta_info"]["spec_verify_ct"] for r in results)
    return tokens / verifies


def measure_acceptance(model_path: str | None, draft_path: str, prompt_files: list[str], num_steps: list[int],
                       prompts_per_file: int, max_new_tokens: int, engine_kwargs: dict,
                       seed: int = 0) -> dict[str, dict[str, float]]:
    """{file name: {str(N): accept length}} plus "mean": {str(N): mean over the files}. One engine per N (the
    draft-step count shapes its graphs)."""
    prompts = {os.path.basename(f): select_prompts(load_prompts([f]), prompts_per_file, seed) for f in prompt_files}
    out: dict[str, dict[str, float]] = {name: {} for name in prompts}
    out["mean"] = {}
    from specserve.engine.engine import Engine

    for n in tqdm(num_steps, desc="Held-out acceptance", unit="N", disable=None):
        eng = Engine(model_path=model_path, speculative_algorithm="MTP", speculative_num_steps=n,
                     speculative_draft_model_path=draft_path, **engine_kwargs)
        try:
            per_file = []
            for name, ps in prompts.items():
                # prompts that leave no room for max_new_tokens in the context would only measure truncation
                room = eng.core.context_len - max_new_tokens
                ids = [x for x in (prompt_token_ids(eng, p.messages) for p in ps) if len(x) < room]
                if not ids:
                    raise ValueError(f"{name}: no held-out prompt fits the context with {max_new_tokens} new tokens")
                res = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens,
                                                                   "temperature": 0.0})
                out[name][str(n)] = round(accept_length(res), 4)
                per_file.append(out[name][str(n)])
            out["mean"][str(n)] = round(sum(per_file) / len(per_file), 4) if per_file else 0.0
            logger.info("N=%d accept length %s", n, {k: v[str(n)] for k, v in out.items()})
        finally:
            eng.shutdown()
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out
