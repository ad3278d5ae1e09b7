"""Incremental detokenisation for streaming: text deltas that add up to exactly the final text.

Decoding each new token alone is wrong for byte-level BPE (a multi-byte character split over tokens decodes to
"\ufffd") and for SentencePiece (a word's leading space depends on its neighbours). So a window of ids is decoded
with some left context: `prefix` is where the window starts, `read` where the text already taken ends. The text
of ids[prefix:] minus the text of ids[prefix:read] is new; if it ends in "\ufffd" (an unfinished character) it is
held back until more ids arrive.

Stop strings: the engine stops on a stop string and the final text is cut before it, so streamed text must never
show it. The tail of the decoded text that could still grow into a stop string is held back until it can't.
"""

from __future__ import annotations

from specserve.engine.stop import final_text

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this index have had their text taken
        self.text = ""  # decoded text so far (complete characters only)
        self.sent = 0  # characters of `text` already handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def feed(self, new_ids: list[int]) -> str:
        """Add ids; return the text that is now safe to show."""
        self.ids.extend(new_ids)
        if len(self.ids) > self._read:
            before = self._decode(self.ids[self._prefix:self._read])
            window = self._decode(self.ids[self._prefix:])
            if len(window) > len(before) and not window.endswith(_REPLACEMENT):
                self.text += window[len(before):]
                self._prefix = self._read
                self._read = len(self.ids)
        return self._take(self._safe_end())

    def finish(self, new_ids: list[int], finished_reason: dict | None) -> str:
        """The remaining text once the request is done (its last ids included); all deltas joined equal
        `final_text`. The last ids are not fed first: they may complete a stop string that must not be shown."""
        self.ids.extend(new_ids)
        full = final_text(self.tokenizer, self.ids, finished_reason, self.skip_special_tokens)
        shown = self.text[:self.sent]
        # Normally `full` extends what was shown; if a tokenizer decodes inconsistently, never repeat text.
        rest = full[len(shown):] if full.startswith(shown) else full[min(len(shown), len(full)):]
        self.text = full
        self.sent = len(full)
        return rest

    def _safe_end(self) -> int:
        """End of the text that cannot be the start of a stop string."""
        n = len(self.text)
        end = n
        for s in self.stop:
            # Longest suffix of the text that is a proper prefix of s (a whole s would have stopped the engine).
            for k in range(min(len(s) - 1, n - self.sent), 0, -1):
                if self.text.endswith(s[:k]):
                    end = min(end, n - k)
                    break
        return end

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out
