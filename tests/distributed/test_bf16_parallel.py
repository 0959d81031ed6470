"""bf16 under data parallelism: the fp32 main parameters after optimizer steps at DP2 against DP1 (a world of one).

    python tests/distributed/launch.py 2 -k bf16

megatron reduces the fp32 main gradients over DP by summing the ranks' buffers; DP1 with the same two micro-batches
adds the second micro-batch's bf16 gradients into the first's fp32 buffer. Where a rank's share reaches a parameter
through ONE backward (packed: one chunk per micro-batch), both are the same single fp32 addition, so the fp32 main
parameters after the steps are BITWISE DP1's: with the plain optimizer (clipping active: its norm is taken over the
same whole gradients), and with the distributed optimizer with clipping off (its norm is a sum of shard norms,
another order; each shard's Adam step is DP1's). Where a share has several backward calls (replay: a segment, its
children, its injection), DP2 sums each rank's terms first and megatron's reduction order differs: the main
parameters then agree to fp32 rounding (REPLAY_BOUND), far inside the bf16 bound (tests/unit/test_bf16.py). The
CPU offload's host AdamW is torch's fused CPU kernel where device shards step with the for-loop one, and DP2
offloads other shards than DP1: OFFLOAD_BOUND.

Resume at another layout, in bf16: the DP2 checkpoint of the offload run (the 32B target's optimizer: distributed,
half offloaded) loads into DP1 and, saved again there, holds bitwise the same tensors: the bf16 weights, the fp32
main parameters and both moments (megatron's fully_reshardable format).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import plain_tensors, shared_tmp, single_process_env

from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

REPLAY_BOUND = 1e-6
"""Relative error of replay's fp32 main parameters, DP2 vs DP1, after 2 steps (fp32 summation order)."""
OFFLOAD_BOUND = 1e-6
"""The same for the offload (fused vs for-loop AdamW on differently offloaded shards)."""

RUNS = {  # name -> (schedule, optimizer settings)
    "packed-plain": ("packed", {"clip_grad": 0.05}),
    "packed-distributed": ("packed", {"clip_grad": 0.0, "use_distributed_optimizer": True}),
    "replay-plain": ("replay", {"clip_grad": 0.05}),
    "packed-offload": ("packed", {"clip_grad": 0.0, "use_distributed_optimizer": True,
                                  "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True,
                                  "optimizer_offload_fraction": 0.5}),
}  # fmt: skip


def _rollouts():  # noqa: ANN202
    from megatron_branch.bench.precision import tree_batch

    return tree_batch(7, groups=2, branches=3)  # two prompt groups of equal size: one per DP rank


def trainee(name: str):  # noqa: ANN201
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.bench import precision as bp
    from megatron_branch.train.policy import Trainee
    from megatron_branch.update import OptimizerSettings

    settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, **RUNS[name][1])  # type: ignore[arg-type]
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    model = bp.model_with(bp.bf16_weights(7), torch.bfloat16)
    return Trainee(model, dtype=torch.bfloat16, settings=settings, pgc=pgc), pgc


