"""verl's MegatronEngine with and without the branch-replay switch under pipeline parallelism (PP2, gloo, CPU),
through verl's TrainingWorker with dynamic batch size and a sampling temperature. Without the switch verl runs
megatron's own pipeline schedule (forward_backward_pipelining_without_interleaving, variable sequence lengths,
megatron's p2p); with it the step's micro-batches form one prefix tree run by megatron-branch's pipelined
schedule across the two stages (schedule/pipeline.py).

Compared: compute_log_prob's logprobs and entropies where verl collects them (the last stage, tp rank 0; None on
the first stage for both), every parameter's main_grad on EACH stage (fp32 1e-5 relative), verl's metrics. Runs:
the default (auto), replay and packed in one pass on a 2-layer untied policy; replay cut into root pieces with the
two-pass update on a 4-layer policy with tied embeddings. Planted: the first stage's prefix K/V gradients from
its branches dropped fails. VPP is refused in one line.

    python tests/distributed/launch.py 2 -k verl_engine_pp

Skipped (on every rank alike) without the verl extra.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    actor_config,
    dp_share,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    max_rel_step_error,
    run_step,
    set_switch,
    shared_policy_dir,
)

METRICS = ("actor/pg_loss", "actor/entropy_loss", "actor/ppo_kl", "kl_loss", "loss", "grad_norm")


def _batch() -> Any:
    """2 prompt groups per DP replica, each replica's share as verl's dispatch hands it (read once the engine has
    built megatron's groups)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    return dp_share(grpo_batch(seed=13, groups=2 * dp, temperature=0.7), ps.get_data_parallel_rank(), dp)


def _step(hf: str, switch: bool, options: Any = None, *, tp: int = 1, optimizer: str = "adam") -> Any:
    set_switch(switch, options)
    try:
        worker = make_worker(hf, pp=2, tp=tp, dynamic_bsz=True, optimizer=optimizer)
        return run_step(worker, _batch, actor=actor_config(use_dynamic_bsz=True))
    finally:
        set_switch(False)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list | tuple) else value


def _worst_over_stages(err: float) -> torch.Tensor:
    """[stages] every stage's worst relative gradient error, on every stage."""
    every = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    every[dist.get_rank()] = err
    dist.all_reduce(every)
    return every


def _check(base: Any, tree: Any, what: str, passes: int) -> None:
    from megatron.core import parallel_state as ps

    # verl's is_mp_src_rank_with_outputs: the last stage's tp rank 0 (of each DP replica)
    collects = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
    assert (base.log_probs is None) == (tree.log_probs is None) == (not collects)
    assert base.steps == ps.get_data_parallel_world_size()  # one mini-batch per DP rank (as_update)
    err, name = max_rel_step_error(base, tree)  # the first and the last optimizer step's
    assert err <= 1e-5, f"{what}: stage {dist.get_rank()} {name}: {err:.2e}"
    if not collects:
        return
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree.entropy, base.entropy, rtol=1e-5, atol=1e-5)
    for key in METRICS:
        got, want = float(_first(tree.metrics[key])), float(_first(base.metrics[key]))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), f"{what}: {key}"
    assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
    assert float(_first(tree.metrics["tree/update_passes"])) == passes, what


@pytest.mark.world(2)
def test_verl_engine_pp2(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_branch.integration.verl import BranchOptions, VerlBranchError
    from megatron_branch.schedule.prefix_cache import PrefixCache

    os.environ.setdefault("MASTER_PORT", "0")  # verl's Worker reads it; the process group already exists
    hf = shared_policy_dir()
    base = _step(hf, switch=False)
    tree = _step(hf, switch=True)
    _check(base, tree, "the default (auto), one pass", passes=1)
    _check(base, _step(hf, switch=True, options=BranchOptions(schedule="replay")), "replay", passes=1)
    _check(base, _step(hf, switch=True, options=BranchOptions(schedule="packed")), "packed", passes=1)
    # a tied embedding (its copy on the last stage summed by megatron's embedding group) and two layers per stage
    tied = shared_policy_dir(num_layers=4, tie=True)
    # chunks off here and in the planted case: the tiny batch would otherwise be one chunk (no pieces, no cache)
    walk = {"chunk_tokens": None}
    pieces = BranchOptions(
        one_pass=False, schedule_options={"root_pieces": 2, "branch_micro_batch": 2, **walk}
    )
    what = "tied, 4 layers, replay, root pieces 2, two passes"
    _check(_step(tied, switch=False), _step(tied, switch=True, options=pieces), what, passes=2)

    # planted: the first stage's cached prefix K/V get none of their branches' gradients
    real = PrefixCache.injection

    def dropped(self: Any, seg_id: int, captured: Any) -> Any:
        return ([], []) if dist.get_rank() == 0 else real(self, seg_id, captured)

    monkeypatch.setattr(PrefixCache, "injection", dropped)
    planted = _step(hf, switch=True, options=BranchOptions(schedule="replay", schedule_options=walk))
    monkeypatch.undo()
    every = _worst_over_stages(max_rel_grad_error(base.grads, planted.grads)[0])
    assert every[0] > 1e-2 and every[1] <= 1e-5, every  # the first stage's gradients wrong, the last's right

    set_switch(True)
    try:
        with pytest.raises(VerlBranchError, match="virtual_pipeline_model_parallel_size=2: interleaved"):
            make_worker(hf, pp=2, vpp=2, dynamic_bsz=True)
    finally:
        set_switch(False)
