"""Built-in verifiable long-prompt tasks: the answer can only be found by reading the prompt.

    kv_retrieval  "k37:dab k05:ghc k61:fea ... ? k05:"  -> "ghc"   (find the key in a haystack, copy its value)
    copy_span     "hgabf[cadd]ebhaag ... ? copy:"       -> "cadd"  (copy the span between the brackets)
    needles       "hgaCbfdeHbhaJag ... ? find:"         -> "CHJ"   (the one letter of each needle alphabet)

Each task is a small dataclass (sizes, alphabets) whose generators are deterministic in a seed
(`random.Random(seed)`, never `hash()`), so prompts, warm-up examples and tokenizer text are the same in every
process. Use different seeds for warm-up, training and evaluation prompts. The reward is per-character partial
credit in [0, 1] (`char_match_reward`): a small value alphabet and partial credit make the reward rise smoothly
for a tiny model, which is what a demo needs. Prompt length grows with `num_pairs` / `length`.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.tasks.dataset import PromptRow
from megatron_branch.tokenizer.protocol import Tokenizer


def char_match_reward(prompt: str, response: str, row: Mapping[str, Any]) -> float:
    """Fraction of answer characters reproduced at their position; extra characters count against it:
    matches / max(len(answer), len(response)), in [0, 1] (1 = exact). Surrounding whitespace is ignored."""
    answer, got = str(row["answer"]), response.strip()
    if not answer and not got:
        return 1.0
    matches = sum(a == b for a, b in zip(answer, got))
    return matches / max(len(answer), len(got))


@dataclass(kw_only=True)
class SyntheticTask(ABC):
    """Base: subclasses define `make(rng) -> (prompt, answer)`."""

    name: ClassVar[str] = ""
    reward_spec: ClassVar[str] = "megatron_branch.tasks.synthetic:char_match_reward"

    @abstractmethod
    def make(self, rng: random.Random) -> tuple[str, str]:
        """One (prompt, answer) pair drawn from `rng`."""

    @staticmethod
    def reward(prompt: str, response: str, row: Mapping[str, Any]) -> float:
        return char_match_reward(prompt, response, row)

    def rows(self, num: int, seed: int) -> list[PromptRow]:
        """`num` prompt rows {"prompt", "answer", "task"}, deterministic in `seed`."""
        rng = random.Random(seed)
        out = []
        for i in range(num):
            prompt, answer = self.make(rng)
            out.append(
                PromptRow(
                    prompt=prompt, fields={"answer": answer, "task": self.name}, where=f"{self.name}[{i}]"
                )
            )
        return out

    def warmup_examples(self, num: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, correct answer) pairs for a supervised warm-up."""
        return [(r.prompt, r.fields["answer"]) for r in self.rows(num, seed)]

    def warmup_rollout(self, tokenizer: Tokenizer, prompt: str, answer: str) -> Rollout:
        """One supervised warm-up rollout: response = answer + eos, advantage 1 (a multi-turn task adds its
        tool call and the tool's answer, loss_mask 0 on the latter)."""
        return Rollout(
            prompt=tokenizer.encode(prompt),
            response=[*tokenizer.encode(answer), tokenizer.eos_id],
            advantage=1.0,
        )

    def corpus(self, num: int = 200, seed: int = 12345) -> list[str]:
        """Lines of task text (prompt + answer) to train the tokenizer on: it covers the whole alphabet."""
        return [p + a for p, a in self.warmup_examples(num, seed)]


@dataclass(kw_only=True)
class KeyValueTask(SyntheticTask):
    """Retrieve the value stored under a key in a haystack of `num_pairs` distinct key:value pairs."""

    name: ClassVar[str] = "kv_retrieval"
    num_pairs: int = 8
    """Pairs in the haystack (prompt length ~ num_pairs * (key_len + value_len + 3) characters)."""
    key_len: int = 2
    key_chars: str = "0123456789"
    value_len: int = 3
    """Answer length in characters."""
    value_chars: str = "abcdefgh"
    """A small value alphabet: chance is 1/len per character, so partial credit rises smoothly."""

    def __post_init__(self) -> None:
        if (
            min(self.num_pairs, self.key_len, self.value_len) < 1
            or not self.key_chars
            or not self.value_chars
        ):
            raise UserError("kv_retrieval: num_pairs, key_len, value_len and the alphabets must be non-empty")
        if len(self.key_chars) ** self.key_len < self.num_pairs:
            raise UserError(
                f"kv_retrieval: {self.num_pairs} distinct keys need more than key_len={self.key_len}"
            )
        if set(self.key_chars + self.value_chars) & set("k: ?"):
            raise UserError("kv_retrieval: the alphabets must not contain 'k', ':', ' ' or '?'")

    def make(self, rng: random.Random) -> tuple[str, str]:
        keys: list[str] = []
        while len(keys) < self.num_pairs:
            key = "".join(rng.choice(self.key_chars) for _ in range(self.key_len))
            if key not in keys:
                keys.append(key)
        values = ["".join(rng.choice(self.value_chars) for _ in range(self.value_len)) for _ in keys]
        q = rng.randrange(self.num_pairs)
        hay = " ".join(f"k{k}:{v}" for k, v in zip(keys, values))
        return f"{hay} ? k{keys[q]}:", values[q]


