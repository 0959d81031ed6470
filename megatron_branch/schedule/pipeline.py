"""The tree schedules under pipeline parallelism: replay and packed with the model cut into pp stages.

SHAPE LEGEND (per stage; tensors sequence first as megatron):
    S stages, this one r;  a chunk's message [rows, 1, h] (parallel/pipeline.py);  M leaf micro-batches in a wave
    F(X) / B(X): the forward / backward of chunk X through this stage's layers, with its messages

Every stage runs the SAME program over the same prefix tree: each stage builds the tree from the same rollouts
(every rank already holds them, as TP and CP ranks do; the drop-in broadcasts them from the first stage,
integration/schedule.py), and a fingerprint gathered over the pipeline group checks that the stages agree. So every
message has its partner and its shape is known on both sides (no shape exchange): a chunk's rows on this rank.

replay (the depth-first walk of schedule/walk.py, written once for one rank and every stage; each step spread
over the stages):
    F(root)       receive the root's hidden states from stage r-1, run this stage's layers CAPTURING their prefix
                  state (K/V rows; a recurrent layer's state at the fork) into THIS stage's prefix cache
                  (schedule/prefix_cache.py, unchanged), send the output to stage r+1; the last stage computes the
                  root's loss rows
    leaf wave     consecutive leaf micro-batches of the root's children (branch_micro_batch leaves each) flow in
                  megatron's 1F1B order: S-1-r warm-up forwards, then one forward + one backward, then the
                  cool-down backwards (at most S micro-batches alive; `pipeline_order="gpipe"`: all forwards, then
                  all backwards). Each reads this stage's cached K/V in place; each backward ADDS into those leaves'
                  .grad (dK/dV of this stage's layers only)
    inner child   recurses the same way between its parent's F and B
    B(root)       once, after every descendant: the gradient of the root's output from stage r+1 (1 for the loss
                  on the last stage) AND every descendant's summed gradient into this stage's captured state, in
                  ONE torch.autograd.backward; the gradient of the root's input goes to stage r-1
root pieces (`root_pieces` = k > 1): each root with children is first cut into a chain of k sequence pieces
(data/pieces.py), which the walk above runs as inner segments: F(piece 0) .. F(piece k-1) (piece j reads the earlier
pieces' K/V from this stage's cache), the root's leaf waves, then B(piece k-1) .. B(piece 0). Every stage runs that
sequence, so while stage r runs F(piece j), stage r-1 already runs F(piece j+1): the pieces fill the pipeline like
micro-batches, forward from the first stage and backward from the last (S = 2, k = 3; Fj / Bj: piece j):
        stage 0   F0 F1 F2 ~leaf wave~       B2 B1 B0
        stage 1      F0 F1 F2 ~leaf wave~ B2 B1 B0
B(piece j) on stage r starts once B(piece j+1) on stage r has added its dK/dV into piece j's cached K/V (program
order) and stage r+1 has sent the gradient of piece j's output (a message). The root's forward and backward then
leave (S-1)/(k+S-1) of their time idle instead of (S-1)/S (plan/pipeline.py); the arithmetic is the unsplit root's.
With `recompute`, F(X) of an inner X keeps no graph; at B(X) each stage recomputes X's forward from the input it
received in F(X) (kept: one [rows, 1, h] tensor), so the recompute sends no message and is bit-identical.
Independent roots run one after another; consecutive childless roots form one wave.

packed: the tree split at its group boundaries (each root's subtree: one chunk, exactly run_packed's math for that
group, as groups share nothing), the groups as one wave of micro-batches in the same 1F1B order.

naive-fused (the unshared baseline, schedule/unshared.py): every rollout its own micro-batch, nothing shared, one
wave; the last stage runs unshared.py's own per-rollout head and loss. It is here so that the benchmark can compare
replay's pipeline with the fair baseline's under the same PP (benchmarks/pipeline_bubble.py).

The loss is computed on the last stage only; at the end the last stage's loss, metric statistics and kept
logprobs/entropies are broadcast over the pipeline group, so every stage returns the same StepResult (as every TP
rank does). A critic (models/critic.py) runs the same program: its value head on the last stage, whose values
stand where the policy's logprobs do. Parameter gradients stay on the stage that owns the parameter; the tied embedding's two copies are
summed by megatron's embedding-group reduction (finalize_model_grads, or parallel/grads.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.data.pieces import split_roots
from megatron_branch.errors import SettingError
from megatron_branch.losses.objective import BoundObjective, Objective
from megatron_branch.parallel.pipeline import StageLink, broadcast_from_last, check_same_tree
from megatron_branch.rules import API, check_pipeline, check_run
from megatron_branch.schedule.chunks import Chunk, CPChunk
from megatron_branch.schedule.common import (
    ScheduleOptions,
    StepResult,
    Store,
    prepare_chunk,
)
from megatron_branch.schedule.pipeline_stage import AnyChunk, _RolloutChunk, _Run, _Stage, _unwrap
from megatron_branch.schedule.prefix_cache import PrefixCache
from megatron_branch.schedule.walk import DepthFirstWalk


class _Pipeline(DepthFirstWalk):
    """The per-stage program of one step (see the module doc): the walk of schedule/walk.py, this stage's steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        tree: PrefixTree,
        objective: BoundObjective | None,
        opts: ScheduleOptions,
        *,
        forward_only: bool,
    ) -> None:
        self.tree, self.opts, self.forward_only = tree, opts, forward_only
        self.grad = not forward_only and torch.is_grad_enabled()
        self.link = StageLink(opts.groups, _unwrap(model).config)
        self.store = Store(tree, opts)
        self.stage = _Stage(model, tree, objective, opts, self.link, self.store)
        self.cache = PrefixCache(grad=self.grad)
        self.path: list[int] = []
        self.micro = opts.branch_micro_batch
        self.chunk_tokens = opts.chunk_tokens
        self.forwards = self.positions = self.recomputed = 0

    # ---- one chunk ---------------------------------------------------------------------------------------------
    def _chunk(self, segments: Sequence[int]) -> Chunk | CPChunk:
        return prepare_chunk(self.tree, segments, self.opts, external=self.path)

    def _forward(self, chunk: AnyChunk, received: torch.Tensor | None, *, capture: bool, grad: bool) -> _Run:
        self.forwards += 1
        return self.stage.forward(
            chunk, received, external=self.cache.external(self.path),
            external_meta=self.cache.external_meta(self.path), capture=capture, grad=grad,
        )  # fmt: skip

    def _record(self, run: _Run) -> None:
        if run.out is not None:  # the last stage: the counted forward's results
            self.store.add(run.chunk.targets, run.out)

    # ---- replay: the walk's steps on this stage (schedule/walk.py walks) ------------------------------------------
    def open_segment(self, seg_id: int) -> tuple[Chunk | CPChunk, torch.Tensor | None, _Run, bool]:
        """F(X): receive, run this stage's layers capturing their state, send; the state cached on this stage."""
        keep_graph = self.grad and not self.opts.recompute
        chunk = self._chunk([seg_id])
        received = self.link.recv_forward(self.stage.shape(chunk))
        run = self._forward(chunk, received, capture=True, grad=keep_graph)
        self.link.send_forward(run.output)
        self.positions += chunk.num_real
        self.cache.push(seg_id, run.captured, chunk.cache_rows, meta=chunk.cache_meta)
        if self.grad and not keep_graph:
            # recomputed at B(X): the cache's leaves are then the only holders of X's state
            run = replace(run, captured={})
        return chunk, received, run, keep_graph

    def close_segment(
        self, seg_id: int, opened: tuple[Chunk | CPChunk, torch.Tensor | None, _Run, bool]
    ) -> None:
        """B(X) once, after every descendant: the next stage's gradient and the subtree's summed dK/dV."""
        chunk, received, run, keep_graph = opened
        if not self.grad:
            self.cache.drop(seg_id)
            self._record(run)
            return
        if not keep_graph:  # recompute from the input this stage received in F(X): no message, same numbers
            self.cache.release(seg_id)  # the recomputed state replaces the cache entry (one copy at B(X))
            run = self._forward(chunk, received, capture=True, grad=True)
            self.recomputed += chunk.num_real
        outputs, grads = self.cache.injection(seg_id, run.captured)
        grad_output = self.link.recv_backward(self.stage.shape(chunk))
        self.link.send_backward(self.stage.backward(run, grad_output, outputs, grads))
        self.cache.drop(seg_id)
        self._record(run)

    # ---- a wave of independent micro-batches -------------------------------------------------------------------
    def run_wave(self, groups: list[list[int]]) -> None:
        self.wave([self._chunk(g) for g in groups])

    def wave(self, chunks: Sequence[AnyChunk]) -> None:
        """Independent micro-batches through the pipeline: forward-only in order, or megatron's 1F1B."""
        self.positions += sum(c.num_real for c in chunks)
        if not self.grad:
            for c in chunks:
                run = self._forward(c, self.link.recv_forward(self.stage.shape(c)), capture=False, grad=False)
                self.link.send_forward(run.output)
                self._record(run)
            return
        for run in self._one_f_one_b(chunks):
            self._record(run)

    def _one_f_one_b(self, chunks: Sequence[AnyChunk]) -> Iterator[_Run]:
        """megatron's non-interleaved schedule (schedules.forward_backward_pipelining_without_interleaving) over
        `chunks`, each with its own message shape; yields every run after its backward, in order."""
        link, stage, m = self.link, self.stage, len(chunks)
        warmup = m if self.opts.pipeline_order == "gpipe" else min(link.stages - link.stage - 1, m)
        alive: deque[_Run] = deque()
        for k in range(warmup):
            run = self._forward(
                chunks[k], link.recv_forward(stage.shape(chunks[k])), capture=False, grad=True
            )
            link.send_forward(run.output)
            alive.append(run)
        received = link.recv_forward(stage.shape(chunks[warmup])) if warmup < m else None
        for i in range(m - warmup):
            k = warmup + i
            run = self._forward(chunks[k], received, capture=False, grad=True)
            alive.append(run)
            oldest = alive.popleft()
            grad_output = link.send_forward_recv_backward(run.output, stage.shape(oldest.chunk))
            grad_input = stage.backward(oldest, grad_output)
            if k + 1 < m:
                received = link.send_backward_recv_forward(grad_input, stage.shape(chunks[k + 1]))
            else:
                link.send_backward(grad_input)
            yield oldest
        while alive:  # cool-down
            oldest = alive.popleft()
            grad_output = link.recv_backward(stage.shape(oldest.chunk))
            link.send_backward(stage.backward(oldest, grad_output))
            yield oldest

    # ---- the step's result, on every stage ---------------------------------------------------------------------
    def result(self, name: str, objective: BoundObjective | None, **kw: int) -> StepResult:
        """The last stage's loss, statistics and kept logprobs/entropies broadcast over the pipeline group."""
        groups, store = self.opts.groups, self.store
        names = tuple(objective.stat_names) if objective is not None else ()
        stats = store.stats if store.stats is not None else torch.zeros(len(names), dtype=torch.float64)
        head = torch.cat([torch.tensor([store.loss], dtype=torch.float64), stats.detach().cpu().double()])
        head = broadcast_from_last(head, groups)
        store.loss, store.stats = float(head[0]), head[1:]
        if store.logp is not None:
            store.logp = broadcast_from_last(store.logp, groups)
        if store.entropy is not None:
            store.entropy = broadcast_from_last(store.entropy, groups)
        return store.result(name, self.tree, objective, self.opts, **kw)


