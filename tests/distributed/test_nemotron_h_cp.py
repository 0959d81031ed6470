"""Context parallelism for Nemotron-H's Mamba-2 layers (the head exchange: models/mamba_heads.py,
parallel/head_exchange.py) on the tiny nemotron_h policy (layers M * - M -: 4 Mamba heads in 2 groups, so each CP2
rank runs one whole group's two heads over the whole chunk; the attention layer runs the ring), and at world 4
under CP4 and TP2 x CP2 + SP (one head per rank, its group's B / C shared with the rank beside it).

    python tests/distributed/launch.py 2 -k nemotron_h_cp
    python tests/distributed/launch.py 4 -k nemotron_h_cp

Every rank builds the same HF model and tree (seeded), computes the single-rank references itself (naive at CP1,
the same schedule at CP1, and Hugging Face rollout by rollout), and compares the gradient of every parameter summed
over CP at BOUND = 1e-5 relative (transformers' SSD scan is float32 inside and chunks from each segment's first
token: tests/unit/test_nemotron_h.py). The tree is the recurrent tests' fork-heavy one (tests/gdn_helpers.py): forks
at depths 1 to 3, segments shorter than the conv's K-1 = 3 inputs (a child's conv window reaches into its
grandparent) and than 2 x CP (mostly padding on a CP rank). Planted bugs: one CP rank's segments starting from a
zero SSM state or without their parent's conv tail, and the zigzag split not undone before the scan. The MoE ("E")
layers under CP2 and CP2 x EP2 through `grad`, and the CP refusal in one line: tests/distributed/
test_nemotron_h_tp.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gdn_helpers import rollouts
from test_gdn_cp import _rank_major, _worst
from test_gdn_cp import _Setup as GDNSetup

from megatron_branch.checkpoint import hf_to_mcore_state, load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.models.mamba import BranchMambaMixer
from megatron_branch.parallel import head_exchange
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.parallel.ring import RingStats
from megatron_branch.schedule import ScheduleOptions, score_rollouts
from megatron_branch.testing import hf_policy_gradient, hf_state, tiny_hf_config, tiny_hf_model

BOUND = 1e-5


class _Setup(GDNSetup):
    """The model at CP2 (HF's weights), the tree, the objective, and the CP1 references; `run` and `check` are the
    gated delta net's (test_gdn_cp.py)."""

    def __init__(self, *, tp: int = 1, cp: int = 2) -> None:
        self.sp, self.tp = tp > 1, tp
        self.groups = initialize_parallel(ParallelConfig(tp=tp, cp=cp, sequence_parallel=self.sp))
        assert (self.groups.cp_size, self.groups.dp_size) == (cp, 1)
        hf = tiny_hf_model(tiny_hf_config("nemotron_h", num_layers=5, ffn=48), seed=5, dtype=torch.float32)
        self.arch = ModelArch.from_hf_config(hf.config)
        self.model = build_model(self.arch, tp=tp, sequence_parallel=self.sp)
        state = hf_to_mcore_state(hf_state(hf), self.arch, padded_vocab=self.arch.padded_vocab_size(tp))
        load_full_state(self.model, state, self.groups.tp)
        self.rollouts = rollouts()
        self.tree = PrefixTree.build(self.rollouts, vocab_size=self.arch.vocab_size)
        self.obj = PolicyGradientObjective.grpo(
            [r.advantage for r in self.rollouts], self.tree.num_response_tokens_logical()
        )
        self.no_cp = dataclasses.replace(self.groups, cp=None, cp_size=1)
        self.hf_loss, grads = hf_policy_gradient(hf, self.rollouts)
        self.hf = {n.replace("model.", "backbone.", 1): g for n, g in grads.items()}  # the checkpoint's names
        self.naive, self.naive_grads = self.run("naive", self.no_cp)


@pytest.mark.world(2)
def test_nemotron_h_under_cp2_equals_cp1_naive_and_hf() -> None:
    """grad of replay (whole, one sibling per chunk, recompute + layer checkpoints) and packed == CP1 naive, the same
    schedule at CP1 and HF per parameter; the exchange counted; scoring == CP1 naive."""
    s = _Setup()
    mamba_layers = s.arch.hybrid_override_pattern.count("M")
    for schedule, kw in (
        ("replay", {}),
        ("packed", {}),
        ("replay", {"branch_micro_batch": 1}),  # each sibling its own chunk: dS/dtail accumulate over chunks
        ("replay", {"recompute": True, "recompute_layers": True}),  # the exchange again inside backward
    ):
        stats = RingStats()
        res = s.check(schedule, ring_stats=stats, **kw)  # == CP1 naive, the same schedule at CP1, and HF
        # the exchange is real: per Mamba layer and forward, two all-to-alls of one block each (more when layer
        # checkpoints rerun it inside backward); the attention layer ran its ring
        exchanges = 2 * mamba_layers * res.forwards
        if kw.get("recompute_layers"):
            assert stats.exchange_messages > exchanges
        else:
            assert stats.exchange_messages == exchanges
        assert stats.kv_messages > 0
        if schedule == "replay" and not kw:
            assert res.positions_computed < s.naive.positions_computed  # the prefixes ran once
    # forward-only scoring (old / reference logprobs) through the same exchange
    opts = ScheduleOptions(groups=s.groups, vocab_size=s.arch.vocab_size)
    want = score_rollouts("naive", s.model, s.tree, dataclasses.replace(opts, groups=s.no_cp))
    for schedule in ("replay", "packed"):
        got = score_rollouts(schedule, s.model, s.tree, opts)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=5e-6)


