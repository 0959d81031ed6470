"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a malformed rollout, an impossible parallel size, a broken
checkpoint, an existing output without `--overwrite`). The command-line entry point prints its message on ONE
line and exits with status 2, without a traceback; under torchrun rank 0 prints it once (see docs/errors.md).
Internal invariants use `assert` instead: their failure is our bug, and the traceback is wanted.

Under torchrun an error must reach every rank the same way, or the ranks that did not see it wait in the next
collective until the process-group timeout. Two ways give that:
- `agree_on_error` (megatron_branch.parallel.groups) after distributed set-up: every rank passes its own verdict,
  every rank raises the same error, marked `all_ranks`;
- `check_on_every_rank(check)` for the validation a command runs before any work: each rank runs the same checks,
  then the verdicts are shared (a world of one just raises).
An error marked `all_ranks` is printed by rank 0 only; any other error is printed by the rank that raised it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(ValueError):
    """A one-line, user-facing error. The message says what is wrong and where (file, line, field)."""

    all_ranks: bool = False
    """True when every rank of the launch raised this same error (set by `agree_on_error`)."""

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


def launched_world_size() -> int:
    """The world size torchrun announced (1 when not launched by torchrun). Reads no process group."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_on_every_rank(check: Callable[[], T]) -> T:
    """Run a command's up-front validation on every rank and share the verdict.

    Single process: `check()` as is. Under torchrun: every rank runs `check()`, the process group is set up and
    the verdicts are exchanged, so a failure on any rank is the same `UserError` (marked `all_ranks`) on every
    rank, printed once by rank 0, and no rank walks on into a collective that the others never reach.
    """
    if launched_world_size() <= 1:
        return check()
    from megatron_branch.parallel.groups import agree_on_error, init_distributed

    result, err = None, None
    try:
        result = check()
    except UserError as e:
        err = str(e)
    init_distributed()
    agree_on_error(err, error=UserError)
    return result  # type: ignore[return-value]


def one_line(message: object) -> str:
    """A message as one line (newlines become spaces; an empty message gives the exception type's name)."""
    text = " ".join(str(message).split("\n")).strip()
    if not text and isinstance(message, BaseException):
        return type(message).__name__
    return text
