"""Write docs/flags.md from `specserve serve`'s parser (ServerArgs.add_cli_args): one table per help group, each
flag with its default, its choices and its help text.

    python scripts/gen_flags_doc.py           # (re)write docs/flags.md
    python scripts/gen_flags_doc.py --check   # exit 1 when docs/flags.md differs from what the flags say

tests/test_flags.py fails when the file drifts from the flags; run this script after changing a flag.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "flags.md"

HEADER = """# `specserve serve` flags

Generated from `ServerArgs` (specserve/server_args.py) by `scripts/gen_flags_doc.py`; do not edit by hand.
`specserve generate` takes the same flags; `python -m specserve.launch_server` is `specserve serve`. SGLang's flag
names and meanings throughout; the last group holds specserve's own tuning switches.
"""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._HelpAction):
        return ""
    d = action.default
    if d is None:
        return ""
    if isinstance(d, bool):
        return "on" if d else "off"
    if isinstance(d, list | tuple):
        return " ".join(map(str, d))
    return f"`{d}`"


def render(parser: argparse.ArgumentParser) -> str:
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings]
        if not actions:
            continue
        out.append(f"\n## {group.title}\n")
        if group.description:
            out.append(f"{_cell(group.description)}.\n")
        out.append("| flag | default | choices | meaning |")
        out.append("|---|---|---|---|")
        for a in actions:
            flags = ", ".join(f"`{s}`" for s in a.option_strings)
            choices = ", ".join(map(str, a.choices)) if a.choices else ""
            out.append(f"| {flags} | {_default(a)} | {_cell(choices)} | {_cell(a.help or '')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when the file differs (write nothing)")
    p.add_argument("--output", "--output-file", default=str(DOC), help="where to write (default docs/flags.md)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from specserve.server.launch import build_parser

    text = render(build_parser())
    path = Path(args.output)
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run python scripts/gen_flags_doc.py", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
