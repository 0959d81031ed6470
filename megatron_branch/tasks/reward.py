"""Rewards: a function `(prompt, response_text, row) -> float` named as `module:function`.

`row` is the prompt's dataset row (`PromptRow.row`: "prompt" plus the line's other fields). The built-in tasks'
reward is `megatron_branch.tasks.synthetic:char_match_reward`. A reward that raises, or returns something other
than a finite number, is a one-line UserError naming the reward and the prompt's `file:line`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from megatron_branch.errors import UserError
from megatron_branch.tasks.dataset import PromptRow


class RewardFn(Protocol):
    def __call__(self, prompt: str, response: str, row: Mapping[str, Any]) -> float: ...


def import_named(spec: str, what: str, form: str) -> Any:
    """`module:attribute` imported (the module must be importable: PYTHONPATH); `what` names it in the one-line
    error ("reward", "environment"), `form` is its expected spelling ("module:function")."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise UserError(f"{what} must be {form!r}, got {spec!r}")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own error at import time
        raise UserError(f"cannot import {what} module {module_name!r}: {exc}".replace("\n", " ")) from None
    found = getattr(module, attr, None)
    if found is None:
        raise UserError(f"{what} module {module_name!r} has no attribute {attr!r}")
    return found


def load_reward(spec: str) -> RewardFn:
    """Import `module:function` (e.g. "my_pkg.rewards:exact_match"); the module must be importable (PYTHONPATH)."""
    fn = import_named(spec, "reward", "module:function")
    if not callable(fn):
        raise UserError(f"reward {spec!r} is not callable")
    fn.__reward_spec__ = spec  # type: ignore[attr-defined]  (for error messages)
    return fn


def score_responses(reward: RewardFn, rows: Sequence[PromptRow], responses: Sequence[str]) -> list[float]:
    """reward(row.prompt, response, row.row) for each pair, checked to be a finite number."""
    assert len(rows) == len(responses), (len(rows), len(responses))
    name = getattr(reward, "__reward_spec__", getattr(reward, "__name__", "reward"))
    out = []
    for r, text in zip(rows, responses):
        where = r.where or "prompt"
        try:
            value = reward(r.prompt, text, r.row)
        except Exception as exc:
            raise UserError(
                f"reward {name} raised {type(exc).__name__}: {exc}".replace("\n", " "), where=where
            ) from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"reward {name} returned {value!r}: it must be a finite number", where=where)
        out.append(float(value))
    return out
