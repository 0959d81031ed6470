"""A schedule hook for tests (schedule/hooks.py): records its calls and every forward's rows, attaches nothing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from megatron_branch.schedule.hooks import Rows


@dataclass
class CountingHook:
    """Records bind / run / finish in `events` and every forward's rows in `rows`; changes nothing."""

    name: str = "counting"
    events: list[str] = field(default_factory=list)
    rows: list[Rows] = field(default_factory=list)

    def bind(self, schedule: str, model: Any, tree: Any, opts: Any) -> CountingHook:
        self.events.append(f"bind {schedule}")
        return self

    def run(self, step: Any, opts: Any, *, forward_only: bool) -> Any:
        self.events.append("run")
        assert self in opts.step_hooks, "the schedule gets the bound hooks in its options"
        return step(opts)

    def forward(self, model: Any, where: Rows) -> contextlib.AbstractContextManager[Any]:
        self.rows.append(where)
        return contextlib.nullcontext()

    def finish(self, result: Any, *, forward_only: bool) -> None:
        self.events.append("finish")
        result.stats["counting/forwards"] = float(len(self.rows))
