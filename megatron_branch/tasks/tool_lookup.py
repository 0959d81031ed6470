"""The embedded tool task (multi-turn): the answer is reachable only through a `lookup` tool.

    prompt       "lookup [key] then answer. k05?"
    policy       "[k05]"                       a tool call; "]" ends the policy's turn (the task's turn_end)
    observation  "=ghc;"                       the tool's answer (loss_mask 0: context, not trained)
    policy       "ghc" + eos                   the answer; the reward is its per-character match (char_match_reward)

The value is drawn per prompt and never appears in the prompt, so without the tool (`LookupEnv(tool=False)`
answers "=?;") the policy can only guess: chance is 1 / len(value_chars) per character. The table a row carries
holds its key and `num_distractors` other keys (a wrong key gets a wrong value). Deterministic in the seed, like
the other tasks (synthetic.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.generation.multi_turn import EnvStep
from megatron_branch.tasks.dataset import PromptRow
from megatron_branch.tasks.synthetic import TASKS, SyntheticTask, char_match_reward
from megatron_branch.tokenizer.protocol import Tokenizer

CALL_OPEN, CALL_CLOSE = "[", "]"


def observation(value: str | None) -> str:
    return f"={value if value is not None else '?'};"


@dataclass(kw_only=True)
class LookupTask(SyntheticTask):
    """Answer the value of a key that only the `lookup` tool knows."""

    name: ClassVar[str] = "tool_lookup"
    environment_spec: ClassVar[str] = "megatron_branch.tasks.tool_lookup:LookupEnv"
    turn_end: ClassVar[tuple[str, ...]] = (CALL_CLOSE,)
    key_len: int = 2
    key_chars: str = "0123456789"
    value_len: int = 2
    """Answer length in characters."""
    value_chars: str = "abcdefgh"
    num_distractors: int = 3
    """Other keys in the row's table."""

    def __post_init__(self) -> None:
        if min(self.key_len, self.value_len) < 1 or not self.key_chars or not self.value_chars:
            raise UserError("tool_lookup: key_len, value_len and the alphabets must be non-empty")
        if len(self.key_chars) ** self.key_len <= self.num_distractors:
            raise UserError(f"tool_lookup: {self.num_distractors} distractor keys need a longer key_len")
        if set(self.key_chars + self.value_chars) & set("[]=;?k "):
            raise UserError("tool_lookup: the alphabets must not contain '[', ']', '=', ';', '?', 'k' or ' '")

    def make(self, rng: random.Random) -> tuple[str, str]:
        raise AssertionError("tool_lookup rows carry a table: rows() builds them")

    def rows(self, num: int, seed: int) -> list[PromptRow]:
        rng = random.Random(seed)
        out = []
        for i in range(num):
            keys: list[str] = []
            while len(keys) < 1 + self.num_distractors:
                key = "k" + "".join(rng.choice(self.key_chars) for _ in range(self.key_len))
                if key not in keys:
                    keys.append(key)
            table = {k: "".join(rng.choice(self.value_chars) for _ in range(self.value_len)) for k in keys}
            out.append(
                PromptRow(
                    prompt=f"lookup [key] then answer. {keys[0]}?",
                    fields={"answer": table[keys[0]], "key": keys[0], "table": table, "task": self.name},
                    where=f"{self.name}[{i}]",
                )
            )
        return out

    def warmup_examples(self, num: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, the whole demonstration: call, the tool's answer, the answer)."""
        return [
            (
                r.prompt,
                f"{CALL_OPEN}{r.fields['key']}{CALL_CLOSE}{observation(r.fields['answer'])}{r.fields['answer']}",
            )
            for r in self.rows(num, seed)
        ]

    def warmup_rollout(self, tokenizer: Tokenizer, prompt: str, answer: str) -> Rollout:
        """The demonstration as one multi-turn rollout: the tool's answer has loss_mask 0."""
        call, rest = answer.split(CALL_CLOSE, 1)
        obs, final = rest.split(";", 1)
        parts = [
            (tokenizer.encode(call + CALL_CLOSE), True),
            (tokenizer.encode(obs + ";"), False),
            ([*tokenizer.encode(final), tokenizer.eos_id], True),
        ]
        return Rollout(
            prompt=tokenizer.encode(prompt),
            response=[t for ids, _ in parts for t in ids],
            loss_mask=[m for ids, m in parts for _ in ids],
            advantage=1.0,
        )


class LookupEnv:
    """The `lookup(key)` tool: a policy turn "[key]" is answered "=value;" (tool=False: "=?;"); any other turn is
    the final answer, rewarded by its per-character match and ending the episode."""

    def __init__(self, row: Mapping[str, Any], tokenizer: Tokenizer, *, tool: bool = True) -> None:
        self.row, self.tok, self.tool = row, tokenizer, tool

    def reset(self, prompt: tuple[int, ...]) -> None:
        pass

    def step(self, turn: tuple[int, ...]) -> EnvStep:
        text = self.tok.decode(list(turn))
        if text.startswith(CALL_OPEN) and text.endswith(CALL_CLOSE):
            key = text[1:-1]
            value = self.row["table"].get(key) if self.tool else None
            return EnvStep(observation=tuple(self.tok.encode(observation(value))))
        return EnvStep(reward=char_match_reward("", text, self.row), done=True)


TASKS[LookupTask.name] = LookupTask
