"""Context parallelism for a hybrid's gated delta net layers (the head exchange: models/gdn_heads.py,
parallel/head_exchange.py) on a tiny Qwen3.5 policy, under CP2, CP4 and TP2 x CP2 + SP.

    python tests/distributed/launch.py 2 -k gdn_cp
    python tests/distributed/launch.py 4 -k gdn_cp

Every rank builds the same HF model and trees (seeded), computes the single-rank references itself (naive at CP1,
and Hugging Face rollout by rollout), and compares the gradient of every parameter, gathered over TP and summed
over CP, at the float32 delta rule's bound: BOUND = 1e-5 relative per parameter, as tests/unit/test_gdn_replay.py
states it (megatron's rule computes in float32 and chunks from each segment's first token; measured there <= 5.6e-6).
Measured here (worst parameter, relative): against CP1 naive <= 5.1e-6, against the same schedule at CP1 <= 3.1e-6,
against HF <= 5.3e-6 (CP2, CP4, TP2 x CP2 + SP); the planted exchange bugs give 1.3 to 3.6.
The tiny model has 2 key / 4 value GDN heads: CP2 gives each rank one whole key head and its two value heads; CP4
and TP2 x CP2 give each rank one value head, its key head shared by two ranks (the replicated-group case).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gdn_helpers import rollouts

from megatron_branch.checkpoint import hf_to_mcore_state, load_full_state, mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads
from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.gdn_tree import GDN_STATE
from megatron_branch.parallel import head_exchange
from megatron_branch.parallel.grads import finalize_grads
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.parallel.ring import RingStats
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.schedule.prefix_cache import PrefixCache
from megatron_branch.testing import exact_hf_norms, hf_policy_gradient, tiny_hf_config, tiny_hf_model

BOUND = 1e-5
LAYERS = ("linear_attention", "full_attention", "linear_attention")  # GDN -> attention (the ring) -> GDN


def _hf() -> Any:
    cfg = tiny_hf_config("qwen3_5", num_layers=3, ffn=48, layer_types=LAYERS)
    return exact_hf_norms(tiny_hf_model(cfg, seed=5, dtype=torch.float32))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert got.keys() == want.keys()
    return max((_rel(got[n], w), n) for n, w in want.items())


class _Setup:
    """The model at this layout (HF's weights), the tree, the objective, and the CP1 references."""

    def __init__(self, *, tp: int, cp: int) -> None:
        sp = tp > 1
        self.sp, self.tp = sp, tp
        self.groups = initialize_parallel(ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp))
        assert (self.groups.cp_size, self.groups.dp_size) == (cp, 1)
        hf = _hf()
        self.arch = ModelArch.from_hf_config(hf.config)
        self.model = build_model(self.arch, tp=tp, sequence_parallel=sp)
        state = hf_to_mcore_state(hf.state_dict(), self.arch, padded_vocab=self.arch.padded_vocab_size(tp))
        load_full_state(self.model, state, self.groups.tp)
        self.rollouts = rollouts()
        self.tree = PrefixTree.build(self.rollouts, vocab_size=self.arch.vocab_size)
        assert self.tree.max_depth >= 3
        self.obj = PolicyGradientObjective.grpo(
            [r.advantage for r in self.rollouts], self.tree.num_response_tokens_logical()
        )
        self.no_cp = dataclasses.replace(self.groups, cp=None, cp_size=1)
        self.hf_loss, self.hf = hf_policy_gradient(hf, self.rollouts)
        self.naive, self.naive_grads = self.run("naive", self.no_cp)

    def run(self, schedule: str, groups: Any, **kw: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """One step of `schedule` at `groups`; (result, full HF-named gradients summed over CP and TP shards)."""
        self.model.zero_grad(set_to_none=True)
        opts = ScheduleOptions(
            groups=groups, vocab_size=self.arch.vocab_size, keep_logprobs=True, **{"chunk_tokens": None, **kw}
        )
        res = run_schedule(schedule, self.model, self.tree, self.obj, opts)
        dp_cp = groups.dp_cp if groups.cp_size > 1 else None
        finalize_grads(self.model, tp_group=self.groups.tp, dp_cp_group=dp_cp, sequence_parallel=self.sp)
        grads = mcore_to_hf_state(gather_full_grads(self.model, self.groups.tp), self.arch)
        self.model.zero_grad(set_to_none=True)
        return res, grads

    def check(self, schedule: str, **kw: Any) -> Any:
        """`schedule` under CP equals naive at CP1, the same schedule at CP1, and HF, per parameter."""
        res, grads = self.run(schedule, self.groups, **kw)
        one, one_grads = self.run(schedule, self.no_cp, **{k: v for k, v in kw.items() if k != "ring_stats"})
        for name, want in (("naive", self.naive_grads), ("cp1", one_grads), ("hf", self.hf)):
            err, param = _worst(grads, want)
            assert err <= BOUND, f"{schedule} vs {name}: {param} relative error {err:.2e} > {BOUND}"
        assert res.loss == pytest.approx(self.naive.loss, rel=BOUND)
        assert res.loss == pytest.approx(self.hf_loss, rel=BOUND)
        torch.testing.assert_close(
            res.target_logprobs, self.naive.target_logprobs, rtol=0, atol=5e-6, equal_nan=True
        )
        return res


@pytest.mark.world(2, 4)
@pytest.mark.parametrize(
    "schedule,kw",
    [
        ("replay", {}),
        ("packed", {}),
        ("replay", {"branch_micro_batch": 1}),  # each sibling its own chunk: dS/dtail accumulate over chunks
    ],
    ids=["replay", "packed", "replay-mb1"],
)
def test_gdn_under_cp_equals_cp1_naive_and_hf(schedule: str, kw: dict) -> None:
    cp = dist.get_world_size()
    s = _Setup(tp=1, cp=cp)
    stats = RingStats()
    res = s.check(schedule, ring_stats=stats, **kw)
    if schedule == "replay" and not kw:
        assert res.positions_computed < s.naive.positions_computed  # the prefixes ran once
    # the exchange is real: per GDN layer and forward, two all-to-alls of cp - 1 blocks each
    gdn = s.arch.num_linear_layers
    assert stats.exchange_messages == 2 * (cp - 1) * gdn * res.forwards
    assert stats.kv_messages > 0  # and the attention layer ran its ring


@pytest.mark.world(2)
def test_gdn_under_cp2_with_recompute_and_layer_checkpointing() -> None:
    """Segment recompute + per-layer checkpointing (the planner's `recompute full`): the exchange runs again inside
    backward, in the same order on every rank."""
    s = _Setup(tp=1, cp=2)
    s.check("replay", recompute=True, recompute_layers=True, branch_micro_batch=2)


@pytest.mark.world(2)
def test_gdn_scoring_under_cp2_equals_naive() -> None:
    s = _Setup(tp=1, cp=2)
    opts = ScheduleOptions(groups=s.groups, vocab_size=s.arch.vocab_size, chunk_tokens=None)
    want = score_rollouts("naive", s.model, s.tree, dataclasses.replace(opts, groups=s.no_cp))
    for schedule in ("replay", "packed"):
        got = score_rollouts(schedule, s.model, s.tree, opts)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=5e-6)


