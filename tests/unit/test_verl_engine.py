"""verl's MegatronEngine with and without the branch-replay switch, driven through verl's TrainingWorker on CPU.

verl's own code runs: TrainingWorker.infer_batch / train_mini_batch, MegatronEngine.train_batch /
forward_backward_batch (prepare_micro_batches, global token counts, postprocess_batch_func), verl's THD packing
(preprocess_thd_engine) on the baseline, ppo_loss with verl's policy loss, KL and entropy terms, megatron's
optimizer, DDP and finalize_model_grads. Driven around on CPU (integration/verl_cpu.py): the platform (set_platform),
TE's packed attention (a THD CPU stand-in) and the bridge's model build (the same GPTModel built on the host).

Skipped cleanly without verl (`make setup-verl` installs it; `make test` does).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    VOCAB,
    actor_config,
    grpo_batch,
    infer,
    make_worker,
    max_rel_grad_error,
    one_rank_world,
    run_step,
    set_switch,
)

pytestmark = pytest.mark.slow

single_process = pytest.fixture(scope="module", name="single_process")(one_rank_world)


@pytest.fixture(scope="module")
def both(single_process: str) -> tuple:
    """One compute_log_prob + update_actor step of verl's engine, without then with the switch."""
    set_switch(False)
    base = run_step(make_worker(single_process), lambda: grpo_batch(seed=0))
    set_switch(True)
    tree = run_step(make_worker(single_process), lambda: grpo_batch(seed=0))
    set_switch(False)
    return base, tree


def test_switch_selects_the_branch_engine(both: tuple) -> None:
    base, tree = both
    assert base.engine == "CpuMegatronEngineWithLMHead"
    assert tree.engine == "BranchReplayCpuMegatronEngineWithLMHead"


def test_compute_log_prob_matches_verl(both: tuple) -> None:
    """old logprobs and entropies in verl's padded response layout (what the trainer stores), fp32 1e-5."""
    base, tree = both
    assert base.log_probs.shape == tree.log_probs.shape and base.log_probs.abs().sum() > 0
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree.entropy, base.entropy, rtol=1e-5, atol=1e-5)


def test_update_matches_verl_per_parameter(both: tuple) -> None:
    """Every parameter's gradient (megatron's main_grad before the optimizer step), fp32 1e-5 relative."""
    base, tree = both
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"{name}: {err:.2e}"


def test_verl_metrics_unchanged_plus_positions(both: tuple) -> None:
    """verl's loss and metric values equal; ours added: positions computed < logical."""
    base, tree = both
    for key, value in base.metrics.items():
        if key.startswith("perf/") or key == "mfu":
            continue  # timings and memory
        assert key in tree.metrics, key
        got, want = (float(x) for x in (tree.metrics[key][0], value[0]))
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (key, got, want)
    logical = tree.metrics["tree/positions_logical"][0]
    computed = tree.metrics["tree/positions_computed"][0]
    assert computed < logical and tree.metrics["tree/token_ratio"][0] == pytest.approx(logical / computed)


def test_dynamic_batch_size_and_temperature(single_process: str) -> None:
    """verl's dynamic batch size (token-budget micro-batches that may split a group) and a sampling temperature
    (verl divides the logits by it): still exact."""

    def td() -> object:
        return grpo_batch(seed=1, groups=3, temperature=0.7)

    set_switch(False)
    base = run_step(make_worker(single_process, dynamic_bsz=True), td)
    set_switch(True)
    tree = run_step(make_worker(single_process, dynamic_bsz=True), td)
    set_switch(False)
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"{name}: {err:.2e}"


def test_planted_bug_dropped_entropy_gradient_is_caught(single_process: str, both: tuple) -> None:
    """The same comparison fails when the entropy term's gradient is dropped from the two-pass path's gradient
    pass (the one-pass path's planted bugs: test_verl_onepass.py)."""
    from megatron_branch.integration import verl_batch
    from megatron_branch.integration.verl import BranchOptions

    base, _ = both
    orig = verl_batch.LinearSlotObjective.bind

    def without_entropy(self: verl_batch.LinearSlotObjective, tree: object) -> object:
        return orig(verl_batch.LinearSlotObjective(G=self.G, H=None), tree)

    verl_batch.LinearSlotObjective.bind = without_entropy  # type: ignore[method-assign]
    try:
        set_switch(True)
        worker = make_worker(single_process)
        worker.engine.branch_options = BranchOptions(schedule="replay", one_pass=False)
        bad = run_step(worker, lambda: grpo_batch(seed=0))
    finally:
        verl_batch.LinearSlotObjective.bind = orig  # type: ignore[method-assign]
        set_switch(False)
    err, _ = max_rel_grad_error(base.grads, bad.grads)
    assert err > 1e-3