def run(name: str, groups, save: Path | None = None):  # noqa: ANN001, ANN201
    """Two optimizer steps of run `name` on the current layout (DP1: two micro-batches, one group each), saved as
    a dist checkpoint under `save` if given. Returns (this rank's fp32 main parameters: name -> (offset in the flat
    parameter, values), bf16 parameters)."""
    from megatron_branch.bench import precision as bp
    from megatron_branch.checkpoint.store import CheckpointStore
    from megatron_branch.losses import build_objective
    from megatron_branch.schedule import ScheduleOptions
    from megatron_branch.update import UpdatePlan, update_step

    schedule = RUNS[name][0]
    tr, pgc = trainee(name)
    rollouts = _rollouts()
    objective = build_objective(bp.objective_config(), rollouts)
    opts = ScheduleOptions(groups=groups, vocab_size=bp.VOCAB, branch_micro_batch=2, chunk_tokens=None)
    plan = UpdatePlan(opts=opts, schedule=schedule, micro_batches=2 // groups.dp_size, pg_collection=pgc)
    for _ in range(2):
        assert update_step(
            tr.ddp, rollouts, objective, plan, optimizer=tr.optimizer, scheduler=tr.scheduler
        ).stepped
    params = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    if save is not None:
        CheckpointStore(save).save(2, {"policy": tr.sharded_state("", loading=False)}, common={})
    return main_shards(tr), params


def reload_and_resave(name: str, src: Path, dst: Path) -> None:
    """A fresh trainee of run `name` on the current layout loads checkpoint `src` and saves it again under `dst`."""
    from megatron_branch.checkpoint.store import CheckpointStore

    tr, _ = trainee(name)
    state, _ = CheckpointStore(src.parent).load(src, {"policy": tr.sharded_state("", loading=True)})
    tr.load(state["policy"], "")
    CheckpointStore(dst).save(2, {"policy": tr.sharded_state("", loading=False)}, common={})


def main_shards(trainee) -> dict[str, tuple[int, torch.Tensor]]:  # noqa: ANN001
    """name -> (offset, this rank's fp32 main values of the flat parameter from there)."""
    from megatron_branch.update.optimizer import inner_optimizers

    (inner,) = inner_optimizers(trainee.optimizer)
    to_inner = getattr(inner.optimizer, "param_to_inner_param", {})
    shards = [q for g in inner.optimizer.param_groups for q in g["params"]]
    out = {}
    for n, p in trainee.model.named_parameters():
        if hasattr(inner, "model_param_gbuf_map"):  # the distributed optimizer: this rank's range, if any
            ranges = inner._get_model_param_range_map(p) if p in inner.model_param_gbuf_map else None
            if ranges is None or ranges["param"].size == 0:
                continue
            start, size = ranges["param"].start, ranges["param"].size
        else:
            start, size = 0, p.numel()
        main = getattr(p, "main_param", None)
        if main is None:  # precision-aware (the offload): the hybrid optimizer's fp32 copy of the shard
            ptr = p.data_ptr() + start * p.element_size()
            shard = next(s for s in shards if s.data_ptr() == ptr and s.numel() == size)
            main = to_inner.get(shard, shard)
        assert main.dtype == torch.float32, (n, main.dtype)
        out[n] = (start, main.detach().reshape(-1).clone())
    return out


_DP1 = """
import sys, torch
sys.path.insert(0, "tests/distributed")
import test_bf16_parallel as t
from megatron_branch.parallel.groups import ParallelConfig, destroy_parallel, initialize_parallel
torch.set_num_threads(1)
from pathlib import Path
tmp = Path(sys.argv[1])
out = {"world": None}
for name in t.RUNS:
    groups = initialize_parallel(ParallelConfig())
    out["world"] = torch.distributed.get_world_size()
    out[name] = t.run(name, groups)
    destroy_parallel()
initialize_parallel(ParallelConfig())
t.reload_and_resave("packed-offload", tmp / "dp2" / "step_00000002", tmp / "resaved")
torch.save(out, tmp / "dp1.pt")
"""


def _dp1(tmp: Path) -> dict:
    rc = [None]
    if dist.get_rank() == 0:
        rc = [
            subprocess.call(
                [sys.executable, "-c", _DP1, str(tmp)], env=single_process_env(OMP_NUM_THREADS="1")
            )
        ]
    dist.broadcast_object_list(rc, src=0)
    assert rc == [0], "the DP1 run ran into an error"
    return torch.load(tmp / "dp1.pt", weights_only=True)


@pytest.mark.world(2)
def test_bf16_main_parameters_dp2_equal_dp1() -> None:
    tmp = shared_tmp("bf16-dp-")
    try:
        dp2 = {}
        for name in RUNS:  # DP2 first: the DP1 process reloads the offload run's checkpoint
            groups = initialize_parallel(ParallelConfig())
            assert groups.dp_size == 2
            dp2[name] = run(name, groups, save=tmp / "dp2" if name == "packed-offload" else None)
        one = _dp1(tmp)
        assert one["world"] == 1
        saved = plain_tensors(tmp / "dp2" / "step_00000002")
        resaved = plain_tensors(tmp / "resaved" / "step_00000002")
        assert sorted(saved) == sorted(resaved) and any(".exp_avg_sq." in k for k in saved)
        assert {v.dtype for k, v in saved.items() if k.startswith("optimizer.")} == {torch.float32}
        assert all(torch.equal(saved[k], resaved[k]) for k in saved)  # DP2 -> DP1 and back: bitwise
        for name in RUNS:
            mains, params = dp2[name]
            ref_mains, ref_params = one[name]
            worst = 0.0
            for n, (start, got) in mains.items():
                want = ref_mains[n][1][start : start + got.numel()]
                worst = max(worst, float((got.double() - want).norm() / want.double().norm()))
            seen = torch.tensor([sum(v.numel() for _, v in mains.values())])
            dist.all_reduce(seen)
            sharded = (
                "use_distributed_optimizer" in RUNS[name][1]
            )  # shards add up to the model; else replicas
            assert int(seen) == sum(v.numel() for _, v in ref_mains.values()) * (1 if sharded else 2)
            if dist.get_rank() == 0:
                print(f"\n[{name}] DP2 vs DP1 fp32 main parameters: worst relative error {worst:.2e}")
            if name.startswith("packed") and name != "packed-offload":
                assert worst == 0.0, name  # bitwise
                assert all(torch.equal(params[n], ref_params[n]) for n in params), name
            else:
                assert worst <= (REPLAY_BOUND if name == "replay-plain" else OFFLOAD_BOUND), (name, worst)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
