"""The replay schedule: depth-first over the prefix tree with per-layer dK/dV accumulators.

The walk itself is schedule/walk.py (written once, also for every pipeline stage); here its steps on one rank.
For a segment X with ancestors A (cached) and children C:
  1. forward X against A's cached state, capturing what each layer hands down (attention: X's own K/V; another
     layer kind: its state at the fork; attention/prefix_state.py), in X's graph;
  2. cache it as DETACHED leaves that require grad (schedule/prefix_cache.py, the same for every layer kind);
  3. replay every child (recursively; sibling leaves in micro-batches, or with `chunk_tokens` small subtrees packed
     into one chunk: schedule/walk.py): each child's backward adds its gradient into the leaves it read (attention:
     X's and every ancestor's K/V, as key blocks in place);
  4. backward X once with the accumulated gradients injected into its captured state
     (torch.autograd.backward([loss_X, k_1, v_1, ...], [1, dk_1, dv_1, ...])), which sends X's own share on into
     A's leaves, then drop X's cache.
So the prefix is back-propagated once with the SUM of all its branches' gradients (the technique of AReaL-DTA,
arXiv 2602.00482), and only one root-to-leaf path (plus one micro-batch of leaves) is alive at a time.

With `recompute`, step 1 runs without a graph for segments that have children, and step 4 recomputes the forward
before its backward: memory then holds only the path's K/V, at the price of one more forward per inner segment.
Before that recomputation X's cache entry is released (only its accumulated gradients are kept): the recomputed
K/V replace the cached ones, so X's K/V are held once at its backward, not twice (prefix_cache.release).
Dropout is 0 in every model we build, so the recomputed forward is bit-identical (no RNG state to replay).

`forward_only` (scoring: old-policy, reference and DPO logprobs, evaluation) runs the same DFS under no_grad:
the path's K/V are cached as plain tensors and dropped when a subtree is done, no graph is kept, so memory is one
root-to-leaf path's K/V plus one chunk's activations, and the numbers are the training forward's bit for bit.

`replay-stopgrad` (run_replay_stopgrad) is NOT exact and exists only as a comparison: the stop-gradient baseline
of the announced system, which treats each prompt's K/V as constants. In every cached segment the rows that are
prompt for all its rollouts (PrefixTree.response_starts) are cached detached WITHOUT requires_grad, so no dK/dV
flows from the branches back into the prompt's positions, however the trie splits the prompts (a template shared
across prompts is a root of its own); the prompt's own loss terms (the first response token, predicted from the
prompt's last row) still back-propagate. A prompt no other rollout shares is not cached (it runs with its response
in one forward) and is trained as in naive training.
"""

from __future__ import annotations

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.errors import SettingError
from megatron_branch.losses.objective import BoundObjective, Objective
from megatron_branch.parallel.lockstep import backward
from megatron_branch.rules import API, check_run
from megatron_branch.schedule.chunks import Chunk, CPChunk
from megatron_branch.schedule.common import (
    ChunkOut,
    ScheduleOptions,
    StepResult,
    Store,
    forward_chunk,
    prepare_chunk,
)
from megatron_branch.schedule.options import chunks_ran
from megatron_branch.schedule.prefix_cache import PrefixCache
from megatron_branch.schedule.walk import DepthFirstWalk


