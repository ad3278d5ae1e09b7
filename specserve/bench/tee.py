"""The `--output-file` of the benchmark and profiling scripts under scripts/: what a script prints (its results)
also goes, as text, to a file."""

from __future__ import annotations

import atexit
import sys
from typing import TextIO


class _Tee:
    """A text stream writing to two others (the first answers everything else: isatty, encoding, ...)."""

    def __init__(self, first: TextIO, second: TextIO):
        self.first, self.second = first, second

    def write(self, text: str) -> int:
        self.second.write(text)
        return self.first.write(text)

    def flush(self) -> None:
        self.first.flush()
        self.second.flush()

    def __getattr__(self, name: str):
        return getattr(self.first, name)


def tee_stdout_to(path: str | None) -> None:
    """For the rest of the process, everything printed to stdout also goes to path (created or truncated); None:
    nothing changes."""
    if path is None:
        return
    f = open(path, "w")  # noqa: SIM115 (open until the process exits)
    tee = _Tee(sys.stdout, f)
    sys.stdout = tee

    def close() -> None:
        if sys.stdout is tee:
            sys.stdout = tee.first
        f.close()

    atexit.register(close)
