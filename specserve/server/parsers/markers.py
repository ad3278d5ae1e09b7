"""Finding marker strings (`<tool_call>`, `</think>`, ...) in text that is still arriving.

The one rule that makes streaming agree with one-shot parsing: never decide while the text seen so far could still
turn out differently. A buffer ending in `<tool_` may be the start of `<tool_call>`, so that tail is held back
until the next piece (or the end of the answer) settles it.
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_start(buf: str, markers: Sequence[str]) -> int | None:
    """The first index i such that buf[i:] is a proper prefix of some marker (it could still grow into one)."""
    best = None
    for marker in markers:
        # Only the last len(marker) - 1 characters can hold a proper prefix; jump between its first character.
        i = buf.find(marker[0], max(0, len(buf) - len(marker) + 1))
        while i != -1 and (best is None or i < best):
            if marker.startswith(buf[i:]):
                best = i
                break
            i = buf.find(marker[0], i + 1)
    return best


def find_marker(buf: str, markers: Sequence[str], final: bool) -> tuple[int, str | None]:
    """Where `buf` can be consumed up to: (pos, marker).

    With a marker: it starts at pos and is the first one in buf (the longest where two start together), and no
    longer marker can still start at or before pos. With None: buf[:pos] holds no marker, and buf[pos:] (empty
    unless held back) might still begin one. `final` means no more text comes, so nothing is held back.
    """
    pos, found = -1, None
    for marker in markers:
        i = buf.find(marker)
        if i != -1 and (found is None or i < pos or (i == pos and len(marker) > len(found))):
            pos, found = i, marker
    if not final:
        hold = partial_start(buf, markers)
        if hold is not None and (found is None or hold <= pos):
            return hold, None
    if found is None:
        return len(buf), None
    return pos, found
