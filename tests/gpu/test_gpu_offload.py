"""megatron's CPU-offload optimizer on a GPU: the offloaded state and master copies are host tensors, the rest stays
on the device, and three updates equal the distributed optimizer without offload (bf16 weights, fp32 master).
Skipped without CUDA (the CPU half, where the CPU plays both sides, is tests/unit/test_offload.py).

Not run by this project so far (no GPU was lent when it was written).
"""

from __future__ import annotations

import pytest
import torch


def _trainee(**kw: object):  # noqa: ANN202
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.testing import tiny_branch_model
    from megatron_branch.train.policy import Trainee
    from megatron_branch.update import OptimizerSettings

    model = tiny_branch_model(torch.bfloat16, seed=0).cuda()
    settings = OptimizerSettings(
        lr=1e-3, weight_decay=0.1, clip_grad=1.0, use_distributed_optimizer=True, **kw
    )  # type: ignore[arg-type]
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    return Trainee(model, dtype=torch.bfloat16, settings=settings, pgc=pgc), pgc


@pytest.mark.gpu
@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_offload_keeps_the_state_on_the_host_and_equals_the_device_optimizer(fraction: float) -> None:
    from megatron_branch.losses import Aggregation, PolicyObjective
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions
    from megatron_branch.testing import random_tree_rollouts
    from megatron_branch.update import UpdatePlan, update_step
    from megatron_branch.update.optimizer import inner_optimizers

    groups = initialize_parallel(ParallelConfig())
    rollouts = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 3), seed=7)
    obj = PolicyObjective(agg=Aggregation.of_batch(rollouts))
    out = {}
    for name, kw in (
        ("device", {}),
        (
            "offload",
            {
                "use_precision_aware_optimizer": True,
                "optimizer_cpu_offload": True,
                "optimizer_offload_fraction": fraction,
            },
        ),
    ):
        tr, pgc = _trainee(**kw)
        plan = UpdatePlan(
            opts=ScheduleOptions(groups=groups, vocab_size=37, chunk_tokens=None),
            schedule="replay",
            pg_collection=pgc,
        )
        for _ in range(3):
            update_step(tr.ddp, rollouts, obj, plan, optimizer=tr.optimizer, scheduler=tr.scheduler)
        out[name] = {n: p.detach().float().cpu() for n, p in tr.model.named_parameters()}
        if name == "offload":
            hdo = inner_optimizers(tr.optimizer)[0].optimizer
            host = hdo.gpu_params_map_cpu_copy
            assert host and all(p.is_cuda and c.device.type == "cpu" for p, c in host.items())
            assert all(hdo.state[p]["exp_avg"].device.type == "cpu" for p in host)
            kept = [p for g in hdo.param_groups for p in g["params"] if p not in host]
            assert (len(kept) == 0) == (fraction == 1.0)
            assert all(hdo.state[p]["exp_avg"].is_cuda for p in kept)
    for n, want in out["device"].items():  # bf16 weights: equal up to a bf16 rounding of the same fp32 master
        torch.testing.assert_close(out["offload"][n], want, rtol=1e-2, atol=1e-3)
