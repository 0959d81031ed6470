"""verl's update in one tree pass (integration/verl_onepass.py) against the two-pass path and verl without the
switch, through verl's TrainingWorker on CPU (as tests/unit/test_verl_engine.py): every parameter's gradient fp32
1e-5, verl's loss metrics, and `tree/update_passes` saying which path ran, for the policy loss modes and every
loss_agg_mode verl 0.9.1 ships; planted: a shared token's live value withheld from its rollouts.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    actor_config,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    one_rank_world,
    run_step,
    set_switch,
)

pytestmark = pytest.mark.slow

single_process = pytest.fixture(scope="module", name="single_process")(one_rank_world)

AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-mean",
]
CASES = [
    *(("vanilla", agg, 1) for agg in AGG_MODES),
    ("cispo", "token-mean", 1),
    ("sapo", "seq-mean-token-mean", 1),
    ("dro", "seq-mean-token-sum", 1),
    ("gspo", "seq-mean-token-mean", 2),  # the rollout's mean log-ratio: two passes
    ("geo_mean", "token-mean", 2),
]
LOSS_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "kl_loss", "loss")


def _actor(mode: str, agg: str) -> object:
    from verl.workers.config import PolicyLossConfig

    policy = PolicyLossConfig(loss_mode=mode, dro_beta=0.5 if mode == "dro" else None)
    return actor_config(loss_agg_mode=agg, clip_ratio_high=0.28, policy_loss=policy)


def _tree_step(hf: str, actor: object, *, one_pass: bool, seed: int) -> object:
    from megatron_branch.integration.verl import BranchOptions

    set_switch(True)
    try:
        worker = make_worker(hf)
        # chunks off: the walk's chunks each hold part of a rollout's slots (what the planted gspo case needs)
        worker.engine.branch_options = BranchOptions(
            schedule="replay", one_pass=one_pass, schedule_options={"chunk_tokens": None}
        )
        return run_step(worker, lambda: grpo_batch(seed=seed), actor=actor)
    finally:
        set_switch(False)


@pytest.mark.parametrize(("mode", "agg", "passes"), CASES, ids=[f"{m}-{a}" for m, a, _ in CASES])
def test_one_pass_equals_two_pass_equals_verl(single_process: str, mode: str, agg: str, passes: int) -> None:
    actor = _actor(mode, agg)
    set_switch(False)
    base = run_step(make_worker(single_process), lambda: grpo_batch(seed=6), actor=actor)
    one = _tree_step(single_process, actor, one_pass=True, seed=6)
    two = _tree_step(single_process, actor, one_pass=False, seed=6)
    assert one.metrics["tree/update_passes"][0] == passes  # per-token losses skip the scoring pass
    assert two.metrics["tree/update_passes"][0] == 2
    for got, label in ((one, "one pass"), (two, "two passes")):
        err, name = max_rel_grad_error(base.grads, got.grads)
        assert err <= 1e-5, f"{label}: {name}: {err:.2e}"
    err, name = max_rel_grad_error(two.grads, one.grads)
    assert err <= 1e-5, f"one vs two passes: {name}: {err:.2e}"
    for key in LOSS_METRICS:
        if key in base.metrics:
            got, want = float(one.metrics[key][0]), float(base.metrics[key][0])
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (key, got, want)


def test_every_verl_policy_loss_mode_has_a_path() -> None:
    """Each mode verl registers is either per-token (one pass) or named with its reason (two passes)."""
    from functools import partial

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    from verl.workers.utils.losses import ppo_loss

    from megatron_branch.integration.verl_onepass import PER_TOKEN_LOSS_MODES, two_pass_reason

    def post(mode: str, agg: str = "token-mean", schedule: str = "replay") -> str | None:
        fn = partial(ppo_loss, config=_actor(mode, agg))
        return two_pass_reason(partial(lambda **_: None, loss_function=fn), schedule)

    assert PER_TOKEN_LOSS_MODES <= set(POLICY_LOSS_REGISTRY)
    for mode in POLICY_LOSS_REGISTRY:
        reason = post(mode)
        assert (reason is None) == (mode in PER_TOKEN_LOSS_MODES), (mode, reason)
    assert "gspo" in str(post("gspo")) and "naive" in str(post("vanilla", schedule="naive"))
    assert two_pass_reason(partial(lambda **_: None, loss_function=lambda **_: 0), "replay") is not None


def test_planted_bug_shared_token_withheld_is_caught(single_process: str) -> None:
    """The one-pass objective with a shared tree token's live value withheld from its rollouts' slots (held
    constant: no gradient) differs from verl's gradient."""
    from megatron_branch.integration import verl_onepass

    actor = _actor("vanilla", "token-mean")
    set_switch(False)
    base = run_step(make_worker(single_process), lambda: grpo_batch(seed=6), actor=actor)
    orig = verl_onepass._BoundOnePass._live

    def unshared(
        self: verl_onepass._BoundOnePass, k: int, where: torch.Tensor, values: torch.Tensor
    ) -> object:
        tokens = self.o.slots.tokens[k]
        counts = torch.bincount(tokens, minlength=len(where))
        where = where.clone()
        where[counts > 1] = -1
        return orig(self, k, where, values)

    verl_onepass._BoundOnePass._live = unshared  # type: ignore[method-assign]
    try:
        bad = _tree_step(single_process, actor, one_pass=True, seed=6)
    finally:
        verl_onepass._BoundOnePass._live = orig  # type: ignore[method-assign]
    assert bad.metrics["tree/update_passes"][0] == 1
    assert max_rel_grad_error(base.grads, bad.grads)[0] > 1e-3


def test_gspo_needs_the_two_pass_path(single_process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why gspo is not in PER_TOKEN_LOSS_MODES: forced through the one-pass objective, its sequence ratio is read
    from a chunk's partial slots and the gradient is wrong."""
    from megatron_branch.integration import verl_onepass

    actor = _actor("gspo", "seq-mean-token-mean")
    set_switch(False)
    base = run_step(make_worker(single_process), lambda: grpo_batch(seed=6), actor=actor)
    monkeypatch.setattr(verl_onepass, "PER_TOKEN_LOSS_MODES", verl_onepass.PER_TOKEN_LOSS_MODES | {"gspo"})
    forced = _tree_step(single_process, actor, one_pass=True, seed=6)
    assert forced.metrics["tree/update_passes"][0] == 1
    assert max_rel_grad_error(base.grads, forced.grads)[0] > 1e-3


@pytest.mark.parametrize(
    ("schedule", "options"),
    [("packed", {}), ("replay", {"recompute": True, "branch_micro_batch": 2, "chunk_tokens": None})],
    ids=["packed", "replay_recompute"],
)
def test_one_pass_under_other_schedules(single_process: str, schedule: str, options: dict) -> None:
    """The one-pass objective under the packed schedule and under replay with recomputation (a segment's chunk
    forwarded twice): still verl's gradient."""
    from megatron_branch.integration.verl import BranchOptions

    actor = _actor("vanilla", "seq-mean-token-mean")
    set_switch(False)
    base = run_step(make_worker(single_process), lambda: grpo_batch(seed=6), actor=actor)
    set_switch(True)
    try:
        worker = make_worker(single_process)
        worker.engine.branch_options = BranchOptions(schedule=schedule, schedule_options=options)
        got = run_step(worker, lambda: grpo_batch(seed=6), actor=actor)
    finally:
        set_switch(False)
    assert got.metrics["tree/update_passes"][0] == 1
    err, name = max_rel_grad_error(base.grads, got.grads)
    assert err <= 1e-5, f"{schedule} {options}: {name}: {err:.2e}"
