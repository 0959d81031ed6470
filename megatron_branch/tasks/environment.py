"""Environments for multi-turn rollouts in `train`: a class named as `module:Class` (like a reward's
`module:function`), built once per rollout as `Class(row, tokenizer, **environment_args)` and driven by the sampler
through the protocol in generation/multi_turn.py (`reset(prompt_ids)`, `step(turn_ids) -> EnvStep`).

`row` is the prompt's dataset row (`PromptRow.row`: "prompt" plus the line's other fields, e.g. what a tool
looks up); `tokenizer` the run's (megatron_branch.tokenizer: encode / decode / eos_id) to read the policy's turn
and write the observation's tokens. A class that cannot be imported or built is one UserError line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.tasks.reward import import_named


def load_environment(spec: str) -> type:
    """Import `module:Class` (the module must be importable: PYTHONPATH)."""
    cls = import_named(spec, "environment", "module:Class")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise UserError(f"environment {spec!r} must be a class with reset(prompt_ids) and step(turn_ids)")
    return cls


def environment_factory(
    spec: str, rows: list[Mapping[str, Any]], tokenizer: Any, args: Mapping[str, Any]
) -> Callable[[int], Any]:
    """Dataset index -> a fresh environment for that prompt. Building one for the first row now checks the
    class's arguments before any work (a bad argument is one line)."""
    cls = load_environment(spec)

    def make(i: int) -> Any:
        return cls(rows[i], tokenizer, **args)

    try:
        make(0)
    except Exception as exc:
        raise UserError(
            f"environment {spec} could not be built: {type(exc).__name__}: {exc}".replace("\n", " ")
        ) from None
    return make
