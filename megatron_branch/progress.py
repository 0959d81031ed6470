"""Progress lines for long commands: one line per phase on stderr, with the seconds since the command started.

    progress = Progress("grad", quiet=args.quiet)
    progress.phase("loading the model from hf/")     # grad: [   0.0 s] loading the model from hf/
    ...
    progress.done()                                   # grad: [  14.2 s] done

Why: `grad` printed nothing until its final JSON, and a hybrid's first step takes 14 s on a laptop (issue 35
item 9): a silent command looks hung. The lines go to stderr so that stdout keeps only the result (the JSON line
scripts parse), and only rank 0 writes them under torchrun (every rank passes the same phases). `--quiet`
(`add_quiet_argument`, the same flag in every command) silences them; errors are never silenced.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TextIO

QUIET_HELP = "no progress lines on stderr (errors and the result are still printed)"


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """The `--quiet` flag, with the same name and meaning in every command."""
    parser.add_argument("--quiet", action="store_true", help=QUIET_HELP)


def _is_rank0() -> bool:
    # torchrun's environment, not torch.distributed: progress starts before the process group exists
    return os.environ.get("RANK", "0") == "0"


class Progress:
    """Phase lines of one command run (`command` prefixes each line, as argparse's `prog: error:` does)."""

    def __init__(self, command: str, *, quiet: bool = False, stream: TextIO | None = None) -> None:
        self.command = command
        self.enabled = not quiet and _is_rank0()
        self.stream = stream
        self.start = time.perf_counter()

    def phase(self, what: str) -> None:
        """Say that `what` starts now."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        stream = self.stream if self.stream is not None else sys.stderr  # pytest's capsys swaps sys.stderr
        print(f"{self.command}: [{elapsed:6.1f} s] {what}", file=stream, flush=True)

    def done(self) -> None:
        self.phase("done")
