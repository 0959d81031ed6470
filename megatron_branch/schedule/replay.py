"""The replay schedule: depth-first over the prefix tree with per-layer dK/dV accumulators.

For a segment X with ancestors A (cached) and children C:
  1. forward X against A's cached K/V, capturing X's own per-layer K/V (in X's graph);
  2. cache X's K/V as DETACHED leaves that require grad;
  3. replay every child (recursively; sibling leaves in micro-batches): each child's backward adds its dK/dV into
     the leaves of X and of every ancestor, because the children read them (as key blocks, in place);
  4. backward X once with the accumulated dK/dV injected into its captured K/V
     (torch.autograd.backward([loss_X, k_1, v_1, ...], [1, dk_1, dv_1, ...])), which sends X's own share on into
     A's leaves, then drop X's cache.
So the prefix is back-propagated once with the SUM of all its branches' gradients (the technique of AReaL-DTA,
arXiv 2602.00482), and only one root-to-leaf path (plus one micro-batch of leaves) is alive at a time.

With `recompute`, step 1 runs without a graph for segments that have children, and step 4 recomputes the forward
before its backward: memory then holds only the path's K/V, at the price of one more forward per inner segment.
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

from collections.abc import Iterator

import torch

from megatron_branch.attention.core_attention import KV
from megatron_branch.data import PrefixTree
from megatron_branch.losses.objective import BoundObjective, Objective
from megatron_branch.memory import track_extra
from megatron_branch.parallel.lockstep import backward
from megatron_branch.schedule.chunks import Chunk, CPChunk
from megatron_branch.schedule.common import (
    ChunkOut,
    ScheduleOptions,
    StepResult,
    Store,
    forward_chunk,
    prepare_chunk,
)


class _Replay:
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
        self.cache: dict[int, dict[int, KV]] = {}  # segment -> layer -> (k [l,b,g,h], v) leaves
        # segment -> metadata of this rank's cached rows, for chunks whose context needs it (CP: [2, l])
        self.meta: dict[int, torch.Tensor] = {}
        self.path: list[int] = []  # cached ancestors of what runs next, root first
        self.forwards = 0
        self.positions = 0
        self.recomputed = 0
        self.store = Store(tree, opts)

    def external_kv(self) -> dict[int, list[KV]]:
        """layer -> the current path's cached K/V leaves, root first (blocks, not concatenated: no copy)."""
        if not self.path:
            return {}
        layers = self.cache[self.path[0]].keys()
        return {layer: [self.cache[a][layer] for a in self.path] for layer in layers}

    def external_meta(self) -> torch.Tensor | None:
        """[2, c] metadata of the current path's cached rows in external_kv's order (None: not needed)."""
        metas = [self.meta[a] for a in self.path if a in self.meta]
        return torch.cat(metas, dim=1) if metas else None

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
                external_kv=self.external_kv(),
                capture=capture,
                external_meta=self.external_meta(),
            )
        self.forwards += 1
        return chunk, out

    def run_leaves(self, leaves: list[int]) -> None:
        chunk, out = self._forward(leaves, capture=False)
        if not self.forward_only:
            backward(self.model, [out.loss])
        self.positions += chunk.num_real
        self.store.add(chunk.targets, out)

    def run_segment(self, seg_id: int) -> None:
        seg = self.tree.segments[seg_id]
        if not seg.children:
            self.run_leaves([seg_id])
            return
        keep_graph = not self.opts.recompute and not self.forward_only
        chunk, out = self._forward([seg_id], capture=True, grad=keep_graph)
        self.positions += chunk.num_real
        # padded rows (sequence parallel) are never seen by descendants: cache real rows only (under CP every local
        # row: each rank keeps ITS shard of this prefix's K/V for the whole replay of its subtree)
        real = chunk.cache_rows
        if chunk.cache_meta is not None:
            self.meta[seg_id] = chunk.cache_meta
        # rows held constant: 0 (exact) except in replay-stopgrad, where they are the segment's prompt rows
        const = self.tree.response_starts()[seg_id] if self.stop_prompt_gradient else 0
        leaf = (
            (lambda t: t[:real].detach())
            if self.forward_only or (self.stop_prompt_gradient and const >= real)
            else (lambda t: t[const:real].detach().requires_grad_())
        )
        leaves = {layer: (leaf(k), leaf(v)) for layer, (k, v) in out.captured.items()}
        self.cache[seg_id] = (
            leaves if not 0 < const < real else self._with_constant_rows(out.captured, leaves, const)
        )
        # the cache is activation memory too: an active ActivationMeter counts it (a no-op otherwise)
        track_extra(t for kv in self.cache[seg_id].values() for t in kv)
        self.path.append(seg_id)
        for group in self._child_groups(seg.children):
            if len(group) == 1:
                self.run_segment(group[0])
            else:
                self.run_leaves(group)
        self.path.pop()
        self.cache.pop(seg_id)
        self.meta.pop(seg_id, None)
        if self.forward_only:  # scoring: no backward, and the first forward is the one counted
            self.store.add(chunk.targets, out)
            return
        if not keep_graph:
            chunk, out = self._forward([seg_id], capture=True, grad=True)
            self.recomputed += chunk.num_real
        outputs, grads = [out.loss], [torch.ones_like(out.loss)]
        for layer, (k, v) in out.captured.items():
            k_leaf, v_leaf = leaves[layer]
            for t, cached in ((k, k_leaf), (v, v_leaf)):
                if cached.grad is not None:
                    outputs.append(t[const:real])
                    grads.append(cached.grad)
        backward(self.model, outputs, grads)  # plain autograd; paired across replicas under EP (lockstep)
        self.store.add(chunk.targets, out)

    @staticmethod
    def _with_constant_rows(captured: dict[int, KV], leaves: dict[int, KV], const: int) -> dict[int, KV]:
        """replay-stopgrad: the cached K/V with their first `const` rows as constants before the trained leaves
        (a copy, unlike the exact path's in-place blocks: this variant is a comparison, not a fast path)."""
        return {
            layer: tuple(torch.cat([t[:const].detach(), lf]) for t, lf in zip(kv, leaves[layer]))  # type: ignore[misc]
            for layer, kv in captured.items()
        }

    def _child_groups(self, children: tuple[int, ...]) -> Iterator[list[int]]:
        """Inner children one at a time; leaf children in micro-batches of `branch_micro_batch`."""
        batch: list[int] = []
        for c in children:
            if self.tree.segments[c].children:
                yield [c]
            else:
                batch.append(c)
                if len(batch) == self.opts.branch_micro_batch:
                    yield batch
                    batch = []
        if batch:
            yield batch


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
    for root in tree.roots:
        r.run_segment(root)
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
    if opts.cp_size > 1:
        raise ValueError("replay-stopgrad (a comparison baseline) does not run under context parallelism")
    return run_replay(model, tree, objective, opts, forward_only=forward_only, stop_prompt_gradient=True)