def run_pipeline(
    name: str,
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    """Schedule `name` (replay or packed) on this rank's pipeline stage; gradients accumulate in the stage's
    parameters, every stage returns the same StepResult. Collective over the pipeline group (and TP/CP). The caller
    (run_schedule) has checked the step (check_pipeline_step)."""
    # replay's roots as chains of pieces (data/pieces.py): the same packed tokens, so the objective, the kept
    # logprobs and the result are the unsplit tree's; every stage cuts the same tree the same way
    tree = split_roots(tree, opts.root_pieces)
    check_same_tree(tree, opts.groups)
    bound = objective.bind(tree) if objective is not None else None
    p = _Pipeline(model, tree, bound, opts, forward_only=forward_only)
    if name == "packed":
        p.run_wave([list(tree.subtree_segments(r)) for r in tree.roots])
        return p.result("packed", bound, positions_computed=p.positions, forwards=p.forwards)
    if name == "naive-fused":
        p.wave([_RolloutChunk.of(tree, [i], opts) for i in range(len(tree.rollouts))])
        return p.result("naive-fused", bound, positions_computed=p.positions, forwards=p.forwards)
    p.run_children(tree.roots)  # inner roots walked one by one, childless roots as waves
    assert p.positions == tree.positions_computed, (p.positions, tree.positions_computed)
    return p.result(
        "replay",
        bound,
        positions_computed=p.positions,
        positions_recomputed=p.recomputed,
        forwards=p.forwards,
    )


def check_pipeline_step(name: str, model: torch.nn.Module, opts: ScheduleOptions) -> None:
    """The rules every entry point checks up front (rules/), for schedule `name` on this stage's model."""
    arch = getattr(_unwrap(model), "arch", None)
    try:
        check_run(name, cp=opts.cp_size, recompute=opts.recompute, recompute_layers=opts.recompute_layers)
        check_pipeline(
            name,
            pp=opts.pp_size,
            num_layers=int(_unwrap(model).config.num_layers),
            hybrid=bool(getattr(arch, "is_hybrid", False)),
            mamba=bool(getattr(arch, "hybrid_override_pattern", None)),
            moe=bool(getattr(arch, "is_moe", False)),
            ep=opts.groups.ep_size,
            ep_spans_dp=opts.groups.ep_spans_dp,
            root_pieces=opts.root_pieces,
        )
    except SettingError as e:
        raise e.spelled(API) from None
