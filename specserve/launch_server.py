"""`python -m specserve.launch_server [flags]`: the same as `specserve serve` (SGLang's launch_server spelling)."""

from __future__ import annotations

import sys

from specserve.server.launch import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
