"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a malformed rollout, an impossible parallel size, a broken
checkpoint). The command-line entry points print its message on one line and exit with status 2, without a
traceback. Internal invariants use `assert` instead: their failure is our bug, and the traceback is wanted.
"""

from __future__ import annotations


class UserError(ValueError):
    """A one-line, user-facing error. The message says what is wrong and where (file, line, field)."""

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)
