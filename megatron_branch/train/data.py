"""The loop's data: the tokenizer, the prompts (a built-in task or a JSONL file) with their reward, or preference
pairs (an offline algorithm: DPO).

Everything is read and checked at start-up, before the run folder exists (a bad file is one line naming it);
the sentencepiece tokenizer is trained into the (temporary) run folder's `tokenizer/`.
"""

from __future__ import annotations

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
    rows: list[Any]
    """megatron_branch.tasks.PromptRow per prompt (its text and whatever the reward needs)."""
    prompts: list[tuple[int, ...]]
    """Token ids of each prompt."""
    reward_fn: RewardFn
    """(prompt text, response text, row) -> float."""
    warmup: Callable[[int, int], list[Any]] | None = None
    """(num, seed) -> supervised warm-up rollouts (answer + eos, advantage 1), when the task has answers."""
    pairs: list[dict[str, tuple[int, ...]]] | None = None
    """DPO: {"prompt", "chosen", "rejected"} ids per pair."""
    environment: Callable[[int], Any] | None = None
    """Multi-turn (rollout.multi_turn.enable): prompt index -> a fresh environment (tasks/environment.py)."""
    turn_end_ids: tuple[int, ...] = ()
    """Multi-turn: the token ids that end a policy turn (rollout.multi_turn.turn_end, or the task's)."""

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
        from megatron_branch.tasks import score_responses

        return score_responses(self.reward_fn, [self.rows[i]], [self.tokenizer.decode(list(response))])[0]

    def stop_token_ids(self, stop: Sequence[str]) -> tuple[int, ...]:
        """eos plus each stop string (each must be a single token of this tokenizer)."""
        return tuple(
            dict.fromkeys([self.tokenizer.eos_id, *_one_token_each(self.tokenizer, stop, "rollout.stop")])
        )


def _one_token_each(tok: Any, texts: Sequence[str], key: str) -> list[int]:
    ids = []
    for text in texts:
        enc = tok.encode(text)
        if len(enc) != 1:
            raise UserError(f"{key}: {text!r} is {len(enc)} tokens; each must be one token")
        ids.append(enc[0])
    return ids


def _attach_environment(cfg: TrainConfig, ds: Dataset, task: Any = None) -> Dataset:
    """rollout.multi_turn: the environment per prompt and the turn-end ids (the task's own when not given)."""
    from megatron_branch.tasks.environment import environment_factory

    m = cfg.rollout.multi_turn
    if not m.enable:
        return ds
    spec = m.environment or getattr(task, "environment_spec", None)
    if spec is None:
        raise UserError(f"data.task={cfg.data.task} has no environment: give rollout.multi_turn.environment")
    ends = m.turn_end or list(getattr(task, "turn_end", ()))
    if not ends:
        raise UserError(
            "rollout.multi_turn.turn_end: name at least one string (one token) that ends a policy turn"
        )
    ds.turn_end_ids = tuple(_one_token_each(ds.tokenizer, ends, "rollout.multi_turn.turn_end"))
    ds.environment = environment_factory(spec, [r.row for r in ds.rows], ds.tokenizer, m.environment_args)
    return ds


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


def load_dataset(cfg: TrainConfig, run_dir: Path, *, pairs: bool = False) -> Dataset:
    """The prompts and reward (a task or data.train_files), or with `pairs` (an offline algorithm: DPO) the
    preference pairs of data.pairs_file."""
    d = cfg.data
    if pairs:
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
    from megatron_branch.tasks import load_reward, read_prompts_jsonl

    rows = read_prompts_jsonl(d.train_files)  # type: ignore[arg-type]
    reward = _no_reward if cfg.rollout.multi_turn.enable else load_reward(d.reward)  # type: ignore[arg-type]
    tok, tok_dir = _tokenizer(cfg, run_dir, lambda: [r.prompt.replace("\n", " ") for r in rows])
    prompts = [tuple(tok.encode(r.prompt)) for r in rows]
    _check_prompt_lengths(prompts, rows, cfg)
    ds = Dataset(tokenizer=tok, tokenizer_dir=tok_dir, rows=rows, prompts=prompts, reward_fn=reward)
    return _attach_environment(cfg, ds)


def _no_reward(prompt: str, response: str, row: dict) -> float:
    raise AssertionError("DPO has no reward; a multi-turn rollout's is its environment's")


def _check_prompt_lengths(prompts: list[tuple[int, ...]], rows: list[Any], cfg: TrainConfig) -> None:
    limit = cfg.data.max_prompt_length
    for p, r in zip(prompts, rows):
        if not p:
            raise UserError("the prompt encodes to no tokens", where=r.where)
        if limit is not None and len(p) > limit:
            raise UserError(
                f"prompt has {len(p)} tokens, more than data.max_prompt_length={limit}", where=r.where
            )


def _task_dataset(cfg: TrainConfig, run_dir: Path) -> Dataset:
    """A built-in synthetic task: `data.num_prompts` rows from `data.seed`, warm-up answers from other seeds."""
    from megatron_branch.tasks import get_task, load_reward, warmup_rollouts

    d = cfg.data
    task = get_task(d.task, **d.task_args)  # type: ignore[arg-type]
    rows = task.rows(d.num_prompts, seed=d.seed)
    tok, tok_dir = _tokenizer(cfg, run_dir, lambda: task.corpus())
    prompts = [tuple(tok.encode(r.prompt)) for r in rows]
    _check_prompt_lengths(prompts, rows, cfg)
    reward = load_reward(d.reward or task.reward_spec)
    ds = Dataset(
        tokenizer=tok, tokenizer_dir=tok_dir, rows=rows, prompts=prompts, reward_fn=reward,
        warmup=lambda num, seed: warmup_rollouts(task, tok, num, seed),
    )  # fmt: skip
    return _attach_environment(cfg, ds, task)
