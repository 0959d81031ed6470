"""megatron's distributed optimizer and its CPU offload under torchrun (gloo), against the plain optimizer.

    python tests/distributed/launch.py 2 -k distrib_optimizer     # DP2, CP2; checkpoints DP2 -> DP1, CP2 -> TP2
    python tests/distributed/launch.py 4 -k distrib_optimizer     # DP2 x CP2

- Three updates (replay, two micro-batches per rank, clipping and weight decay active) with megatron's
  DistributedOptimizer, and with its HybridDeviceOptimizer keeping half of the state on the host, give the
  parameters the plain (non-distributed) optimizer gives in the same layout: float64 1e-12, float32 at the bound
  the reduce-scatter's summation order leaves (FP32_BOUND, per parameter, relative to the update). The state is
  really sharded over DP x CP: each rank holds its 1/(dp*cp) share, the shares add up to the model.
- Its dist checkpoint (model + megatron's sharded optimizer state, `fully_sharded_model_space`) saved at DP2
  loads into DP1 (a world of one) and saved at CP2 loads into TP2: re-saved there, every tensor of the
  checkpoint is bitwise the same; one more update equals the update of the run that never stopped.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import plain_tensors, shared_tmp, single_process_env
from optimizer_helpers import VARIANTS

from megatron_branch.data import Rollout
from megatron_branch.losses import Aggregation, PolicyObjective
from megatron_branch.parallel.groups import ParallelConfig, ParallelGroups, initialize_parallel
from megatron_branch.schedule import ScheduleOptions
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model

VOCAB = 37
FP32_BOUND = 1e-4
"""float32 bound on the worst per-parameter relative error of the UPDATE (the change of 3 steps). The distributed
optimizer reduce-scatters the gradients where the plain one all-reduces them and computes the clipping norm from
shards, and the offload's host AdamW is torch's fused CPU kernel where the plain one runs torch's for-loop; each
sums in another order, and Adam's normalisation carries those last-bit differences into the update of entries
with tiny gradients. Measured (this test, -s): distributed 2.1e-7 (DP2), 1.1e-6 (CP2), 2.2e-5 (DP2 x CP2); offload
2.0e-5, 2.2e-5, 9.4e-7; the parameters themselves agree to 5e-8 relative. float64: 4e-14 at worst."""

LAYOUTS = [
    pytest.param("dp2", ParallelConfig(), marks=pytest.mark.world(2), id="dp2"),
    pytest.param("cp2", ParallelConfig(cp=2), marks=pytest.mark.world(2), id="cp2"),
    pytest.param("dp2cp2", ParallelConfig(cp=2), marks=pytest.mark.world(4), id="dp2cp2"),
]


def _rollouts() -> list[Rollout]:
    rng = random.Random(41)
    rs = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=2, seg_len=(2, 4), seed=42)
    return [
        dataclasses.replace(
            r,
            token_fields={
                "old_logprobs": tuple(rng.uniform(-4.5, -2.5) for _ in r.response),
                "advantages": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )
        for r in rs
    ]


def _settings(**kw: object):  # noqa: ANN202
    from megatron_branch.update import OptimizerSettings

    return OptimizerSettings(lr=1e-3, weight_decay=0.1, clip_grad=0.05, **kw)  # type: ignore[arg-type]


def _trainee(groups: ParallelGroups, dtype: torch.dtype, settings: object, *, seed: int = 3):  # noqa: ANN202
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.train.policy import Trainee

    model = tiny_branch_model(dtype, seed=seed, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    return Trainee(model, dtype=dtype, settings=settings, pgc=pgc), pgc


def _steps(trainee, pgc, groups: ParallelGroups, n: int) -> list[dict]:  # noqa: ANN001
    from megatron_branch.update import UpdatePlan, update_step

    rollouts = _rollouts()
    obj = PolicyObjective(agg=Aggregation.of_batch(rollouts), clip_c=3.0)
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, branch_micro_batch=2, chunk_tokens=None),
        schedule="replay",
        micro_batches=2,
        pg_collection=pgc,
    )
    out = []
    for _ in range(n):
        res = update_step(
            trainee.ddp, rollouts, obj, plan, optimizer=trainee.optimizer, scheduler=trainee.scheduler
        )
        assert res.stepped
        out.append(res.metrics)
    return out


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _update_error(got: dict, want: dict, start: dict) -> float:
    """Worst per-parameter relative error of the update (the change from `start`)."""
    worst = 0.0
    for n, w in want.items():
        d = (w - start[n]).double()
        if d.norm() == 0:  # never touched (no gradient, no decay): must stay bitwise
            assert torch.equal(got[n], w), n
            continue
        worst = max(worst, float((got[n] - w).double().norm() / d.norm()))
    return worst


def _shard_sizes(optimizer, group) -> tuple[int, int]:  # noqa: ANN001
    """(elements of optimizer state on this rank, summed over `group`)."""
    from megatron_branch.update.optimizer import inner_optimizers

    (inner,) = inner_optimizers(optimizer)
    local = sum(p.numel() for g in inner.optimizer.param_groups for p in g["params"])
    total = torch.tensor([local], dtype=torch.int64)
    dist.all_reduce(total, group=group)
    return local, int(total)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout,pcfg", LAYOUTS)
def test_distributed_and_offload_optimizers_equal_the_plain_one(
    layout: str, pcfg, dtype: torch.dtype
) -> None:  # noqa: ANN001
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_branch.update.optimizer import inner_optimizers

    groups = initialize_parallel(pcfg)
    assert (groups.dp_size, groups.cp_size) == {"dp2": (2, 1), "cp2": (1, 2), "dp2cp2": (2, 2)}[layout]
    shard = groups.dp_size * groups.cp_size
    out, metrics = {}, {}
    for name, kw in VARIANTS.items():
        trainee, pgc = _trainee(groups, dtype, _settings(**kw))
        start = _params(trainee.model)
        metrics[name] = _steps(trainee, pgc, groups, 3)
        out[name] = _params(trainee.model)
        (inner,) = inner_optimizers(trainee.optimizer)
        numel = sum(p.numel() for p in trainee.model.parameters())
        if name == "plain":
            assert not isinstance(inner, DistributedOptimizer)
            continue
        assert isinstance(inner, DistributedOptimizer)
        local, total = _shard_sizes(trainee.optimizer, groups.dp_cp)
        # 1/(dp*cp) each (megatron pads each bucket to a multiple of dp*cp x 128 elements, so a share may be a bit more)
        assert total == numel and local <= numel // shard + 128, (local, total, numel)
        if name == "offload":
            hdo = inner.optimizer
            assert isinstance(hdo, HybridDeviceOptimizer)
            host = hdo.gpu_params_map_cpu_copy  # device shard -> its host copy (what megatron offloaded)
            offloaded = sum(p.numel() for p in host)
            both = torch.tensor([offloaded, local], dtype=torch.int64)
            dist.all_reduce(both, group=groups.dp_cp)
            assert 0.5 * local <= offloaded <= local, (offloaded, local)  # megatron offloads whole shards
            assert 0 < both[0] < both[1], both  # some state on the host, some on the device
            assert all(c.data_ptr() != p.data_ptr() for p, c in host.items())  # real copies, stepped apart
            assert all({"exp_avg", "exp_avg_sq"} <= set(hdo.state[p]) for p in host)
    assert metrics["plain"][0]["actor/grad_norm"] > 0.05  # clipping was active
    for name in ("distributed", "offload"):
        for a, b in zip(metrics[name], metrics["plain"]):
            assert a["actor/grad_norm"] == pytest.approx(
                b["actor/grad_norm"], rel=1e-12 if dtype == torch.float64 else 1e-5
            )
        err = _update_error(out[name], out["plain"], start)
        perr = max(
            float((out[name][n] - w).double().norm() / w.double().norm()) for n, w in out["plain"].items()
        )
        bound = 1e-12 if dtype == torch.float64 else FP32_BOUND
        if dist.get_rank() == 0:
            print(
                f"\n[{layout} {str(dtype)[6:]}] {name} vs plain: worst relative error of the update {err:.2e}, "
                f"of the parameters {perr:.2e}"
            )
        assert err <= bound, f"{name}: {err:.2e} > {bound:.0e}"


# ---- checkpoints: save in one layout, load into another -------------------------------------------------------
def _save(store, step: int, trainee) -> Path:  # noqa: ANN001
    return store.save(step, {"policy": trainee.sharded_state("", loading=False)}, common={})


def _load(store, path: Path, trainee) -> None:  # noqa: ANN001
    state, _ = store.load(path, {"policy": trainee.sharded_state("", loading=True)})
    trainee.load(state["policy"], "")


def _unpadded(got: dict, like: dict) -> dict:
    """`got` with vocabulary tensors cut to `like`'s rows: TP2 pads the 37-token vocabulary to 38 rows, a row that
    is in no checkpoint (megatron loads vocabulary tensors with allow_shape_mismatch) and never gets a gradient."""
    return {
        k: v[: like[k].shape[0]] if k in like and v.shape[0] > like[k].shape[0] else v for k, v in got.items()
    }


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in a)  # the optimizer's state is in it
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _full_params(trainee, groups: ParallelGroups) -> dict[str, torch.Tensor]:  # noqa: ANN001
    from megatron_branch.checkpoint.tp import gather_full_state

    full = gather_full_state(trainee.model, groups.tp)
    return {k: v.clone() for k, v in full.items() if not k.endswith("_extra_state")}


_DP1 = """
import json, sys, torch
from pathlib import Path
sys.path[:0] = ["tests/distributed", "tests"]
import test_distrib_optimizer as t
from megatron_branch.checkpoint.store import CheckpointStore
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
groups = initialize_parallel(ParallelConfig())
trainee, pgc = t._trainee(groups, torch.float64, t._settings(use_distributed_optimizer=True), seed=99)
src, out = Path(sys.argv[1]), Path(sys.argv[2])
t._load(CheckpointStore(src.parent), src, trainee)
t._save(CheckpointStore(out / "resaved"), 2, trainee)
t._steps(trainee, pgc, groups, 1)
torch.save({"world": torch.distributed.get_world_size(), "params": t._full_params(trainee, groups)}, out / "dp1.pt")
"""


@pytest.mark.world(2)
def test_distributed_optimizer_checkpoints_reload_into_other_layouts() -> None:
    from megatron_branch.checkpoint.store import CheckpointStore

    tmp = shared_tmp("distopt-")
    settings = _settings(use_distributed_optimizer=True)
    try:
        for src_cfg, dst_cfg, name in (
            (ParallelConfig(), None, "dp2_to_dp1"),
            (ParallelConfig(cp=2), ParallelConfig(tp=2, sequence_parallel=True), "cp2_to_tp2"),
        ):
            groups = initialize_parallel(src_cfg)
            trainee, pgc = _trainee(groups, torch.float64, settings)
            _steps(trainee, pgc, groups, 2)
            path = _save(CheckpointStore(tmp / name / "src"), 2, trainee)
            saved = plain_tensors(path)
            before = _full_params(trainee, groups)
            _steps(trainee, pgc, groups, 1)  # the run that never stopped
            want = _full_params(trainee, groups)
            if dst_cfg is None:  # DP1: a world of one, in a fresh process
                rc = [None]
                if dist.get_rank() == 0:
                    rc = [
                        subprocess.call(
                            [sys.executable, "-c", _DP1, str(path), str(tmp / name)], env=single_process_env()
                        )
                    ]
                dist.broadcast_object_list(rc, src=0)
                assert rc == [0], "the DP1 load ran into an error"
                resaved = plain_tensors(tmp / name / "resaved" / "step_00000002")
                dp1 = torch.load(tmp / name / "dp1.pt", weights_only=True)
                assert dp1["world"] == 1
                got = dp1["params"]
            else:
                groups = initialize_parallel(dst_cfg)
                other, pgc = _trainee(groups, torch.float64, settings, seed=99)  # other weights until loaded
                _load(CheckpointStore(path.parent), path, other)
                loaded = _unpadded(_full_params(other, groups), before)
                assert all(torch.equal(loaded[k], before[k]) for k in before)
                resaved = plain_tensors(_save(CheckpointStore(tmp / name / "resaved"), 2, other))
                _steps(other, pgc, groups, 1)
                got = _unpadded(_full_params(other, groups), want)
            _assert_same_tensors(
                _unpadded(resaved, saved), saved
            )  # model, master copy, exp_avg, exp_avg_sq: bitwise
            err = _update_error(got, want, before)
            if dist.get_rank() == 0:
                print(f"\n[{name}] step after reload vs uninterrupted: worst relative update error {err:.2e}")
            assert err <= 1e-12, f"{name}: {err:.2e}"
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
