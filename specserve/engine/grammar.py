"""Grammars for constrained decoding, through xgrammar: compiled off the scheduler's thread, matched per request.

`GrammarBackend` compiles a request's json_schema / regex / ebnf on a worker thread (xgrammar keeps a cache of
compiled grammars, so a schema an agent resends each turn compiles once); the scheduler keeps the request out of
the waiting queue until its grammar is ready (engine/scheduler.py), so a slow compile never stalls a step.

`GrammarState` is one request's matcher, always at the request's committed output. For a step it fills the allowed
tokens at each position the step samples or verifies: position j of a speculative step sees the state after the
committed output and the drafts d1..dj, so the target's distribution there is masked exactly as plain decoding
would mask it once those drafts are accepted. The walk along the drafts is rolled back at once (the matcher commits
only the tokens the host reads back, `commit`); past a draft the grammar forbids, positions are left unmasked: that
draft has probability 0 under the masked target, so nothing after it can be accepted.

A grammar may start after the model's reasoning (`reasoning_end`: the token ids of a marker such as `</think>`):
until the output ends with the marker every position is unmasked, so the boundary is never a rejected token; the
marker may fall inside a step's drafts.
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before a reason

_xgr = None  # the xgrammar module, imported on first use (its import costs seconds; most engines never need it)
_import_lock = threading.Lock()


def xgrammar():
    global _xgr
    with _import_lock:
        if _xgr is None:
            import xgrammar as xgr

            _xgr = xgr
    return _xgr


def bitmask_words(vocab_size: int) -> int:
    """32-bit words of one position's token bitmask."""
    return (vocab_size + 31) // 32


class GrammarBackend:
    """Compiles grammars for one tokenizer and model vocabulary (--grammar-backend xgrammar)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        """vocab_size: the model's (its logits' width, which may exceed the tokenizer's); stop_token_ids: the tokens
        a finished grammar allows (the engine's EOS set)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def start(self, kind: str, text: str, reasoning_end: list[int] | None = None) -> Future:
        """A request's GrammarState for (kind, text), compiled on the backend's thread (Future; its exception a
        ValueError saying why the grammar does not compile)."""
        return self._pool.submit(lambda: self.new_state(self.compile(kind, text), reasoning_end))

    def compile(self, kind: str, text: str):
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=True, strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "ebnf":
                return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with the reason
            reason = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0])[:500]
            raise ValueError(f"the {kind} could not be compiled: {reason}") from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def new_state(self, compiled, reasoning_end: list[int] | None = None) -> GrammarState:
        matcher = xgrammar().GrammarMatcher(compiled)  # (rollback is unlimited)
        return GrammarState(matcher, bitmask_words(self.vocab_size), reasoning_end)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's grammar matcher at its committed output, behind an optional reasoning gate."""

    def __init__(self, matcher, words: int, reasoning_end: list[int] | None = None):
        self.matcher = matcher
        self.words = words
        self.reasoning_end = list(reasoning_end) if reasoning_end else None
        self.active = self.reasoning_end is None  # the grammar applies (the reasoning has ended)
        self._tail: list[int] = []  # the output's last tokens while the gate is closed
        self.rejected = False  # a committed token the grammar did not allow (a bug, or ignore_eos past the end)

    def _gate(self, tail: list[int], token: int) -> tuple[bool, list[int]]:
        """The gate after `token`: (opened, the tail kept)."""
        end = self.reasoning_end
        tail = (tail + [token])[-len(end):]
        return tail == end, tail

    def commit(self, token: int) -> None:
        """The request's next output token, read back by the host."""
        if not self.active:
            self.active, self._tail = self._gate(self._tail, token)
            return
        if self.matcher.is_terminated():
            return  # a stop token ended the grammar; the stop checker ends the request
        if not self.matcher.accept_token(token) and not self.rejected:
            self.rejected = True  # cannot happen when the token was sampled under this grammar's mask
            logger.error("a committed token (%d) left its grammar; the rest of the output is not constrained", token)

    def fill(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        """bitmask [len(drafts) + 1, words] int32 (all bits set on entry): row j = the tokens allowed after the
        committed output and drafts[:j]."""
        matcher = self.matcher
        active, tail = self.active, self._tail
        advanced = 0
        for j in range(len(drafts) + 1):
            if active and matcher.is_terminated():
                break  # a stop token ended the grammar (the request ends there): nothing left to mask
            if active:
                matcher.fill_next_token_bitmask(bitmask, j)
            if j == len(drafts):
                break
            d = drafts[j]
            if not active:
                active, tail = self._gate(tail, d)
            elif not matcher.accept_token(d):
                break  # d is forbidden at j: later positions cannot be accepted and stay unmasked
            else:
                advanced += 1
        if advanced:
            matcher.rollback(advanced)

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()