class _Replay(DepthFirstWalk):
    """The walk on one rank (schedule/walk.py): a wave's micro-batches one after another."""

    def __init__(
        self,
        model: torch.nn.Module,
        tree: PrefixTree,
        objective: BoundObjective | None,
        opts: ScheduleOptions,
        forward_only: bool,
        stop_prompt_gradient: bool = False,
    ) -> None:
        self.model, self.tree, self.objective, self.opts = model, tree, objective, opts
        self.forward_only = forward_only
        self.stop_prompt_gradient = stop_prompt_gradient  # replay-stopgrad only (inexact, a comparison)
        self.cache = PrefixCache(grad=not forward_only)  # segment -> layer -> what it hands down (leaves)
        self.path: list[int] = []  # cached ancestors of what runs next, root first
        self.micro = opts.branch_micro_batch
        # replay-stopgrad freezes the prompt rows of CACHED segments only: it keeps one forward per segment
        name = "replay-stopgrad" if stop_prompt_gradient else "replay"
        self.chunk_tokens = chunks_ran(name, opts.chunk_tokens)["chunk_tokens"]
        self.forwards = 0
        self.positions = 0
        self.recomputed = 0
        self.store = Store(tree, opts)

    def _forward(
        self, segments: list[int], *, capture: bool, grad: bool = True
    ) -> tuple[Chunk | CPChunk, ChunkOut]:
        chunk = prepare_chunk(self.tree, segments, self.opts, external=self.path)
        with torch.set_grad_enabled(grad and not self.forward_only):
            out = forward_chunk(
                self.model,
                self.tree,
                chunk,
                self.objective,
                self.opts,
                external=self.cache.external(self.path),
                capture=capture,
                external_meta=self.cache.external_meta(self.path),
            )
        self.forwards += 1
        return chunk, out

    def run_wave(self, groups: list[list[int]]) -> None:
        for leaves in groups:  # one rank: each micro-batch forward and backward in turn
            self.run_leaves(leaves)

    def run_leaves(self, leaves: list[int]) -> None:
        chunk, out = self._forward(leaves, capture=False)
        if not self.forward_only:
            backward(self.model, [out.loss])
        self.positions += chunk.num_real
        self.store.add(chunk.targets, out)

    def open_segment(self, seg_id: int) -> tuple[Chunk | CPChunk, ChunkOut | None, bool]:
        keep_graph = not self.opts.recompute and not self.forward_only
        chunk, out = self._forward([seg_id], capture=True, grad=keep_graph)
        self.positions += chunk.num_real
        # padded rows (sequence parallel) are never seen by descendants: cache real rows only (under CP every local
        # row: each rank keeps ITS shard of this prefix's state for the whole replay of its subtree). Rows held
        # constant: none (exact) except in replay-stopgrad, where they are the segment's prompt rows.
        frozen = self.tree.response_starts()[seg_id] if self.stop_prompt_gradient else 0
        self.cache.push(seg_id, out.captured, chunk.cache_rows, frozen=frozen, meta=chunk.cache_meta)
        if not keep_graph and not self.forward_only:
            out = None  # recomputed at B(X): the cache's leaves are then the only holders of X's state
        return chunk, out, keep_graph

    def close_segment(self, seg_id: int, opened: tuple[Chunk | CPChunk, ChunkOut | None, bool]) -> None:
        chunk, out, keep_graph = opened
        if self.forward_only:  # scoring: no backward, and the first forward is the one counted
            self.cache.drop(seg_id)
            self.store.add(chunk.targets, out)
            return
        if not keep_graph:
            # the recomputed state replaces the cache entry (one copy at X's backward; prefix_cache.release)
            self.cache.release(seg_id)
            chunk, out = self._forward([seg_id], capture=True, grad=True)
            self.recomputed += chunk.num_real
        # ONE backward of the segment: its own loss and the SUM of its descendants' gradients into its state
        outputs, grads = self.cache.injection(seg_id, out.captured)
        outputs, grads = [out.loss, *outputs], [torch.ones_like(out.loss), *grads]
        backward(self.model, outputs, grads)  # plain autograd; paired across replicas under EP (lockstep)
        self.cache.drop(seg_id)
        self.store.add(chunk.targets, out)


def run_replay(
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
    stop_prompt_gradient: bool = False,
) -> StepResult:
    bound = objective.bind(tree) if objective is not None else None
    r = _Replay(model, tree, bound, opts, forward_only, stop_prompt_gradient)
    r.run_forest(tree.roots)
    assert r.positions == tree.positions_computed, (r.positions, tree.positions_computed)
    return r.store.result(
        "replay-stopgrad" if stop_prompt_gradient else "replay",
        tree,
        bound,
        opts,
        positions_computed=r.positions,
        positions_recomputed=r.recomputed,
        forwards=r.forwards,
    )


def run_replay_stopgrad(
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    """INEXACT, for comparison only: replay with each shared prompt's K/V treated as constants (no gradient
    from the branches into the prompt), what the announced stop-gradient system trains. Forward-only it is
    replay exactly (the same numbers); only the gradient differs. Tested in one process; refused under CP (a
    rank's rows are a zigzag shard there, not the prompt's first rows)."""
    try:  # the rule every entry point checks up front (rules/: no ring)
        check_run("replay-stopgrad", cp=opts.cp_size)
    except SettingError as e:
        raise e.spelled(API) from None
    return run_replay(model, tree, objective, opts, forward_only=forward_only, stop_prompt_gradient=True)
