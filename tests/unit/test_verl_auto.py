"""`BranchOptions(schedule="auto")`, the verl integration's default (integration/verl_auto.py): each call runs packed
when its planned activation peak fits the budget and its tree is at most one of replay's chunks, replay otherwise; the
run equals the picked schedule's bitwise, the pick flips with the budget and with the chunk budget, and verl's
metrics carry it. Driven through verl's TrainingWorker on CPU, as
test_verl_engine.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import grpo_batch, make_worker, one_rank_world, run_step, set_switch  # noqa: E402

pytestmark = pytest.mark.slow

single_process = pytest.fixture(scope="module", name="single_process")(one_rank_world)


def _step(hf: str, **options: object) -> object:
    from megatron_branch.integration.verl import BranchOptions
    from megatron_branch.integration.verl_cpu import register_cpu_engine, use_cpu_platform

    use_cpu_platform()
    register_cpu_engine()  # before the switch (make_worker's first call would register verl's CPU engine over it)
    set_switch(True)
    try:
        worker = make_worker(hf)
        worker.engine.branch_options = BranchOptions(**options)
        return run_step(worker, lambda: grpo_batch(seed=3))
    finally:
        set_switch(False)


@pytest.fixture(scope="module")
def default(single_process: str) -> object:
    """The switch's default options (auto, the device's free memory as the budget)."""
    return _step(single_process)


# replay's chunks off: with them (the default) the tiny tree is ONE packed chunk, bitwise packed's, and the comparison
# below could not tell which schedule auto ran
WALK = {"chunk_tokens": None}


@pytest.fixture(scope="module")
def fixed(single_process: str) -> dict[str, object]:
    """One compute_log_prob + update step with each schedule named."""
    return {s: _step(single_process, schedule=s, schedule_options=WALK) for s in ("packed", "replay")}


def test_default_budget_is_the_free_memory(default: object) -> None:
    """Without a budget: the host's available memory (a CPU run), in which a tiny model's packed chunk fits."""
    from megatron_branch.plan.auto import free_device_bytes

    m = default.metrics
    assert m["tree/auto_packed"][0] == 1.0
    assert 0.1 * free_device_bytes() / 1e9 < m["tree/auto_budget_gb"][0] < 10 * free_device_bytes() / 1e9


@pytest.mark.parametrize(("budget_gb", "picked"), [(1000.0, "packed"), (1e-6, "replay")])
def test_auto_equals_the_picked_schedule_bitwise(
    single_process: str, fixed: dict, budget_gb: float, picked: str
) -> None:
    """A budget packed fits picks packed, one it does not picks replay; every gradient, logprob and entropy is the
    picked schedule's bit for bit; the metrics say which and why (packed's planned GB against the budget)."""
    got = _step(single_process, schedule="auto", memory_budget_gb=budget_gb, schedule_options=WALK)
    want = fixed[picked]
    assert got.grads.keys() == want.grads.keys() and got.grads
    for name, g in want.grads.items():
        assert torch.equal(got.grads[name], g), name
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)
    m = got.metrics
    assert m["tree/auto_packed"][0] == float(picked == "packed")
    assert m["tree/auto_budget_gb"][0] == pytest.approx(budget_gb)
    assert 0 < m["tree/auto_packed_gb"][0] < 1.0  # a tiny model's few rows
    assert "tree/positions_computed" in want.metrics  # the tree ran (not verl's own path)
    assert "tree/auto_packed" not in want.metrics  # only auto reports a pick


def test_a_tree_over_one_chunk_picks_replay_bitwise(single_process: str, fixed: dict) -> None:
    """Packed fits, but this call's tree spans more than one chunk of 16 tokens: auto runs replay with those chunks,
    bit for bit, and packed's gradient differs from it (the comparison tells which ran)."""
    chunks = {"chunk_tokens": 16}
    got = _step(single_process, schedule="auto", memory_budget_gb=1000.0, schedule_options=chunks)
    want = _step(single_process, schedule="replay", schedule_options=chunks)
    assert got.metrics["tree/auto_packed"][0] == 0.0 and got.metrics["tree/auto_tokens"][0] > 16
    assert got.grads.keys() == want.grads.keys() and got.grads
    for name, g in want.grads.items():
        assert torch.equal(got.grads[name], g), name
    assert torch.equal(got.log_probs, want.log_probs) and torch.equal(got.entropy, want.entropy)
    assert any(not torch.equal(fixed["packed"].grads[k], g) for k, g in want.grads.items())


def test_the_schedules_differ_where_auto_must_choose(fixed: dict) -> None:
    """The planted check: replay and packed are not bitwise equal here (different chunks, different summation
    order), so the bitwise comparison above tells which one auto ran."""
    a, b = fixed["packed"].grads, fixed["replay"].grads
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_default_is_auto_and_replay_only_options_pick_replay() -> None:
    """auto is BranchOptions' default; options packed refuses (segment recompute, root_pieces) make it replay
    whatever the budget, with the rules' line as the reason; chunk_tokens (on by default, set or off) is no refusal
    (it weighs in the rule through the tree's tokens, above)."""
    from megatron_branch.integration import verl_auto
    from megatron_branch.integration.verl import BranchOptions
    from megatron_branch.schedule.options import ScheduleOptions

    assert BranchOptions().schedule == "auto"
    for chunks in (64, None):
        assert verl_auto.packed_problem(ScheduleOptions(vocab_size=8, chunk_tokens=chunks)) is None
    for extra in ({"recompute": True}, {"root_pieces": 2}):
        problem = verl_auto.packed_problem(ScheduleOptions(vocab_size=8, **extra))
        assert problem is not None and next(iter(extra)) in problem, problem
    with pytest.raises(ValueError, match="memory_budget_gb"):
        BranchOptions(memory_budget_gb=0)
