"""The loop's data: the tokenizer, the prompts (a built-in task or a JSONL file) with their reward, DPO pairs.

Everything is read and checked at start-up, before the run folder exists (a bad file is one line naming it);
the sentencepiece tokenizer is trained into the (temporary) run folder's `tokenizer/`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.train.config import TrainConfig

RewardFn = Callable[[str, str, dict], float]


@dataclass(kw_only=True)
class Dataset:
    """Prompts (text and ids), the reward, and optionally reference answers (for the supervised warm-up)."""

    tokenizer: Any
    """megatron_branch.tokenizer.Tokenizer."""
    tokenizer_dir: Path | None
    """Folder of the tokenizer files (copied into the HF export)."""
    rows: list[dict[str, Any]]
    """One dict per prompt: "prompt" (text) and whatever the reward needs."""
    prompts: list[tuple[int, ...]]
    """Token ids of each prompt."""
    reward_fn: RewardFn
    """(prompt text, response text, row) -> float."""
    answers: list[tuple[int, ...]] | None = None
    """Reference answer ids (eos appended) per prompt, when the task has them."""
    pairs: list[dict[str, tuple[int, ...]]] | None = None
    """DPO: {"prompt", "chosen", "rejected"} ids per pair."""

    def __len__(self) -> int:
        return len(self.pairs) if self.pairs is not None else len(self.prompts)

    @property
    def max_prompt_tokens(self) -> int:
        if self.pairs is not None:
            return max(len(p["prompt"]) + max(len(p["chosen"]), len(p["rejected"])) for p in self.pairs)
        return max(len(p) for p in self.prompts)

    def prompt_ids(self, i: int) -> tuple[int, ...]:
        return self.prompts[i]

    def reward(self, i: int, response: Sequence[int]) -> float:
        text = self.tokenizer.decode(list(response))
        value = self.reward_fn(self.rows[i]["prompt"], text, self.rows[i])
        return float(value)

    def stop_token_ids(self, stop: Sequence[str]) -> tuple[int, ...]:
        """eos plus each stop string (each must be a single token of this tokenizer)."""
        ids = [self.tokenizer.eos_id]
        for text in stop:
            enc = self.tokenizer.encode(text)
            if len(enc) != 1:
                raise UserError(
                    f"rollout.stop: {text!r} is {len(enc)} tokens; stop strings must be one token"
                )
            ids.append(enc[0])
        return tuple(dict.fromkeys(ids))

    def reference_answers(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
        if self.answers is None:
            return None
        return list(zip(self.prompts, self.answers))


def load_reward(spec: str) -> RewardFn:
    """ "module:function" -> the function (a one-line error when it cannot be imported)."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UserError(f"data.reward: cannot import {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise UserError(f"data.reward: {mod_name!r} has no function {fn_name!r}")
    return fn


def _read_jsonl(path: str, required: Sequence[str]) -> list[dict[str, Any]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read: {getattr(e, 'strerror', None) or e}", where=path) from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"invalid JSON ({e.msg} at column {e.colno})", where=where) from None
        if not isinstance(row, dict):
            raise UserError(f"expected a JSON object, got {type(row).__name__}", where=where)
        for key in required:
            if not isinstance(row.get(key), str) or not row[key]:
                raise UserError(f"field {key!r} must be a non-empty string", where=where)
        rows.append(row)
    if not rows:
        raise UserError("no rows", where=path)
    return rows


def _tokenizer(cfg: TrainConfig, run_dir: Path, corpus: Callable[[], list[str]]) -> tuple[Any, Path | None]:
    from megatron_branch.tokenizer import HFTokenizer, SentencePieceTokenizer

    t = cfg.tokenizer
    if t.type == "hf":
        folder = t.path or cfg.model.hf_path
        return HFTokenizer(folder), Path(folder)
    if t.path is not None:
        return SentencePieceTokenizer(t.path), None
    folder = run_dir / "tokenizer"
    return SentencePieceTokenizer.train_or_load(
        folder, corpus(), vocab_size=t.vocab_size, model_type=t.model_type
    ), None


def load_dataset(cfg: TrainConfig, run_dir: Path) -> Dataset:
    d = cfg.data
    if cfg.algorithm.name == "dpo":
        rows = _read_jsonl(d.pairs_file, ("prompt", "chosen", "rejected"))  # type: ignore[arg-type]
        tok, tok_dir = _tokenizer(
            cfg,
            run_dir,
            lambda: [r[k].replace("\n", " ") for r in rows for k in ("prompt", "chosen", "rejected")],
        )
        eos = (tok.eos_id,)
        pairs = [
            {"prompt": tuple(tok.encode(r["prompt"])), "chosen": tuple(tok.encode(r["chosen"])) + eos,
             "rejected": tuple(tok.encode(r["rejected"])) + eos}
            for r in rows
        ]  # fmt: skip
        for j, p in enumerate(pairs):
            if p["chosen"] == p["rejected"]:
                raise UserError("chosen and rejected are the same text", where=f"{d.pairs_file}:{j + 1}")
        return Dataset(
            tokenizer=tok, tokenizer_dir=tok_dir, rows=rows, prompts=[p["prompt"] for p in pairs],
            reward_fn=_no_reward, pairs=pairs,
        )  # fmt: skip
    if d.task is not None:
        return _task_dataset(cfg, run_dir)
    rows = _read_jsonl(d.train_files, ("prompt",))  # type: ignore[arg-type]
    reward = load_reward(d.reward)  # type: ignore[arg-type]
    tok, tok_dir = _tokenizer(cfg, run_dir, lambda: [r["prompt"].replace("\n", " ") for r in rows])
    prompts = [tuple(tok.encode(r["prompt"])) for r in rows]
    _check_prompt_lengths(prompts, cfg, where=str(d.train_files))
    return Dataset(tokenizer=tok, tokenizer_dir=tok_dir, rows=rows, prompts=prompts, reward_fn=reward)


def _no_reward(prompt: str, response: str, row: dict) -> float:
    raise AssertionError("DPO has no reward")


def _check_prompt_lengths(prompts: list[tuple[int, ...]], cfg: TrainConfig, *, where: str) -> None:
    limit = cfg.data.max_prompt_length
    for j, p in enumerate(prompts):
        if not p:
            raise UserError("empty prompt", where=f"{where}:{j + 1}")
        if limit is not None and len(p) > limit:
            raise UserError(
                f"prompt has {len(p)} tokens, more than data.max_prompt_length={limit}",
                where=f"{where}:{j + 1}",
            )


def _task_dataset(cfg: TrainConfig, run_dir: Path) -> Dataset:
    raise UserError(f"data.task={cfg.data.task!r}: no built-in tasks yet")
