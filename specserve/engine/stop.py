"""Stop conditions: max_new_tokens, EOS (unless ignore_eos), stop token ids, stop strings, context length."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep this module torch-free: the HTTP process uses final_text
    from specserve.engine.request import Req


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def check(self, req: Req, context_len: int) -> dict | None:
        """Called after each appended token; returns a finish reason or None."""
        sp = req.sampling
        n = len(req.output_ids)
        tok = req.output_ids[-1]
        if not sp.ignore_eos and tok in self.eos:
            return {"type": "stop", "matched": tok}
        if tok in sp.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if sp.stop:
            matched = self.match_stop_string(req)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        if n >= sp.max_new_tokens:
            return {"type": "length", "length": n}
        if len(req.origin_input_ids) + n >= context_len:
            return {"type": "length", "length": n}
        return None

    def match_stop_string(self, req: Req) -> str | None:
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        longest = max(len(s) for s in req.sampling.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2):], skip_special_tokens=False)
        for s in req.sampling.stop:
            if s in tail:
                return s
        return None


def final_text(tokenizer, output_ids: list[int], finished_reason: dict | None, skip_special_tokens: bool) -> str:
    """The complete text of a request: special tokens skipped (if asked), cut before a matched stop string."""
    text = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    reason = finished_reason or {}
    matched = reason.get("matched")
    if reason.get("type") == "stop" and isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def output_text(tokenizer, req: Req) -> str:
    return final_text(tokenizer, req.output_ids, req.finished_reason, req.sampling.skip_special_tokens)
