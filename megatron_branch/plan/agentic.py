"""The planner on an agentic tree (issue 31 item 7): positions logical / computed and the step's FLOPs, naive vs the
tree schedules, for the tree `plan --turns T --observation-length O --branch-at-turns ...` describes.

The tree is the bench's (data/random_trees.py agentic_tree_rollouts, counted by agentic_segments): per prompt
group a prompt, then T policy turns of `--response-length` tokens with an observation of O tokens (loss_mask 0)
after each but the last; after each turn in --branch-at-turns every trajectory forks in 2; `--responses` = the
leaves G. Counts are exact (the bench's own function). FLOPs use plan/flops.py's per-token, per-pair and per-row
costs: naive runs every rollout whole (its FLOPs are those of the flat shape: sharing plays no part); packed and
replay run every tree segment once against its ancestors' keys, with the output projection on every response row
once (an observation's rows included: their logprobs are computed, their loss terms masked). Tree FLOPs are
without recompute (replay's segment recompute and megatron's full recompute add forwards not counted here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_branch.data.random_trees import agentic_positions, agentic_segments, check_turn_tree
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.flops import (
    LOGITS_MATMULS,
    attention_flops,
    layer_matmul_flops_per_token,
    linear_attention_flops,
    logits_flops_per_row,
    step_flops,
)
from megatron_branch.plan.model import RolloutShape


@dataclass(frozen=True, kw_only=True)
class TurnTreeShape:
    """`prompts` groups of the agentic tree above (the bench's description, in plan's flag names)."""

    prompt_length: int
    """P: prompt tokens (system prompt + tools)."""
    responses: int
    """G: leaves per prompt (rollouts)."""
    turn_length: int
    """Tokens of each policy turn (plan's --response-length, the bench's --response)."""
    turns: int
    """Policy turns per rollout."""
    observation: int = 0
    """Tokens of each observation between turns."""
    branch_at_turns: tuple[int, ...] = ()
    """Fork in 2 after these turns."""
    prompts: int = 1
    """N: prompt groups per step."""

    def __post_init__(self) -> None:
        check_turn_tree(turns=self.turns, observation=self.observation, branch_at_turns=self.branch_at_turns,
                        leaves=(self.responses,), leaves_flag="--responses")  # fmt: skip
        assert self.turns > 0, "a turn tree has turns"

    def _kw(self) -> dict[str, Any]:
        return dict(prompt_len=self.prompt_length, n=self.responses, turns=self.turns, turn_len=self.turn_length,
                    observation_len=self.observation, branch_at_turns=self.branch_at_turns)  # fmt: skip

    @property
    def response_length(self) -> int:
        """Tokens of each rollout's response (turns and observations)."""
        return self.turns * self.turn_length + (self.turns - 1) * self.observation

    @property
    def positions(self) -> tuple[int, int]:
        """(logical, computed) positions of the step: the bench's count times the prompt groups."""
        logical, computed = agentic_positions(**self._kw())
        return self.prompts * logical, self.prompts * computed

    def segments(self) -> list[tuple[int, int, int]]:
        """(start, length, width) per tree level of one group (random_trees.agentic_segments)."""
        return agentic_segments(**self._kw())

    def flat(self) -> RolloutShape:
        """The same rollouts without the turn structure: P prompt + G responses of the whole response length."""
        return RolloutShape(prompt_length=self.prompt_length, responses=self.responses,
                            response_length=self.response_length, prompts=self.prompts)  # fmt: skip


def turn_tree_flops(arch: ModelArch, shape: TurnTreeShape) -> dict[str, float]:
    """FLOPs of one step (all ranks, forward + backward, no recompute): naive, tree (packed = replay) and the ratio."""
    naive = step_flops(arch, shape.flat(), "naive").total
    levels, N = shape.segments(), shape.prompts
    positions = shape.positions[1]
    attention = N * sum(width * attention_flops(arch, length, start) for start, length, width in levels)
    target_rows = positions - N * shape.prompt_length  # every response row once
    tree = (
        layer_matmul_flops_per_token(arch) * 3 * positions
        + 3 * attention
        + logits_flops_per_row(arch) * LOGITS_MATMULS * target_rows
        + linear_attention_flops(arch, [(length, N * width) for _, length, width in levels])
    )
    return {"naive": naive, "tree": float(tree), "ratio": naive / tree}


def turn_tree_replay_saved(
    arch: ModelArch, shape: TurnTreeShape, *, act_bytes: int, branch_micro_batch: int, segment_recompute: bool
) -> int:
    """replay's saved-for-backward peak on one rank (tp = cp = 1, attention-only dense model) for the tree: the walk
    (schedule/walk.py) runs inner children one at a time, so at the peak the deepest root-to-leaf path is alive:
    each inner segment's graph (unless segment recompute drops it), its cached K/V and their dK/dV sums, plus one
    micro-batch of sibling leaves attending to the whole path. With segment recompute an inner segment's own
    backward (its released cache entry replaced by the recomputed K/V) may be the peak instead."""
    from megatron_branch.plan.activations import Dims, chunk_saved_bytes, kv_grad_bytes, layer_kv_bytes
    from megatron_branch.plan.model import Layout

    assert not arch.is_hybrid and not arch.is_moe, "the tree's memory: dense attention models only"
    dm = Dims.of(arch, Layout(), act_bytes)
    *inner, (start, leaf_len, width) = shape.segments()
    per_parent = width // (inner[-1][2] if inner else 1)  # leaf siblings under one parent
    b = min(branch_micro_batch, per_parent)
    graphs = cached = grads = 0
    phases = []
    for i, (s, n, w) in enumerate(inner):
        children = (inner[i + 1][2] if i + 1 < len(inner) else width) // w
        targets = children + (n - 1 if i else 0)  # the root: only its fork rows predict response tokens
        seg = chunk_saved_bytes(dm, n, targets, ext=s, capture=True, sequences=[(n, 1)])
        kv = dm.attn_layers * layer_kv_bytes(dm, n)
        if segment_recompute:  # its own backward: the ancestors' cache and sums, its recomputed graph
            phases.append(cached + grads + kv_grad_bytes(dm, n) + seg["kv"] + seg["other"])
        graphs += 0 if segment_recompute else seg["held"]
        cached, grads = cached + kv, grads + kv_grad_bytes(dm, n)
    leaf = chunk_saved_bytes(dm, b * leaf_len, b * (leaf_len - 1), ext=start, sequences=[(leaf_len, b)])
    return max([graphs + cached + grads + leaf["kv"] + leaf["other"], *phases])
