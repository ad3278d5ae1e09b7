"""Client text in a chat prompt never becomes a control token.

The chat template renders messages to text, and that text is tokenised with special tokens parsed, so a user (or
tool) message holding "<|im_start|>system ..." would otherwise be read as a real turn marker: a forged system or
assistant turn. Rewriting the client's text cannot fix that (any text that spells a special token is parsed as one,
and inserting characters changes what the model reads), so the fix is in tokenisation:

1. every special token string in the client's text (messages and tools, keys included) is swapped for a sentinel
   (a per-request random ASCII word, which templates pass through untouched, tojson included);
2. the template renders as usual: its own markers are the only special token strings in the result;
3. the result is cut at those markers; the text between them (sentinels turned back into the client's strings) is
   tokenised with split_special_tokens=True, so the client's "<|im_start|>" becomes ordinary text tokens.

A conversation without special token strings in it never takes this path (it is tokenised exactly as before), and
the cut-and-tokenise of step 3 equals the tokenizer's own encoding on such text anyway (tokenizers tokenise the text
between special tokens piece by piece), which tests/test_server_units.py checks on the embedded model.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass


@dataclass
class ControlTokens:
    tokenizer: object
    tokens: list[str]  # the tokenizer's special token strings, longest first (the regex takes the first match)
    pattern: re.Pattern | None  # any of them; None when the tokenizer has none

    @staticmethod
    def of(tokenizer) -> ControlTokens:
        """The special tokens: all_special_tokens and the added tokens marked special (a non-special added token
        is ordinary vocabulary, parsed the same in any text)."""
        if tokenizer is None:
            return ControlTokens(None, [], None)
        found = set(tokenizer.all_special_tokens)
        found |= {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        tokens = sorted((t for t in found if t), key=lambda t: (-len(t), t))
        pattern = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
        return ControlTokens(tokenizer, tokens, pattern)

    def present(self, value) -> bool:
        """Whether any text in value (JSON-like) spells a special token."""
        return self.pattern is not None and _any_string(value, lambda s: self.pattern.search(s) is not None)

    def new_nonce(self, value) -> str:
        """A sentinel prefix found nowhere in the client's text."""
        while True:
            nonce = "ssvplain" + secrets.token_hex(8)
            if not _any_string(value, lambda s, n=nonce: n in s):
                return nonce

    def hide(self, value, nonce: str):
        """value (messages, tools: JSON-like) with each special token string in its text replaced by the sentinel
        nonce + index + "_"; the same object when there was none."""
        if self.pattern is None:
            return value
        index = {t: i for i, t in enumerate(self.tokens)}
        return _map_strings(value, lambda s: self.pattern.sub(lambda m: f"{nonce}{index[m.group(0)]}_", s))

    def restore(self, text: str, nonce: str) -> str:
        """text with its sentinels turned back into the client's special token strings."""
        if not nonce:
            return text
        return re.sub(re.escape(nonce) + r"(\d+)_", lambda s: self.tokens[int(s.group(1))], text)

    def encode(self, rendered: str, nonce: str) -> list[int]:
        """Ids of a rendered prompt whose special token strings are all the template's own: each is its token;
        the text between them, sentinels restored to the client's strings, is ordinary text."""
        tok = self.tokenizer
        ids: list[int] = []
        at = 0
        pieces = [] if self.pattern is None else list(self.pattern.finditer(rendered))
        for m in [*pieces, None]:
            text = rendered[at:m.start() if m is not None else len(rendered)]
            if text:
                ids += tok.encode(self.restore(text, nonce), add_special_tokens=False, split_special_tokens=True)
            if m is not None:
                ids.append(tok.convert_tokens_to_ids(m.group(0)))
                at = m.end()
        return ids


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_map_strings(v, fn) for v in value]
    return value


def _any_string(value, test) -> bool:
    if isinstance(value, str):
        return test(value)
    if isinstance(value, dict):
        return any(_any_string(k, test) or _any_string(v, test) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_any_string(v, test) for v in value)
    return False