@pytest.mark.world(4)
@pytest.mark.parametrize("schedule", ["replay", "packed"])
def test_gdn_under_tp2_cp2_sp_equals_cp1_naive_and_hf(schedule: str) -> None:
    s = _Setup(tp=2, cp=2)
    s.check(schedule)


def _transposed_nothing(dy: torch.Tensor, group: Any) -> torch.Tensor:
    return dy  # backward without the all-to-all: each rank keeps the gradient blocks bound for the others


def _rank_major(self: head_exchange.CPHeadExchange) -> torch.Tensor:
    flat = self.rows.reshape(-1)
    return (
        (flat >= 0).nonzero().squeeze(1)
    )  # the received rows as they arrive: rank by rank, not in tree order


_EXTERNAL = PrefixCache.external


def _forgetful_external(self: PrefixCache, path: Any) -> Any:
    """Each rank's cache forgets the gradient earlier siblings sent into its heads' GDN state at the fork."""
    if path:
        for entry in self.entries[path[-1]].values():
            if entry.kind is GDN_STATE:
                for leaf in entry.trainable:
                    leaf.grad = None
    return _EXTERNAL(self, path)


@pytest.mark.world(2, 4)
@pytest.mark.parametrize(
    "bug", ["backward_not_transposed", "zigzag_not_undone", "state_grad_not_accumulated"]
)
def test_planted_exchange_bugs_fail(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    s = _Setup(tp=1, cp=dist.get_world_size())
    if bug == "backward_not_transposed":
        monkeypatch.setattr(head_exchange, "all_to_all_backward", _transposed_nothing)
    elif bug == "zigzag_not_undone":
        monkeypatch.setattr(head_exchange.CPHeadExchange, "_tree_order", _rank_major)
    else:  # the fork state's dS/dtail must reach the parent's backward summed over every sibling chunk
        monkeypatch.setattr(PrefixCache, "external", _forgetful_external)
    _, grads = s.run("replay", s.groups, branch_micro_batch=1)
    err, param = _worst(grads, s.naive_grads)
    assert err > 100 * BOUND, (bug, err, param)  # not a rounding-level difference
