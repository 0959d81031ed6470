"""verl's MegatronEngine on a Qwen3-MoE policy (4 experts, top-2, 2 layers: one MoE layer per stage) at PP2 (world
2, EP1), with and without the branch-replay switch, through verl's TrainingWorker (gloo, CPU, dynamic batch size).
Without the switch verl runs megatron's own pipeline schedule (its all-to-all dispatcher, variable sequence
lengths, p2p); with it the step's micro-batches form one prefix tree run by megatron-branch's pipelined schedule
(schedule/pipeline.py; each stage's router losses through schedule/moe.py). Compared: logprobs and entropies on the
collecting (last) stage, every parameter's main_grad on EACH stage (fp32 1e-5 relative), verl's metrics; with
megatron's aux loss and z-loss on, and with router replay R3. Planted: the first stage's router-loss gradient
dropped fails there (and only there); R3 records of the other stage's MoE layer fail; R2 handing the other stage's
layer stops on the switch's assertion. verl 0.9.1's engine reports no router-loss metrics (neither path).

    python tests/distributed/launch.py 2 -k verl_pp_moe

Skipped (on every rank alike) without the verl extra.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from test_verl_engine_pp import METRICS, _first, _worst_over_stages  # noqa: E402
from test_verl_moe_parallel import _moe_policy_dir, verl_router_replay_patch_undone  # noqa: E402, F401
from verl_helpers import (  # noqa: E402
    actor_config,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    max_rel_step_error,
    run_step,
    set_switch,
)

LOSSES = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.05, "moe_z_loss_coeff": 0.01}


def _step(hf: str, switch: bool, td: Any, **worker: Any) -> Any:
    set_switch(switch)
    try:
        return run_step(
            make_worker(hf, pp=2, dynamic_bsz=True, **worker), td, actor=actor_config(use_dynamic_bsz=True)
        )
    finally:
        set_switch(False)


def _check(base: Any, tree: Any, what: str) -> None:
    from megatron.core import parallel_state as ps

    assert ps.get_pipeline_model_parallel_world_size() == 2
    collects = ps.is_pipeline_last_stage()
    assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
    assert (base.log_probs is None) == (tree.log_probs is None) == (not collects)
    err, name = max_rel_step_error(base, tree)
    assert err <= 1e-5, f"{what}: stage {dist.get_rank()} {name}: {err:.2e}"
    if not collects:
        return
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree.entropy, base.entropy, rtol=1e-5, atol=1e-5)
    for key in METRICS:
        got, want = float(_first(tree.metrics[key])), float(_first(base.metrics[key]))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), f"{what}: {key}"
    assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]


def _sorted(routes: Any) -> list[torch.Tensor]:
    """Each row's experts as a set (verl keeps torch.topk's order, the tree ascending)."""
    return [r.long().sort(dim=-1).values for r in routes.unbind()]


@pytest.mark.world(2)
@pytest.mark.usefixtures("verl_router_replay_patch_undone")
def test_verl_pp_moe_switch_equals_verl(monkeypatch: pytest.MonkeyPatch) -> None:
    """PP2: megatron's aux loss and z-loss (verl's override_transformer_config), router replay R3 (the rollout
    engine's records, each stage replaying its own layer's) and R2 (compute_log_prob records each stage's layer,
    verl's pp_gather joins them, the update replays them): the switch == verl's own pipeline path."""
    from verl.utils import tensordict_utils as tu

    from megatron_branch.integration import verl_moe
    from megatron_branch.losses import router_plan

    os.environ.setdefault("MASTER_PORT", "0")
    hf = _moe_policy_dir()

    def td() -> Any:
        return grpo_batch(seed=13, groups=2, temperature=0.7)

    base = _step(hf, False, td, override_transformer_config=LOSSES)
    tree = _step(hf, True, td, override_transformer_config=LOSSES)
    _check(base, tree, "aux_loss + z_loss")

    # planted: stage 0's balancing loss attached with no gradient
    real = router_plan.RouterPlan.balancing_loss

    def dropped(self: Any, layer: int, *a: Any, **kw: Any) -> Any:
        loss = real(self, layer, *a, **kw)
        return loss.detach() if dist.get_rank() == 0 else loss

    monkeypatch.setattr(router_plan.RouterPlan, "balancing_loss", dropped)
    planted = _step(hf, True, td, override_transformer_config=LOSSES)
    monkeypatch.undo()
    every = _worst_over_stages(max_rel_grad_error(base.grads, planted.grads)[0])
    assert every[0] > 1e-2 and every[1] <= 1e-5, every  # the first stage's gradients wrong, the last's right

    def routed() -> Any:
        batch = grpo_batch(seed=13, groups=2, routes=(2, 2, 4))
        tu.assign_non_tensor(batch, enable_routing_replay=True)
        return batch

    base = _step(hf, False, routed, router_replay="R3")
    tree = _step(hf, True, routed, router_replay="R3")
    _check(base, tree, "R3")
    real_routes = verl_moe.r3_routes

    def other_stage(mode: str, model: Any, micro_batches: list[Any]) -> Any:
        routes = real_routes(mode, model, micro_batches)
        return [[r.flip(1) for r in rows] for rows in routes]

    monkeypatch.setattr(verl_moe, "r3_routes", other_stage)
    planted = _step(hf, True, routed, router_replay="R3")
    monkeypatch.undo()
    every = _worst_over_stages(max_rel_grad_error(base.grads, planted.grads)[0])
    assert every.min() > 1e-2, every  # each stage replays the other's layer: both stages' gradients wrong

    def recorded() -> Any:  # R2: compute_log_prob records the routes, the update replays them
        batch = grpo_batch(seed=13, groups=2)
        tu.assign_non_tensor(batch, enable_routing_replay=True)
        return batch

    def r2(switch: bool) -> Any:
        set_switch(switch)
        try:
            worker = make_worker(
                hf, pp=2, dynamic_bsz=True, router_replay="R2", override_transformer_config=LOSSES
            )
            return run_step(worker, recorded, actor=actor_config(use_dynamic_bsz=True), r2=True)
        finally:
            set_switch(False)

    base, tree = r2(False), r2(True)
    # compute_log_prob's records as the trainer hands them to every rank: [n, MoE layers, k] per rollout, both
    # stages' layers (verl's pp_gather)
    assert base.routes is not None and tree.routes is not None
    assert base.routes.size(2) == 2
    for a, b in zip(_sorted(base.routes), _sorted(tree.routes), strict=True):
        assert torch.equal(a, b)
    _check(base, tree, "R2")

    # planted: each stage hands the other stage's layer as its record: those columns were never routed here
    real_record = verl_moe.r2_record

    def wrong_stage(*a: Any) -> Any:
        record = real_record(*a)
        if record is not None:
            record.columns = tuple(1 - c for c in record.columns)
        return record

    monkeypatch.setattr(verl_moe, "r2_record", wrong_stage)
    with pytest.raises(AssertionError, match="left tokens unrouted"):
        r2(True)
    monkeypatch.undo()
