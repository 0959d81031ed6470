"""Multi-turn rollouts: the environment protocol a user implements, the turn settings (verl's `rollout.multi_turn`
names), and the turn bookkeeping of `BranchSampler` (sampler.py): when a policy turn ends, what the environment
appends, when a trajectory forks at a turn.

A rollout is the prompt, then assistant turn 1, observation 1, assistant turn 2, ... as ONE response. The policy
samples a turn until it samples a turn-end token (`turn_end_token_ids`: a tool-call close, an end-of-turn mark), a
stop token (the rollout ends) or the response budget. The environment then `step`s on the turn's tokens and
returns an observation (token ids), a reward and done. The observation joins the response with loss_mask 0: it is
fed to the model one token per decode step onto the branch's cached K/V (and a hybrid's state row), exactly as a
sampled token is fed, so no earlier turn is ever run again. verl's bounds apply (verl
`experimental/agent_loop/tool_agent_loop.py`): at most `max_assistant_turns` policy turns and `max_user_turns`
observations, each observation cut to `max_tool_response_length` tokens (and to the response budget).

Branching at turns (`branch_at_turns`, like SamplingParams.branch_at for token counts): once a trajectory has
finished assistant turn t (t in branch_at_turns) and its observation, it forks into `branch_factor` children that
share every earlier turn (observation included: its K/V is cached once) and sample turn t + 1 apart. Each child
continues with its own copy of the environment (`copy.deepcopy`): an environment must be deep-copyable and
deterministic given the turns it was shown (every TP rank runs it on the same tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from megatron_branch.errors import SettingError
from megatron_branch.rules import API, check_multi_turn

if TYPE_CHECKING:
    from megatron_branch.generation.branches import Branch


@dataclass(frozen=True, kw_only=True)
class EnvStep:
    """What the environment answers to one policy turn."""

    observation: tuple[int, ...] = ()
    """Token ids appended after the turn (a tool's output, a user turn), loss_mask 0; ignored when the rollout
    ends here."""
    reward: float = 0.0
    """Added to the rollout's reward (the sum over its turns is the rollout's reward)."""
    done: bool = False
    """The episode is over: the rollout ends after this turn."""


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment (one instance per trajectory; a fork deep-copies it)."""

    def reset(self, prompt: tuple[int, ...]) -> None:
        """Start an episode from the prompt's token ids."""

    def step(self, turn: tuple[int, ...]) -> EnvStep:
        """The policy's turn (its sampled tokens, the turn-end or stop token included) -> the answer."""


EnvFactory = Callable[[int], Environment]
"""Prompt index (in the `generate` call) -> a fresh environment for that prompt (reset by the sampler)."""


def _optional_positive(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise SettingError(
            lambda s: f"{s.name(name)} must be a positive int or null (no limit), got {value!r}"
        )


@dataclass(kw_only=True)
class MultiTurnParams:
    """The turn loop's settings (SamplingParams.multi_turn). Validated on construction (errors.SettingError)."""

    turn_end_token_ids: tuple[int, ...]
    """Sampling one of these ends the policy's turn (the token is kept and trained); the environment answers."""
    max_assistant_turns: int | None = None
    """Most policy turns per rollout (verl's name); None = only the response budget bounds them."""
    max_user_turns: int | None = None
    """Most observations appended per rollout (verl's name); None = no limit."""
    max_tool_response_length: int | None = None
    """An observation longer than this is cut to its first tokens (verl's name); None = no cut."""
    branch_at_turns: tuple[int, ...] = ()
    """After these numbers of finished assistant turns (increasing, >= 1) each trajectory forks into
    SamplingParams.branch_factor continuations sharing every earlier turn."""

    def __post_init__(self) -> None:
        self.turn_end_token_ids = tuple(int(t) for t in self.turn_end_token_ids)
        self.branch_at_turns = tuple(int(t) for t in self.branch_at_turns)
        try:
            for name in ("max_assistant_turns", "max_user_turns", "max_tool_response_length"):
                _optional_positive(name, getattr(self, name))
            check_multi_turn(
                turn_end_token_ids=self.turn_end_token_ids, branch_at_turns=self.branch_at_turns,
                max_assistant_turns=self.max_assistant_turns,
            )  # fmt: skip
        except SettingError as e:
            raise SettingError(e.say, spelling=API) from None


def start(branch: Branch, env: Environment, prompt: tuple[int, ...]) -> None:
    """A root branch's environment, reset from its prompt."""
    env.reset(prompt)
    branch.env = env


def forks_at_turn(branch: Branch) -> bool:
    """A branch about to sample the first token of a turn after a fork turn (its observation all fed)."""
    return branch.fork_pending and not branch.forced


def end_turns(branches: Sequence[Branch], mt: MultiTurnParams, max_new_tokens: int) -> None:
    """After sampling: each branch whose newest token ends its turn asks its environment; the rollout goes on
    (the observation queued to be fed) or ends."""
    ends = set(mt.turn_end_token_ids)
    for b in branches:
        token = b.tokens[-1]
        if not (b.done or token in ends):
            continue
        b.turns += 1
        answer = b.env.step(tuple(b.tokens[b.turn_start :]))
        if not isinstance(answer, EnvStep):
            raise TypeError(f"Environment.step must return an EnvStep, got {type(answer).__name__}")
        b.reward += float(answer.reward)
        if b.done:
            continue
        if (
            answer.done
            or (mt.max_assistant_turns is not None and b.turns >= mt.max_assistant_turns)
            or (mt.max_user_turns is not None and b.observations >= mt.max_user_turns)
        ):
            b.done = "stop"
            continue
        obs = list(answer.observation)[: mt.max_tool_response_length]
        b.forced = obs[: max_new_tokens - len(b.tokens)]
        b.observations += 1
        b.turn_start = len(b.tokens) + len(b.forced)
        b.fork_pending = b.turns in mt.branch_at_turns


def append_forced(branch: Branch, logprob: float, max_new_tokens: int) -> None:
    """The next observation token joins the response (loss_mask 0; its policy logprob kept for the record)."""
    branch.tokens.append(branch.forced.pop(0))
    branch.mask.append(False)
    branch.logprobs.append(logprob)
    branch.sampling_logprobs.append(0.0)
    if len(branch.tokens) == max_new_tokens:
        branch.done = "length"
