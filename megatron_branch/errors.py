"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a malformed rollout, an impossible parallel size, a broken
checkpoint, an existing output without `--overwrite`). The command-line entry point prints its message on ONE
line and exits with status 2, without a traceback; under torchrun rank 0 prints it once (see docs/errors.md).
Internal invariants use `assert` instead: their failure is our bug, and the traceback is wanted.

Under torchrun every rank must raise the same error (megatron_branch/parallel/agree.py: `agree_on_error`,
`check_on_every_rank`); an error marked `all_ranks` is printed by rank 0 only. This module imports nothing of the
package: every floor may raise a UserError.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class UserError(ValueError):
    """A one-line, user-facing error. The message says what is wrong and where (file, line, field)."""

    all_ranks: bool = False
    """True when every rank of the launch raised this same error (set by `agree_on_error`)."""

    def __init__(self, message: str, *, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


@dataclass(frozen=True)
class Spelling:
    """How one entry point names settings in its messages: `--cp 2` on a command line, `parallel.cp=2` in a config.

    `names` maps a setting (the field name every layer uses: `cp`, `recompute_layers`, `clip_ratio_c`) to how the
    user writes it; a setting not listed is written as its flag (`--recompute-layers`)."""

    names: Mapping[str, str] = field(default_factory=dict)
    """setting -> its spelling at this entry point."""
    assign: str = " "
    """Between a setting and its value: " " for flags (`--cp 2`), "=" for config keys (`parallel.cp=2`)."""

    def name(self, setting: str) -> str:
        return self.names.get(setting) or "--" + setting.replace("_", "-")

    def value(self, setting: str, value: object) -> str:
        return f"{self.name(setting)}{self.assign}{value}"


FLAGS = Spelling()
"""The command-line spelling (`--tp 2`): what a SettingError says unless an entry point re-spells it."""


class SettingError(UserError):
    """A UserError about settings, worded once for every entry point: `say(spelling)` writes the message.

    The rule that raises it does not know whether the user typed `--cp 2` or `parallel.cp=2`; str() is the
    command-line wording (or `spelling`'s: a library type re-raises its rules' errors in its own names, e.g.
    SamplingParams in rules.API's), and an entry point with other names re-raises `e.spelled(its_spelling)`."""

    def __init__(self, say: Callable[[Spelling], str], *, spelling: Spelling | None = None) -> None:
        self.say = say
        super().__init__(say(spelling or FLAGS))

    def spelled(self, spelling: Spelling) -> UserError:
        return UserError(self.say(spelling))


def launched_world_size() -> int:
    """The world size torchrun announced (1 when not launched by torchrun). Reads no process group."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def one_line(message: object) -> str:
    """A message as one line (newlines become spaces; an empty message gives the exception type's name)."""
    text = " ".join(str(message).split("\n")).strip()
    if not text and isinstance(message, BaseException):
        return type(message).__name__
    return text
