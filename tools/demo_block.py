"""Rewrite the demo's output block in README.md and docs/training.md from a real run's printed output.

    make demo 2>&1 | tee demo.log            # or: megatron-branch train examples/configs/demo.yaml > demo.log
    python tools/demo_block.py demo.log       # rewrites both blocks (`--check`: exit 1 if they differ instead)
    python tools/demo_block.py demo.log --within   # exit 1 unless the run's figures are the README's, within TOLERANCE

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
TOLERANCE = {"reward": 0.05, "positions": 0.03, "warm-up": 10}
"""How far another machine's `make demo` may print from the README's block and still agree (`--within`; `make demo`
checks its own output so): mean rewards within 0.05 (absolute; runs on other machines print e.g. 0.67 to 0.69 for
the last ten steps), positions within 3% (relative), warm-up steps within 10; the number of RL steps exactly."""


def figures(lines: list[str]) -> dict[str, float]:
    """The numbers of the block's lines, by name."""
    text = "\n".join(lines)
    out: dict[str, float] = {}
    for name, pattern in (
        ("warm-up", r"warm-up done after (\d+) steps"),
        ("reward first", r"mean reward, first \d+ steps: ([\d.]+)"),
        ("reward last", r"last \d+ steps: ([\d.]+)"),
        ("steps", r"\((\d+) steps\)"),
        ("positions logical", r"logical (\d+)"),
        ("positions computed", r"computed (\d+)"),
    ):
        found = re.search(pattern, text)
        if found:
            out[name] = float(found.group(1))
    return out


def disagreements(shown: list[str], run: list[str]) -> list[str]:
    """Where the run's figures are further from the block's than TOLERANCE allows (empty: they agree)."""
    a, b = figures(shown), figures(run)
    bad = []
    for name in sorted(a.keys() | b.keys()):
        if name not in a or name not in b:
            bad.append(f"{name}: only in the {'README' if name in a else 'run'}")
            continue
        kind = name.split()[0]
        if kind == "positions":
            ok = abs(b[name] - a[name]) <= TOLERANCE["positions"] * a[name]
        elif kind in TOLERANCE:
            ok = abs(b[name] - a[name]) <= TOLERANCE[kind]
        else:
            ok = a[name] == b[name]
        if not ok:
            bad.append(f"{name}: README {a[name]:g}, this run {b[name]:g}")
    return bad


def shown_lines(doc: Path) -> list[str]:
    """The lines of `doc`'s demo block."""
    text = doc.read_text()
    body = re.search(r"```\n((?:(?!```).)*?mean reward, first .*?)```", text, flags=re.S)
    if not body:
        raise SystemExit(f"demo_block: no demo block in {doc}")
    return body.group(1).strip().splitlines()


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
    ap.add_argument("--within", action="store_true", help="do not write; exit 1 unless the run's figures are the "
                    "README block's within TOLERANCE")  # fmt: skip
    ap.add_argument("--docs", type=Path, nargs="*", default=list(DOCS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lines = block_lines(args.log.read_text())
    if args.within:
        bad = disagreements(shown_lines(args.docs[0]), lines)
        for line in bad:
            print(
                f"demo_block: the run differs from {args.docs[0].name}'s demo block beyond TOLERANCE: {line}"
            )
        if not bad:
            print(
                f"demo_block: this run's figures agree with {args.docs[0].name}'s demo block (within {TOLERANCE})"
            )
        return 1 if bad else 0
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