@dataclass(kw_only=True)
class CopySpanTask(SyntheticTask):
    """Copy the `span_len` characters between brackets hidden in `length` random filler characters."""

    name: ClassVar[str] = "copy_span"
    length: int = 48
    span_len: int = 4
    chars: str = "abcdefgh"

    def __post_init__(self) -> None:
        if self.span_len < 1 or self.length < self.span_len or not self.chars:
            raise UserError("copy_span: need 1 <= span_len <= length and a non-empty alphabet")
        if set(self.chars) & set("[] "):
            raise UserError("copy_span: the alphabet must not contain brackets or spaces")

    def make(self, rng: random.Random) -> tuple[str, str]:
        filler = "".join(rng.choice(self.chars) for _ in range(self.length))
        span = "".join(rng.choice(self.chars) for _ in range(self.span_len))
        at = rng.randrange(self.length + 1)
        return f"{filler[:at]}[{span}]{filler[at:]} ? copy:", span


@dataclass(kw_only=True)
class NeedleTask(SyntheticTask):
    """Find the needles hidden in a haystack: needle i is the one letter of alphabet i in the text (placed
    anywhere); the answer lists them in alphabet order. Each answer character is found by ONE content lookup
    (no induction circuit needed), so a tiny model learns it in a short warm-up: the demo task."""

    name: ClassVar[str] = "needles"
    length: int = 48
    """Filler characters (the prompt is length + num_needles + 7 characters)."""
    num_needles: int = 3
    """Answer length."""
    filler_chars: str = "abcdefgh"
    needle_alphabets: tuple[str, ...] = ("ABCD", "EFGH", "IJKL", "MNOP", "QRST", "UVWX")
    """Alphabet of needle i (chance = 1 / len per answer character)."""

    def __post_init__(self) -> None:
        if (
            not 1 <= self.num_needles <= len(self.needle_alphabets)
            or self.length < 1
            or not self.filler_chars
        ):
            raise UserError(f"needles: need 1 <= num_needles <= {len(self.needle_alphabets)} and length >= 1")
        used = [set(a) for a in self.needle_alphabets[: self.num_needles]] + [set(self.filler_chars)]
        if sum(len(u) for u in used) != len(set().union(*used)) or set().union(*used) & set(" ?"):
            raise UserError(
                "needles: the filler and needle alphabets must be disjoint (and without ' ' or '?')"
            )

    def make(self, rng: random.Random) -> tuple[str, str]:
        text = [rng.choice(self.filler_chars) for _ in range(self.length)]
        needles = [rng.choice(a) for a in self.needle_alphabets[: self.num_needles]]
        for ch in needles:
            text.insert(rng.randrange(len(text) + 1), ch)
        return f"{''.join(text)} ? find:", "".join(needles)


TASKS: dict[str, type[SyntheticTask]] = {
    KeyValueTask.name: KeyValueTask,
    CopySpanTask.name: CopySpanTask,
    NeedleTask.name: NeedleTask,
}


def get_task(name: str, **options: Any) -> SyntheticTask:
    """A built-in task by name with its size options (UserError for an unknown name or option)."""
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    try:
        return TASKS[name](**options)
    except TypeError as exc:
        raise UserError(f"task {name}: {exc}") from None


def warmup_rollouts(task: SyntheticTask, tokenizer: Tokenizer, num: int, seed: int) -> list[Rollout]:
    """Supervised warm-up data as rollouts: response = answer + eos, advantage 1. Trained with the on-policy
    objective (`PolicyGradientObjective.grpo([1.0] * N, T)`) the loss is the token-mean NLL of the answers: SFT."""
    return [task.warmup_rollout(tokenizer, p, a) for p, a in task.warmup_examples(num, seed)]


def decode_responses(tokenizer: Tokenizer, responses: Sequence[Sequence[int]]) -> list[str]:
    """Response ids -> text for the reward (special tokens such as eos dropped)."""
    return [tokenizer.decode(r) for r in responses]