@pytest.mark.world(4)
@pytest.mark.parametrize("tp,cp", [(1, 4), (2, 2)], ids=["cp4", "tp2_cp2_sp"])
def test_nemotron_h_under_cp4_and_tp2_cp2_equals_cp1_naive_and_hf(tp: int, cp: int) -> None:
    """World 4: CP4 (one Mamba head per rank, each of the 2 groups' B / C replicated over the 2 ranks holding its
    heads) and TP2 x CP2 + SP (a TP rank's 2 heads in 1 group, one head per CP rank, the group shared): replay's and
    packed's grad == CP1 naive, the same schedule at CP1 and HF per parameter, gathered over TP and summed over CP
    (measured: worst 1.9e-6 relative); the exchange counted (two all-to-alls of cp - 1 blocks per Mamba layer and
    forward)."""
    s = _Setup(tp=tp, cp=cp)
    for schedule in ("replay", "packed"):
        stats = RingStats()
        res = s.check(schedule, ring_stats=stats)
        exchanges = 2 * (cp - 1) * s.arch.hybrid_override_pattern.count("M") * res.forwards
        assert stats.exchange_messages == exchanges > 0 and stats.kv_messages > 0, (schedule, stats)
        if schedule == "replay":
            assert res.positions_computed < s.naive.positions_computed  # the prefixes ran once


def _one_rank_starts_wrong(bug: str) -> Any:
    """`BranchMambaMixer._start` broken on CP rank 1 only, for every segment with a parent: its heads' SSM state
    zeroed, or its heads' conv tail dropped."""
    original = BranchMambaMixer._start

    def planted(self: BranchMambaMixer, parent: int | None, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        S, tail = original(self, parent, *args)
        if parent is None or dist.get_rank() != 1:
            return S, tail
        return (torch.zeros_like(S), tail) if bug == "zero_parent_state" else (S, torch.zeros_like(tail))

    return planted


@pytest.mark.world(2)
def test_planted_cp_bugs_fail() -> None:
    s = _Setup()
    for bug in ("zero_parent_state", "drop_parent_tail", "zigzag_not_undone"):
        with pytest.MonkeyPatch.context() as mp:
            if (
                bug == "zigzag_not_undone"
            ):  # the scan runs over the received rows rank by rank, not in tree order
                mp.setattr(head_exchange.CPHeadExchange, "_tree_order", _rank_major)
            else:
                mp.setattr(BranchMambaMixer, "_start", _one_rank_starts_wrong(bug))
            _, grads = s.run("replay", s.groups, branch_micro_batch=1)
        err, param = _worst(grads, s.naive_grads)
        assert err > 100 * BOUND, (bug, err, param)  # not a rounding-level difference
