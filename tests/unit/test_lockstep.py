"""The lockstep of replicas that share experts (parallel/lockstep.py), in ONE process: the other replica is a scripted
peer whose proposals enter the protocol's decision (`Lockstep._gather`), so this rank runs every kind of dummy
event (a forward without graph, one whose graph stays open, the backward of a dummy graph) between its own real
model calls, as a replica with a smaller prefix tree does under EP across data-parallel replicas.

What must hold: every dummy runs through the real model (whatever contexts its layers read), the real schedule's
gradient is unchanged bit for bit (a dummy graph's backward sends exact zeros into the experts), the protocol's
decisions pair every event, and the stacks drain. The distributed launch (tests/distributed/test_moe_parallel.py,
EP2 across the DP replicas) runs the same protocol over gloo; this test is the unit-level guard for what broke
there (a dummy forward that could not build its context).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel import lockstep
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.parallel.lockstep import DONE, END, B, F, N, decision
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


class ScriptedPeer:
    """Another replica with its own real events (`script`: N, F, B in its schedule's order, each B closing its most
    recent real F), then DONE. It follows every decision as Lockstep does: its own event when the group decides
    it, else a dummy of the decided kind (a dummy F pushes a dummy graph, a B pops the top graph)."""

    def __init__(self, script: list[int]) -> None:
        self.todo = list(script)
        self.stack: list[bool] = []  # True: a dummy graph
        self.decisions: list[int] = []

    def gather(self, state: list[int]) -> list[list[int]]:
        mine = self.todo[0] if self.todo else DONE
        peer = [mine, int(bool(self.stack) and self.stack[-1]), len(self.stack)]
        rows = [state, peer]
        d = decision(*zip(*rows, strict=True))
        self.decisions.append(d)
        if d == B:
            dummy = self.stack.pop()
            if not dummy:
                assert self.todo.pop(0) == B, "a real graph is closed only by its own B"
        elif d in (N, F):
            if mine == d:
                self.todo.pop(0)
            if d == F:
                self.stack.append(mine != d)
        return rows


def _moe_model(family: str = "qwen3_moe") -> tuple[ModelArch, torch.nn.Module]:
    """A tiny MoE policy; "qwen3_5_moe": a MoE hybrid (a GDN layer, then a gated-attention layer)."""
    kinds = ("linear_attention", "full_attention") if family == "qwen3_5_moe" else None
    arch = ModelArch.from_hf_config(tiny_hf_config(family, ffn=48, layer_types=kinds))
    torch.manual_seed(3)
    return arch, build_model(arch, dtype=torch.float64)


def _grads(model: torch.nn.Module, schedule: str, *, active: bool) -> dict[str, torch.Tensor]:
    rollouts = random_tree_rollouts(prompt_len=7, branches=3, levels=2, seed=202)
    tree = PrefixTree.build(rollouts, vocab_size=37)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    with lockstep.region(model) if active else nullcontext():
        run_schedule(
            schedule,
            model,
            tree,
            obj,
            ScheduleOptions(vocab_size=37, branch_micro_batch=2, chunk_tokens=None),
        )
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


PEERS = {
    # a longer run than ours: no-graph forwards (a scoring pass), nested graphs, then more events after our DONE
    "longer": [N, F, F, B, N, F, B, B, F, N, B, N, F, F, B, B],
    # a shorter one: one graph, so this rank's own events mostly run against the peer's dummies
    "shorter": [F, B],
    "idle": [],  # a replica without rollouts: every one of its events is a dummy
}


@pytest.mark.parametrize("schedule", ["replay", "packed"])
@pytest.mark.parametrize("peer_name", list(PEERS))
def test_dummy_events_leave_the_gradient_exact(schedule: str, peer_name: str) -> None:
    _, model = _moe_model()
    want = _grads(model, schedule, active=False)
    ls = lockstep.install(model, rows=1)
    peer = ScriptedPeer(PEERS[peer_name])
    ls._gather = peer.gather  # type: ignore[method-assign]  # the other replica's proposals
    got = _grads(model, schedule, active=True)
    assert set(got) == set(want)
    for n in want:
        assert torch.equal(got[n], want[n]), n  # dummies add exact zeros
    assert not peer.todo and not peer.stack and not ls.stack and peer.decisions[-1] == END
    if peer_name == "longer":  # every kind of dummy ran through the model on this rank
        assert ls.dummies[N] > 0 and ls.dummies[F] > 0 and ls.dummies[B] == ls.dummies[F], ls.dummies


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_a_dummy_forward_runs_under_whatever_context_is_attached(family: str) -> None:
    """A dummy runs inside the real forward's pre-hook, where the schedule has attached its contexts already: it
    swaps in its own (one causal root segment, for attention and for a GDN mixer alike), and the real forward's
    contexts are back after it."""
    from megatron_branch.attention.context import context_modules

    _, model = _moe_model(family)
    ls = lockstep.install(model, rows=1)
    sentinel = object()
    mods = context_modules(model)
    for m in mods:
        m.context = sentinel  # type: ignore[assignment]
    ls._dummy_forward(grad=True)
    assert all(m.context is sentinel for m in mods)
    out = ls.stack[-1].anchor
    assert out is not None and out.shape[0] == 1 and out.requires_grad
    ls._dummy_backward()
    assert not ls.stack and ls.dummies == {N: 0, F: 1, B: 1}
    experts = [p for n, p in model.named_parameters() if "experts" in n]
    assert experts and all(p.grad is None or not p.grad.any() for p in experts)  # zero gradients
    for m in mods:
        m.context = None
