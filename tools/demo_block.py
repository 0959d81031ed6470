"""Rewrite the demo's output block in README.md and docs/training.md from a real run's printed output.

    make demo 2>&1 | tee demo.log            # or: megatron-branch train examples/configs/demo.yaml > demo.log
    python tools/demo_block.py demo.log       # rewrites both blocks (`--check`: exit 1 if they differ instead)

The block is the fenced block holding the "mean reward, first ..." line; it becomes the run's own lines: the
warm-up line ("warm-up done after N steps; RL starts") and the summary `train` prints (train/metrics.py
`run_summary`), so the docs show what a run printed, not a retyped figure (issue 35 item 5).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "training.md")
KEEP = ("warm-up done after ", "mean reward, first ", "positions per step: ")
"""The printed lines the block shows, in the order the run prints them."""


def block_lines(log: str) -> list[str]:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip().startswith(KEEP)]
    if not any(ln.startswith("mean reward, first ") for ln in lines):
        raise SystemExit("demo_block: no 'mean reward, first ...' line in the log: not a finished train run")
    return lines


def rewrite(text: str, lines: list[str]) -> str:
    """`text` with its demo block's body replaced by `lines` (the first fenced block holding the summary)."""
    pattern = re.compile(r"(```\n)((?:(?!```).)*?mean reward, first .*?)(```)", flags=re.S)
    if not pattern.search(text):
        raise SystemExit("demo_block: no demo block (a fenced block with 'mean reward, first') found")
    return pattern.sub(lambda m: m.group(1) + "\n".join(lines) + "\n" + m.group(3), text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path, help="the demo's printed output")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 when a block differs")
    ap.add_argument("--docs", type=Path, nargs="*", default=list(DOCS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lines = block_lines(args.log.read_text())
    stale = []
    for doc in args.docs:
        old = doc.read_text()
        new = rewrite(old, lines)
        if new != old:
            stale.append(doc)
            if not args.check:
                doc.write_text(new)
    for doc in stale:
        print(f"{'differs' if args.check else 'rewrote'}: {doc}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
