"""The prompt dataset: JSONL, one prompt a line, with whatever fields its reward needs.

    {"prompt": "k37:dab k05:ghc ? k05:", "answer": "ghc"}

`prompt` (a non-empty string) is required; every other key is kept in `PromptRow.fields` and handed to the reward
as `row`. Blank lines are skipped. Any problem is a one-line UserError naming `file:line`.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_branch.data.rollouts import iter_jsonl
from megatron_branch.errors import UserError
from megatron_branch.outputs import apply_umask


@dataclass(frozen=True, kw_only=True)
class PromptRow:
    prompt: str
    """The prompt text (tokenized by the run's tokenizer)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Every other key of the line (the reward's `row` is `{"prompt": ..., **fields}`)."""
    where: str = ""
    """`file:line` it came from (for error messages), "" when built in memory."""

    @property
    def row(self) -> dict[str, Any]:
        return {"prompt": self.prompt, **self.fields}


def parse_prompt_row(obj: Any, *, where: str) -> PromptRow:
    if not isinstance(obj, dict):
        raise UserError(f"expected a JSON object, got {type(obj).__name__}", where=where)
    if "prompt" not in obj:
        raise UserError("missing field 'prompt'", where=where)
    prompt = obj["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise UserError(f"'prompt' must be a non-empty string, got {prompt!r:.40}", where=where)
    return PromptRow(prompt=prompt, fields={k: v for k, v in obj.items() if k != "prompt"}, where=where)


def read_prompts_jsonl(path: str | Path, *, required: Sequence[str] = ()) -> list[PromptRow]:
    """Read prompt rows; `required` names fields every row must have (e.g. the reward's "answer")."""
    rows = []
    for obj, where in iter_jsonl(path, "prompt"):
        row = parse_prompt_row(obj, where=where)
        for name in required:
            if name not in row.fields:
                raise UserError(f"missing field {name!r} (the reward needs it)", where=where)
        rows.append(row)
    if not rows:
        raise UserError("no prompts", where=str(path))
    return rows


def write_prompts_jsonl(path: str | Path, rows: Sequence[PromptRow | Mapping[str, Any]]) -> None:
    """Write rows (PromptRow or plain dicts with a "prompt") atomically in the format `read_prompts_jsonl` reads."""
    path = Path(path)
    lines = []
    for r in rows:
        obj = r.row if isinstance(r, PromptRow) else dict(r)
        lines.append(json.dumps(obj, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    apply_umask(tmp)  # mkstemp made it 0600
    os.replace(tmp, path)
