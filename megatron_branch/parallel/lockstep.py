"""Lockstep of data-parallel replicas that share experts (expert parallelism across DP).

megatron lays EP inside dp x cp (parallel_state: expert groups tp x ep x edp over the same ranks), so an EP group
may hold ranks of different data-parallel replicas. Every MoE layer of every forward and backward calls all-to-alls
over that group: its ranks must run matching forwards and backwards, in the same order. megatron's schedules get
this for free (every replica runs the same number of equally shaped micro-batches); ours do not: each replica's
prefix tree has its own shape, so replay runs a different sequence of chunks (and a CP rank's neighbours do the
same chunks, TP ranks too, but the replicas do not).

The protocol (every rank, every model call, one small all-gather over the world):
    each rank proposes its next event: N (a forward without graph), F (a forward whose graph a later B
    back-propagates), B (back-propagate the most recent open graph), or DONE;
    all ranks take the same decision from the gathered proposals, and a rank whose proposal differs runs a DUMMY
    event of the decided kind: a one-token forward (no graph, or one kept open), or the backward of its most
    recent dummy graph (zero gradients: the experts' weights receive exact zeros).
Open graphs form a stack (replay's depth-first order: a segment's graph stays open while its children run), equal
in depth on every rank because every decision pushes or pops on all of them; so the graphs a B closes were opened
by the same F on every rank, and their all-to-all split sizes match. B is decided only when no rank would have to
close a real graph it is not ready to close (its top is a dummy, or it proposes B); otherwise F/N proceed. A real
B also back-propagates a zero gradient into its forward's output (`anchor`), so every backward reaches every MoE
layer exactly once (replay's inner segment without loss rows would otherwise skip the top layers' all-to-alls).

Shape legend: s rows of a dummy forward (tp under sequence parallel, else 1), h hidden.
Used only when an EP group spans replicas (parallel/groups.py `ParallelGroups.ep_spans_dp`); inactive outside
`region(model)`, the entry points' scope (an update, a scoring pass, a generate call) whose end drains the
protocol (`finish`: every rank DONE, every dummy graph closed) before the replicas go on to their collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

N, F, B, DONE, END = 0, 1, 2, 3, 4


@dataclass
class _Open:
    dummy: bool
    anchor: torch.Tensor | None  # the forward's output (its graph)


class Lockstep:
    """The protocol for one model (attached as `model.lockstep` by `install`). `group`: all ranks that must agree
    (the world: TP and CP peers are in lockstep already and EP groups of different TP ranks must decide alike)."""

    def __init__(self, model: torch.nn.Module, *, group: Any, rows: int) -> None:
        self.model, self.group, self.rows = model, group, rows
        self.stack: list[_Open] = []
        self.depth = 0  # nesting of regions
        self._inner = False  # inside a dummy call (hooks pass through)
        self._pending_real_f = False
        self.dummies = {N: 0, F: 0, B: 0}
        # first among the model's pre-hooks: a dummy forward runs before the real forward's own hooks (RoPE's
        # position ids) have set anything up
        model.register_forward_pre_hook(self._pre_forward, prepend=True)
        model.register_forward_hook(self._post_forward)

    # ---- hooks and the schedules' backward ---------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not self.depth or self._inner:
            return
        kind = F if torch.is_grad_enabled() else N
        self._agree(kind)
        self._pending_real_f = kind == F

    def _post_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.depth or self._inner or not self._pending_real_f:
            return
        self._pending_real_f = False
        self.stack.append(_Open(dummy=False, anchor=_first_tensor(output)))

    def backward(self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None) -> None:
        """Back-propagate `outputs` (the schedule's roots) as the B paired with the most recent real F."""
        self._agree(B)
        top = self.stack.pop()
        assert not top.dummy, "a real backward closes its own forward's graph"
        grads = list(grads) if grads is not None else [None] * len(outputs)
        # all outputs or none: a tensor that should carry a gradient but has no graph must fail loudly in autograd
        # (a dropped dK/dV would be a silently wrong gradient), not be filtered out
        live = any(o.requires_grad for o in outputs)
        roots = list(zip(outputs, grads, strict=True)) if live else []
        if top.anchor is not None and top.anchor.requires_grad:
            roots.append((top.anchor, torch.zeros_like(top.anchor)))
        if roots:
            torch.autograd.backward(
                [o for o, _ in roots], [g if g is not None else torch.ones_like(o) for o, g in roots]
            )

    # ---- regions -------------------------------------------------------------------------------------------
    @contextmanager
    def region(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._agree(DONE)

    # ---- the protocol --------------------------------------------------------------------------------------
    def _agree(self, mine: int) -> None:
        """Run dummy events until the group decides `mine` (for B: until this rank's top is its real graph)."""
        while True:
            top_dummy = bool(self.stack) and self.stack[-1].dummy
            decision = self._decide(mine, top_dummy)
            if decision == END:
                assert mine == DONE and not self.stack
                return
            if decision == B:
                if self.stack[-1].dummy:
                    self._dummy_backward()
                    continue
                assert mine == B
                return
            if decision == mine:
                return
            self._dummy_forward(grad=decision == F)

    def _decide(self, mine: int, top_dummy: bool) -> int:
        props, tops, depths = zip(*self._gather([mine, int(top_dummy), len(self.stack)]), strict=True)
        return decision(props, tops, depths)

    def _gather(self, state: list[int]) -> list[list[int]]:
        """Every rank's (proposal, top is a dummy, stack depth), in rank order: one all-gather over the group."""
        mine_t = torch.tensor(state, dtype=torch.long)
        parts = [torch.zeros_like(mine_t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, mine_t, group=self.group)
        return [p.tolist() for p in parts]

    def _dummy_forward(self, *, grad: bool) -> None:
        from megatron_branch.attention.context import LocalContext
        from megatron_branch.attention.layout import AttentionLayout, QuerySegment
        from megatron_branch.attention.prefix_state import ChunkSegment, ChunkTree

        base = getattr(self.model, "module", self.model)
        dev = next(base.parameters()).device
        s = self.rows
        # one causal root segment of s rows, for every layer kind that reads the context (attention: the layout;
        # a recurrent mixer: the tree, a root starting from the zero state)
        ctx = LocalContext(
            layout=AttentionLayout(
                num_queries=s, num_keys=s, segments=(QuerySegment(q_start=0, q_end=s, self_k_start=0),)
            ),
            tree=ChunkTree(segments=(ChunkSegment(0, s, None),)),
        )
        ids = torch.zeros(1, s, dtype=torch.long, device=dev)
        self._inner = True
        try:
            # the real forward this dummy runs before may have its contexts attached already: swap them out
            with torch.set_grad_enabled(grad), _swapped(base, ctx):
                out = base(ids, torch.zeros_like(ids), None)  # [s(/tp), 1, h]
        finally:
            self._inner = False
        self.dummies[F if grad else N] += 1
        if grad:
            self.stack.append(_Open(dummy=True, anchor=out))

    def _dummy_backward(self) -> None:
        top = self.stack.pop()
        assert top.dummy and top.anchor is not None
        self._inner = True
        try:
            top.anchor.backward(torch.zeros_like(top.anchor))  # every MoE layer's all-to-all, zero gradients
        finally:
            self._inner = False
        self.dummies[B] += 1


@contextmanager
def _swapped(base: torch.nn.Module, ctx: Any) -> Iterator[None]:
    """`ctx` on every module that reads a branch context (attention, a recurrent mixer), routers routing plainly
    (no loss), hidden states out; whatever was there restored after."""
    from megatron_branch.attention.context import context_modules
    from megatron_branch.models.moe import PlainRouting, branch_routers

    mods, routers = context_modules(base), branch_routers(base)
    # a BranchGPTModel returns hidden states (cheaper); another GPTModel (verl's) its logits, a dummy's all the same
    held = [m.context for m in mods], [r.context for r in routers], getattr(base, "_hidden_only", None)
    for m in mods:
        m.context = ctx
    plain = PlainRouting()  # no router loss: the model's config may set megatron's (verl's engine does)
    for r in routers:
        r.context = plain
    if held[2] is not None:
        base._hidden_only = True
    try:
        yield
    finally:
        for m, c in zip(mods, held[0], strict=True):
            m.context = c
        for r, c in zip(routers, held[1], strict=True):
            r.context = c
        if held[2] is not None:
            base._hidden_only = held[2]


def decision(props: Sequence[int], tops: Sequence[int], depths: Sequence[int]) -> int:
    """The event every rank runs next, from every rank's proposal, whether its top graph is a dummy, and its stack
    depth (the same on all ranks): END when all are DONE with nothing open; B when no rank would have to close a
    real graph it is not ready to close; else N before F (a no-graph forward opens nothing)."""
    assert len(set(depths)) == 1, f"lockstep stacks diverged: {depths}"
    if all(p == DONE for p in props) and depths[0] == 0:
        return END
    if depths[0] > 0 and all(p == B or t for p, t in zip(props, tops, strict=True)):
        return B
    if N in props:
        return N
    assert F in props, props
    return F


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    return None


def install(model: torch.nn.Module, *, rows: int, group: Any = None) -> Lockstep:
    """Attach a Lockstep to `model` (the GPTModel inside any DDP wrapper); idempotent."""
    base = getattr(model, "module", model)
    existing = getattr(base, "lockstep", None)
    if existing is not None:
        return existing
    ls = Lockstep(base, group=group if group is not None else dist.group.WORLD, rows=rows)
    base.lockstep = ls  # type: ignore[attr-defined]
    return ls


def of(model: torch.nn.Module) -> Lockstep | None:
    return getattr(getattr(model, "module", model), "lockstep", None)


@contextmanager
def region(model: torch.nn.Module) -> Iterator[None]:
    """The scope of an entry point's model calls under lockstep (a no-op without one); drained at its end."""
    ls = of(model)
    if ls is None:
        yield
        return
    with ls.region():
        yield


def backward(
    model: torch.nn.Module, outputs: Sequence[torch.Tensor], grads: Sequence[Any] | None = None
) -> None:
    """The schedules' backward: plain autograd, or the lockstep's paired B under EP across replicas."""
    ls = of(model)
    if ls is not None and ls.depth:
        ls.backward(outputs, grads)
        return
    if any(o.requires_grad for o in outputs):  # all or none (see Lockstep.backward): never drop one silently
        torch.autograd.backward(list(outputs), list(grads) if grads is not None else None)
