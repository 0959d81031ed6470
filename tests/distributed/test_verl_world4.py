"""verl's MegatronEngine with and without the branch-replay switch at world 4 (gloo, CPU), through verl's
TrainingWorker with dynamic batch size: a Qwen3-MoE policy at EP2 x TP2 (+SP) with router replay R3 on and off,
a dense policy at CP4 under verl's zigzag layout, and verl's pipeline parallelism beside DP or TP (PP2 x DP2,
PP2 x TP2 + SP). Compared as in test_verl_moe_parallel.py, test_verl_engine_cp.py and test_verl_engine_pp.py
(whose helpers these reuse): compute_log_prob's logprobs and entropies, every gradient shard (fp32 1e-5 per
parameter; at DP2 both optimizer steps' gradients, with megatron's SGD), verl's metrics.

    python tests/distributed/launch.py 4 -k verl_world4

Skipped (on every rank alike) without the verl extra.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch.distributed as dist

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from test_verl_engine_cp import _check  # noqa: E402
from test_verl_engine_pp import _check as _check_pp  # noqa: E402
from test_verl_engine_pp import _step as _step_pp  # noqa: E402
from test_verl_moe_parallel import (  # noqa: E402
    _compare,
    _moe_policy_dir,
    _with_r3_records_from_the_wrong_rollout,
    verl_router_replay_patch_undone,  # noqa: F401  (the fixture)
)
from verl_helpers import (  # noqa: E402
    dp_share,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    run_step,
    set_switch,
    shared_policy_dir,
)


@pytest.mark.world(4)
@pytest.mark.parametrize("r3", [False, True], ids=["r3_off", "r3_on"])
def test_verl_world4_moe_ep2_tp2(
    r3: bool,
    monkeypatch: pytest.MonkeyPatch,
    verl_router_replay_patch_undone: None,  # noqa: F811
) -> None:
    """Qwen3-MoE (4 experts, top-2) at EP2 x TP2 (+SP, expert TP = TP; EP across the two DP replicas, tp
    fastest), dynamic batch size on: the switch == verl's own path, with router replay R3 (the rollout
    engine's records, one rollout per group disagreeing with its group at a shared prompt token) and without.
    Planted (R3): a shared token's routing taken from another rollout of its group fails."""
    from megatron.core import parallel_state as ps
    from verl.utils import tensordict_utils as tu

    os.environ.setdefault("MASTER_PORT", "0")
    hf = _moe_policy_dir()
    tp = 2
    dp = dist.get_world_size() // tp
    rank = dist.get_rank() // tp

    def td():
        batch = dp_share(grpo_batch(seed=13, groups=4, routes=(2, 2, 4) if r3 else None), rank, dp)
        if r3:
            tu.assign_non_tensor(batch, enable_routing_replay=True)
        return batch

    def worker():
        return make_worker(
            hf, tp=tp, ep=2, dynamic_bsz=True, router_replay="R3" if r3 else "disabled", optimizer="sgd"
        )

    set_switch(False)
    base = run_step(worker(), td)
    # verl's expert_tensor_parallel_size unset: megatron's default, expert TP = TP
    assert ps.get_expert_model_parallel_world_size() == 2 and ps.get_expert_tensor_parallel_world_size() == tp
    set_switch(True)
    tree = run_step(worker(), td)
    _compare(base, tree, f"EP2 x TP2 r3={r3}")
    if r3:  # planted: a shared token's routing taken from another rollout of its group
        wrong = _with_r3_records_from_the_wrong_rollout(monkeypatch, lambda: run_step(worker(), td))
        err, _ = max_rel_grad_error(base.grads, wrong.grads)
        assert err > 1e-4, f"the planted routing went unnoticed ({err:.2e})"
    set_switch(False)


@pytest.mark.world(4)
def test_verl_world4_cp4_zigzag() -> None:
    """A dense policy at CP4 (verl's zigzag split, each packed sequence padded to a multiple of tp x cp x 2 = 8)
    in megatron's default loss regime: the switch (megatron-branch's own CP: ring attention over the 4 ranks) ==
    verl's CP4 path, outputs on every CP rank."""
    _check(tp=1, cp=4, per_token_loss=False)


@pytest.mark.world(4)
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2_dp2", "pp2_tp2_sp"])
def test_verl_world4_pp2_beside_dp_or_tp(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's pipeline parallelism with DP or TP beside it: PP2 x DP2 (each replica its own tree of two prompt
    groups through both stages; two optimizer steps per rank, so megatron's SGD) and PP2 x TP2 + SP (the stages'
    activations sequence-sharded over TP; replay's shared segments cut into 2 root pieces, which the one-pass
    update's objective takes as the step's tree): the switch's pipelined tree schedule (replay, one pass) == verl's
    own PP path (megatron's 1F1B schedule): logprobs and entropies where verl collects them (each
    replica's last stage, tp rank 0), every gradient shard on every stage, verl's metrics. Planted (PP2 x DP2):
    the first stage's cached prefix K/V get none of their branches' gradients, and both replicas' first stages
    fail while their last stages pass."""
    from megatron.core import parallel_state as ps

    from megatron_branch.integration.verl import BranchOptions
    from megatron_branch.schedule import pipeline
    from megatron_branch.schedule.prefix_cache import PrefixCache

    os.environ.setdefault("MASTER_PORT", "0")
    hf = shared_policy_dir()
    optimizer = "sgd" if tp == 1 else "adam"  # one step per rank at TP2: Adam's first step is never compared
    # chunks off: the tiny batch would otherwise be one chunk (no pieces, no cache; test_verl_engine_pp.py)
    pieces = {"root_pieces": 2} if tp > 1 else {}
    options = BranchOptions(schedule="replay", schedule_options={"chunk_tokens": None, **pieces})
    cut: list[bool] = []  # per pipelined run: its tree cut into pieces (True) or run as built
    real_split = pipeline.split_roots

    def spied(built: Any, k: int) -> Any:
        out = real_split(built, k)
        cut.append(out is not built)
        return out

    monkeypatch.setattr(pipeline, "split_roots", spied)
    base = _step_pp(hf, switch=False, tp=tp, optimizer=optimizer)
    tree = _step_pp(hf, switch=True, options=options, tp=tp, optimizer=optimizer)
    monkeypatch.undo()
    assert cut and all(cut) == (tp > 1), cut  # the pieces reached the pipeline (PP2 x TP2)
    assert (
        ps.get_pipeline_model_parallel_world_size() == 2 and ps.get_tensor_model_parallel_world_size() == tp
    )
    _check_pp(base, tree, f"PP2 x {'DP2' if tp == 1 else 'TP2 + SP'}", passes=1)
    if tp > 1:
        return
    real = PrefixCache.injection

    def dropped(self: Any, seg_id: int, captured: Any) -> Any:
        return ([], []) if ps.is_pipeline_first_stage() else real(self, seg_id, captured)

    monkeypatch.setattr(PrefixCache, "injection", dropped)
    planted = _step_pp(hf, switch=True, options=options, optimizer=optimizer)
    monkeypatch.undo()
    first_stage = ps.is_pipeline_first_stage()
    err = max_rel_grad_error(base.first_grads, planted.first_grads)[0]  # before any update
    assert err > 1e-2 if first_stage else err <= 1e-5, (dist.get_rank(), err)
