"""The branch tree of one `BranchSampler.generate` call (sampler.py): bookkeeping only, no model.

Each prompt starts `root_fanout` root branches; every decode step appends one sampled token to each live branch
(`append_tokens`); at a depth in `branch_at` a branch forks into `branch_factor` children that share its tokens,
its buffer slots (`path`: the cached K/V of its fed tokens) and its recurrent-state row. When every branch is
done, the leaves, depth first, are the prompt's n samples (`collect_samples`). `buffer_rows` bounds the K/V
buffer the tree can fill; `prefill_groups` packs prompts into prefill forwards.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.generation.types import Sample, SamplingParams


@dataclass(kw_only=True)
class Branch:
    """A growing continuation; after a fork it keeps its tokens and its children continue it."""

    prompt: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    path: list[int] = field(default_factory=list)
    """Buffer slots of its FED tokens (K/V cached), root first; shared with its ancestors' slots."""
    state_row: int = 0
    """Its row of a recurrent layer's state table (hybrids, kv_cache.PrefixKV.states): the state after its last
    fed token, shared with the branch it forked from until it feeds its own."""
    done: str = ""
    """"" while live, else the finish reason."""
    children: list[Branch] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    """MoE routing replay: the experts [layers, k] of each FED token, in order (record_routing)."""
    # multi-turn (multi_turn.py); unused otherwise
    mask: list[bool] = field(default_factory=list)
    """Per response token: sampled by the policy (True) or an observation (False)."""
    forced: list[int] = field(default_factory=list)
    """Observation tokens still to append (one per decode step, each fed like a sampled token)."""
    env: Any = None
    """Its environment (multi_turn.Environment); a fork deep-copies it."""
    turn_start: int = 0
    """Index in `tokens` where the current assistant turn starts."""
    turns: int = 0
    """Assistant turns finished (the environment stepped on them)."""
    observations: int = 0
    """Observations appended (tool calls answered)."""
    reward: float = 0.0
    """The environment's rewards summed over the finished turns."""
    fork_pending: bool = False
    """It finished a turn in branch_at_turns: forks before sampling the next turn."""
    depth: int = 0
    """Fork points above it (a turn-forked tree: the leaves it stands for, collect_samples)."""

    def fork(self) -> Branch:
        return Branch(
            prompt=self.prompt,
            tokens=list(self.tokens),
            logprobs=list(self.logprobs),
            sampling_logprobs=list(self.sampling_logprobs),
            path=list(self.path),
            state_row=self.state_row,
            routes=list(self.routes),
            mask=list(self.mask),
            forced=list(self.forced),
            env=None if self.env is None else copy.deepcopy(self.env),  # each child its own episode
            turn_start=self.turn_start,
            turns=self.turns,
            observations=self.observations,
            reward=self.reward,
            depth=self.depth + 1,
        )


def append_tokens(
    branches: Sequence[Branch],
    tokens: list[int],
    logprobs: list[float],
    sampling_logprobs: list[float],
    params: SamplingParams,
) -> None:
    """Each branch's newest token (and its logprobs); a stop token or the length limit finishes it."""
    stop = set(params.stop_token_ids)
    for b, t, lp, lq in zip(branches, tokens, logprobs, sampling_logprobs, strict=True):
        b.tokens.append(t)
        b.mask.append(True)
        b.logprobs.append(lp)
        b.sampling_logprobs.append(lq)
        if t in stop:
            b.done = "stop"
        elif len(b.tokens) == params.max_new_tokens:
            b.done = "length"


def collect_samples(
    p: int,
    prompt: tuple[int, ...],
    roots: list[Branch],
    params: SamplingParams,
    *,
    prompt_routes: torch.Tensor | None = None,
) -> list[Sample]:
    """Depth-first leaves of prompt `p`'s tree. A branch that stopped before a fork point stands for every rollout
    it would have forked into (identical copies), so each prompt gets exactly n samples. `prompt_routes`: MoE
    routing replay's experts of the prompt's tokens [P, layers, k] (None: routing not recorded)."""
    out: list[Sample] = []
    stack = list(reversed(roots))
    while stack:
        b = stack.pop()
        if b.children:
            stack.extend(reversed(b.children))
            continue
        mt = params.multi_turn
        missed = (
            len(mt.branch_at_turns) - b.depth
            if mt is not None and mt.branch_at_turns
            else sum(1 for k in params.branch_at if k >= len(b.tokens))
        )
        sample = Sample(
            prompt_index=p,
            prompt=prompt,
            response=tuple(b.tokens),
            logprobs=tuple(b.logprobs),
            sampling_logprobs=tuple(b.sampling_logprobs),
            finish_reason=b.done,
            routed_experts=None if prompt_routes is None else routed_experts(prompt_routes, b),
            **({} if mt is None else _turn_record(b)),
        )
        out.extend([sample] * params.branch_factor**missed)
    assert len(out) == params.n, (len(out), params.n)
    return out


def _turn_record(b: Branch) -> dict[str, Any]:
    return {
        "loss_mask": tuple(b.mask),
        "turns": b.turns,
        "tool_calls": b.observations,
        "env_reward": b.reward,
    }


def routed_experts(prompt_routes: torch.Tensor, b: Branch) -> torch.Tensor:
    """[P + R, layers, k]: the prompt's recorded experts, each fed response token's, -1 for the rest (the last
    sampled token is never fed)."""
    fed = torch.stack(b.routes) if b.routes else prompt_routes[:0]
    rest = torch.full(
        (len(b.tokens) - len(b.routes), *prompt_routes.shape[1:]), -1, dtype=prompt_routes.dtype
    )
    return torch.cat([prompt_routes, fed, rest])


def buffer_rows(num_prompts: int, params: SamplingParams) -> int:
    """Upper bound on fed tokens: per tree level, its branches times the tokens they can feed there (a
    turn-forked tree: every leaf its whole response, shared or not)."""
    if params.multi_turn is not None:
        return num_prompts * params.n * params.max_new_tokens
    bounds = [0, *params.branch_at, params.max_new_tokens]
    rows, width = 0, params.root_fanout
    for level in range(len(bounds) - 1):
        rows += width * (bounds[level + 1] - bounds[level])
        width *= params.branch_factor
    return num_prompts * rows


def prefill_groups(prompts: Sequence[Sequence[int]], max_prefill_tokens: int | None) -> list[list[int]]:
    """Prompt indices per prefill forward: all in one, or consecutive groups of at most `max_prefill_tokens`
    tokens (a longer prompt alone)."""
    if max_prefill_tokens is None:
        return [list(range(len(prompts)))]
    groups: list[list[int]] = [[]]
    used = 0
    for p, prompt in enumerate(prompts):
        if groups[-1] and used + len(prompt) > max_prefill_tokens:
            groups.append([])
            used = 0
        groups[-1].append(p)
        used += len(prompt)
    return groups
