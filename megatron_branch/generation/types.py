"""What a rollout generator takes and returns, and the `Generator` protocol an external engine would implement.

`SamplingParams` says how to sample (verl's `rollout.*` names where verl has one); a generator returns, per prompt,
`n` `Sample`s (prompt ids, response ids, the policy's logprob of every response token) and a `GenerationStats`.
`BranchSampler` (sampler.py) is the built-in generator: it prefills each prompt once and decodes all of its
branches in one batch against the prompt's K/V. An external engine (vLLM, SGLang) plugs in by implementing
`Generator.generate` with the same contract; see docs/generation.md for what it must guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import SettingError
from megatron_branch.rules import API, check_sampling


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingError(lambda s: f"{s.name(name)} must be a positive int, got {value!r}")


@dataclass(kw_only=True)
class SamplingParams:
    """How continuations are sampled. Validated on construction: a ValueError (errors.SettingError) naming the
    field, `SamplingParams.n`; an entry point with other names re-spells it (train: `rollout.n`)."""

    n: int = 1
    """Rollouts per prompt (verl `rollout.n`; the GRPO group size). With `branch_at`, the number of LEAVES."""
    max_new_tokens: int
    """Most tokens sampled per rollout (a stop token counts and is kept in the response)."""
    temperature: float = 1.0
    """Softmax temperature of the SAMPLING distribution; 0 = greedy (argmax, ties to the lowest id)."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling (0 = off). Applied after the temperature."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches top_p (1 = off). After top_k."""
    stop_token_ids: tuple[int, ...] = ()
    """Sampling one of these ends the rollout (the token is part of the response, so training sees it)."""
    branch_at: tuple[int, ...] = ()
    """Tree sampling: after k sampled tokens (k in branch_at, increasing, 0 < k < max_new_tokens) every branch forks
    into `branch_factor` branches that share its tokens (and their K/V). Empty = plain G-way sampling."""
    branch_factor: int = 2
    """Children per fork point; n must be divisible by branch_factor ** len(branch_at)."""
    share_prefix: bool = True
    """Prefill each prompt once for its n samples (True), or every sample its own prefill, as an engine without
    prefix caching does (False: the baseline; the same draws, hence the same tokens, for the same generator).
    False cannot fork (`branch_at`): rules.check_sampling."""
    multi_turn: Any = None
    """Multi-turn rollouts (multi_turn.MultiTurnParams: turn-end tokens, verl's turn bounds, `branch_at_turns`):
    `generate` then needs `environments=`. None = one policy turn per rollout."""

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.branch_at = tuple(int(k) for k in self.branch_at)
        try:
            self._check()
        except SettingError as e:  # a ValueError in the library's names (rules.API: SamplingParams.n, ...);
            raise SettingError(e.say, spelling=API) from None  # train's config re-spells it in its keys

    def _check(self) -> None:
        """Each field on its own, then the rules between them (rules.check_sampling); SettingErrors."""
        _positive_int("n", self.n)
        _positive_int("max_new_tokens", self.max_new_tokens)
        _positive_int("branch_factor", self.branch_factor)
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (math.isfinite(t) and t >= 0):
            raise SettingError(lambda s: f"{s.name('temperature')} must be >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SettingError(lambda s: f"{s.name('top_k')} must be an int >= 0 (0 = off), got {k!r}")
        if not 0.0 < p <= 1.0:
            raise SettingError(lambda s: f"{s.name('top_p')} must be in (0, 1], got {p!r}")
        stops = self.stop_token_ids
        if any(tok < 0 for tok in stops):
            raise SettingError(lambda s: f"{s.name('stop_token_ids')} must be >= 0, got {stops}")
        check_sampling(
            n=self.n, max_new_tokens=self.max_new_tokens, branch_at=self.branch_at,
            branch_factor=self.branch_factor, share_prefix=self.share_prefix, branch_at_turns=self.branch_at_turns,
        )  # fmt: skip

    @property
    def branch_at_turns(self) -> tuple[int, ...]:
        return () if self.multi_turn is None else self.multi_turn.branch_at_turns

    @property
    def root_fanout_divisor(self) -> int:
        return self.branch_factor ** (len(self.branch_at) + len(self.branch_at_turns))

    @property
    def root_fanout(self) -> int:
        """Branches sampled straight from the prompt (n when there is no tree sampling)."""
        return self.n // self.root_fanout_divisor

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One sampled continuation of one prompt."""

    prompt_index: int
    """Index of its prompt in the `generate` call."""
    prompt: tuple[int, ...]
    """Prompt token ids."""
    response: tuple[int, ...]
    """Sampled token ids (a stop token, if one was sampled, is the last)."""
    logprobs: tuple[float, ...]
    """log pi(token | context) of each response token under the POLICY at temperature 1, over the whole (real)
    vocabulary: what the training forward computes for that token, hence PPO's `old_logprobs`. It does not depend
    on temperature/top_k/top_p (see `sampling_logprobs`)."""
    sampling_logprobs: tuple[float, ...]
    """log q(token) under the distribution actually sampled from (temperature, top_k, top_p applied); 0 for greedy.
    Equals `logprobs` when temperature = 1 and no filter is active. Kept for off-policy corrections."""
    finish_reason: str
    """"stop" (a stop token was sampled) or "length" (max_new_tokens reached)."""
    routed_experts: Any = field(default=None, compare=False)
    """MoE routing replay (BranchSampler(record_routing=True)): int32 [len(prompt) + len(response), MoE layers, k],
    the experts the policy routed each token to when it was fed (-1 for the last token, never fed); None = off."""
    loss_mask: tuple[bool, ...] | None = None
    """Multi-turn: per response token, sampled by the policy (True) or an observation (False); None = all sampled.
    An observation's `logprobs` entry is the policy's logprob of it (not trained), its sampling logprob 0."""
    turns: int = 0
    """Multi-turn: assistant turns the environment stepped on."""
    tool_calls: int = 0
    """Multi-turn: observations appended."""
    env_reward: float | None = None
    """Multi-turn: the environment's rewards summed over the turns (None without an environment)."""

    def to_rollout(self, advantage: float = 0.0, **token_fields: Sequence[float]) -> Rollout:
        """The training record: `old_logprobs` = `logprobs` (plus any other per-response-token fields)."""
        return Rollout(
            prompt=self.prompt,
            response=self.response,
            advantage=advantage,
            token_fields={"old_logprobs": self.logprobs, **token_fields},
            routed_experts=self.routed_experts,
            loss_mask=self.loss_mask,
        )


@dataclass(kw_only=True)
class GenerationStats:
    """Counts of one `generate` call (deterministic) and its wall time."""

    num_prompts: int = 0
    num_samples: int = 0
    prefill_forwards: int = 0
    """Model forwards spent on prompts (all prompts of a call are packed into as few forwards as allowed)."""
    prefill_positions: int = 0
    """Prompt token positions run through the model: the sum of the prompt lengths (each prompt ONCE; n times
    with share_prefix off)."""
    prefill_positions_unshared: int = 0
    """What prefilling every sample's prompt separately would cost: n * the sum of the prompt lengths."""
    prompt_prefills: list[int] = field(default_factory=list)
    """Per prompt, how many times it was prefilled (1; n with share_prefix off: the tests assert it)."""
    decode_steps: int = 0
    """Decode forwards (each feeds one token of every live branch of every prompt)."""
    decode_positions: int = 0
    """Token positions run through the model while decoding (fed tokens; shared tree tokens once)."""
    tokens_sampled: int = 0
    """Tokens drawn from the model (a shared tree token once)."""
    response_tokens: int = 0
    """Sum of the response lengths over all samples (shared tokens once per sample: the logical count)."""
    observation_tokens: int = 0
    """Multi-turn: observation tokens appended (fed like sampled tokens, a shared one once)."""
    seconds: float = 0.0
    """Wall time of the call."""

    @property
    def tokens_per_s(self) -> float:
        """Logical response tokens per second."""
        return self.response_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float]:
        keys = ("num_prompts", "num_samples", "prefill_forwards", "prefill_positions", "prefill_positions_unshared",
                "decode_steps", "decode_positions", "tokens_sampled", "response_tokens", "observation_tokens",
                "seconds")  # fmt: skip
        return {**{k: getattr(self, k) for k in keys}, "tokens_per_s": self.tokens_per_s}


@dataclass(kw_only=True)
class GenerationOutput:
    samples: list[list[Sample]]
    """samples[p] = the n samples of prompt p, in a deterministic (depth-first tree) order."""
    stats: GenerationStats

    def flat(self) -> list[Sample]:
        return [s for group in self.samples for s in group]


@runtime_checkable
class Generator(Protocol):
    """What the training loop needs from a rollout engine (the built-in one is `BranchSampler`).

    Contract: `generate` returns `len(prompts)` groups of exactly `params.n` samples; every rank of a
    tensor-parallel group gets the same samples; the same `generator` state gives the same samples; each
    sample's `logprobs` are the policy's temperature-1 logprobs of its tokens (to float tolerance of the training
    forward: an external engine in another precision should leave them to be re-scored by the trainer).
    """

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, generator: torch.Generator
    ) -> GenerationOutput: ...