def test_refusals_are_one_line(single_process: str) -> None:
    from verl.workers.config import McoreEngineConfig

    from megatron_branch.integration.verl import VerlBranchError, refuse_unsupported

    # CP runs (tests/distributed/test_verl_engine_cp.py); dynamic_context_parallel: test_verl_refusals.py
    refuse_unsupported(McoreEngineConfig(context_parallel_size=2))
    cfg = McoreEngineConfig(use_fused_kernels=True)
    with pytest.raises(VerlBranchError, match="use_fused_kernels") as e:
        refuse_unsupported(cfg)
    assert "\n" not in str(e.value)
    from types import SimpleNamespace

    moe = SimpleNamespace(
        calculate_per_token_loss=False,
        num_moe_experts=8,
        moe_router_load_balancing_type="global_aux_loss",
        moe_expert_capacity_factor=None,
    )
    with pytest.raises(VerlBranchError, match="global_aux_loss"):
        refuse_unsupported(McoreEngineConfig(), moe)
    from verl.utils import tensordict_utils as tu

    from megatron_branch.integration.verl_moe import r3_routes

    batch = grpo_batch(seed=0)
    assert r3_routes("R3", None, [batch]) is None  # no router replay asked: nothing read
    tu.assign_non_tensor(batch, enable_routing_replay=True)
    assert r3_routes("disabled", None, [batch]) is None  # verl replays nothing then either
    tu.assign_non_tensor(batch, record_r2_routes=True)  # R2's recording pass routes natively
    assert r3_routes("R2", None, [batch]) is None


def test_kl_and_loss_modes_reach_the_gradient(single_process: str) -> None:
    """seq-mean-token-mean aggregation, clip-higher, k1 KL: verl's ppo_loss is a black box to the tree step."""
    actor = actor_config(loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.28, kl_loss_type="kl")
    set_switch(False)
    base = run_step(make_worker(single_process), lambda: grpo_batch(seed=2), actor=actor)
    set_switch(True)
    tree = run_step(make_worker(single_process), lambda: grpo_batch(seed=2), actor=actor)
    set_switch(False)
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"{name}: {err:.2e}"
    assert VOCAB == 64


def test_reference_engine_forward_only(single_process: str) -> None:
    """The reference policy's engine (forward_only: no DDP, no optimizer) with the switch: verl's ref logprobs."""
    set_switch(False)
    want = infer(make_worker(single_process, forward_only=True), grpo_batch(seed=3))
    set_switch(True)
    worker = make_worker(single_process, forward_only=True)
    set_switch(False)
    assert type(worker.engine).__name__.startswith("BranchReplay")
    got = infer(worker, grpo_batch(seed=3))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_patched_model_keeps_verls_own_path(single_process: str) -> None:
    """The model patch alone (wrapped core attention, position RoPE) leaves verl's own forward bit-identical and
    the parameter names unchanged (checkpoints, weight export)."""
    from megatron_branch.integration.verl_model import BranchFallbackAttention, patch_verl_model

    set_switch(False)
    worker = make_worker(single_process, forward_only=True)
    names = [n for n, _ in worker.engine.module[0].named_parameters()]
    before = infer(worker, grpo_batch(seed=4))
    patch_verl_model(worker.engine.module[0])
    assert any(isinstance(m, BranchFallbackAttention) for m in worker.engine.module[0].modules())
    assert [n for n, _ in worker.engine.module[0].named_parameters()] == names
    after = infer(worker, grpo_batch(seed=4))
    for a, b in zip(after, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_multi_turn_response_mask_matches_verl(single_process: str, mode: str) -> None:
    """verl's multi-turn batches (response_mask 0 on tool tokens inside responses, one response all tool output):
    the switch equals verl without it (old logprobs, every gradient, fp32 1e-5). The tree step linearises verl's own
    loss, so the mask reaches the gradient through verl's ppo_loss; planted: the tree step on the same batch with
    the mask dropped (tool tokens trained) is caught."""
    actor = actor_config(loss_agg_mode=mode, kl_loss_type="low_var_kl")

    def td() -> object:
        return grpo_batch(seed=5, multi_turn=True)

    masked = td()["response_mask"]  # type: ignore[index]
    assert (masked == 0).any() and (masked.sum(-1) == 0).any()
    set_switch(False)
    base = run_step(make_worker(single_process), td, actor=actor)
    set_switch(True)
    tree = run_step(make_worker(single_process), td, actor=actor)
    ignored = run_step(make_worker(single_process), lambda: grpo_batch(seed=5), actor=actor)
    set_switch(False)
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"{name}: {err:.2e}"
    assert max_rel_grad_error(base.grads, ignored.grads)[0] > 1e-3
    for key in ("actor/pg_loss", "actor/pg_clipfrac"):
        if key in base.metrics:
            got, want = float(tree.metrics[key][0]), float(base.metrics[key][0])
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (key, got, want)
