"""megatron's distributed optimizer and CPU-offload optimizer in one process on CPU: the shims, the offload's
exactness, the megatron bug it works around, and its checkpoints. (Under DP / CP: tests/distributed/
test_distrib_optimizer.py.)

- Offload (HybridDeviceOptimizer, fraction 0.5 and 1.0) == the plain optimizer after 3 updates: float64 1e-12,
  float32 1e-4 on the update (torch's fused CPU AdamW on the host part; the parameters agree to ~1e-7).
- Planted: megatron's own `_set_sub_optimizer_grads` (the fix removed) never steps the float32 shards it keeps on
  the device.
- A checkpoint of the offloaded optimizer (megatron's fully_reshardable format) reloads bitwise and the next
  update equals the uninterrupted one.
- Each shim targets a name megatron-core 0.16.1 still has, the refusals it works around are still megatron's, and
  the scoped modes leave torch as they found it.
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path

import pytest
import torch
from optimizer_helpers import OFFLOAD

from megatron_branch.compat import offload as off
from megatron_branch.compat.cpu import CompatError, _resolve
from megatron_branch.compat.distrib_optimizer import cuda_type_names
from megatron_branch.losses import Aggregation, PolicyObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model
from megatron_branch.update import OptimizerSettings, UpdatePlan, update_step
from megatron_branch.update.optimizer import inner_optimizers

VOCAB = 37


@pytest.fixture(scope="module")
def groups():  # noqa: ANN201
    return initialize_parallel(ParallelConfig())


def trainee(dtype: torch.dtype, *, seed: int = 0, **kw: object):  # noqa: ANN201
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.train.policy import Trainee

    settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, clip_grad=0.05, **kw)  # type: ignore[arg-type]
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    return Trainee(tiny_branch_model(dtype, seed=seed), dtype=dtype, settings=settings, pgc=pgc), pgc


def steps(tr, pgc, groups, n: int) -> None:  # noqa: ANN001
    rollouts = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 3), seed=7)
    obj = PolicyObjective(agg=Aggregation.of_batch(rollouts))
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None),
        schedule="replay",
        pg_collection=pgc,
    )
    for _ in range(n):
        assert update_step(
            tr.ddp, rollouts, obj, plan, optimizer=tr.optimizer, scheduler=tr.scheduler
        ).stepped


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def update_error(got: dict, want: dict, start: dict) -> float:
    out = 0.0
    for n, w in want.items():
        d = (w - start[n]).double().norm()
        if d == 0:
            assert torch.equal(got[n], w), n
        else:
            out = max(out, float((got[n] - w).double().norm() / d))
    return out


_PLAIN: dict[torch.dtype, tuple[dict, dict]] = {}


def plain_run(groups, dtype: torch.dtype) -> tuple[dict, dict]:  # noqa: ANN001
    """(start, after 3 updates) of the plain optimizer, computed once per dtype."""
    if dtype not in _PLAIN:
        plain, pgc = trainee(dtype)
        start = params(plain.model)
        steps(plain, pgc, groups, 3)
        _PLAIN[dtype] = start, params(plain.model)
    return _PLAIN[dtype]


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,fraction", [(torch.float64, 0.5), (torch.float64, 1.0), (torch.float32, 0.5)], ids=str
)
def test_offload_equals_the_plain_optimizer(groups, dtype: torch.dtype, fraction: float) -> None:  # noqa: ANN001
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    start, want = plain_run(groups, dtype)
    hybrid, pgc = trainee(dtype, optimizer_offload_fraction=fraction, **OFFLOAD)
    steps(hybrid, pgc, groups, 3)
    (inner,) = inner_optimizers(hybrid.optimizer)
    hdo = inner.optimizer
    assert isinstance(hdo, HybridDeviceOptimizer)
    total = sum(p.numel() for g in hdo.param_groups for p in g["params"])
    offloaded = sum(p.numel() for p in hdo.gpu_params_map_cpu_copy)
    assert fraction * total <= offloaded <= total and (hdo.gpu_optimizer is None) == (fraction == 1.0)
    for p, host in hdo.gpu_params_map_cpu_copy.items():  # the host copy holds the master and the moments
        assert host.data_ptr() != p.data_ptr() and host.dtype == dtype
        assert torch.equal(host, p.detach()) and hdo.state[p]["exp_avg"].data_ptr() != p.data_ptr()
    err = update_error(params(hybrid.model), want, start)
    assert err <= (1e-12 if dtype == torch.float64 else 1e-4), err


def test_planted_megatron_leaves_device_fp32_shards_unstepped(groups, monkeypatch) -> None:  # noqa: ANN001
    """Without the fix, megatron's HybridDeviceOptimizer never steps a float32 shard it keeps on the device."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    off.apply_offload_fixes()
    fixed = HybridDeviceOptimizer._set_sub_optimizer_grads
    monkeypatch.setattr(HybridDeviceOptimizer, "_set_sub_optimizer_grads", fixed._megatron)
    hybrid, pgc = trainee(torch.float32, optimizer_offload_fraction=0.5, **OFFLOAD)
    hdo = inner_optimizers(hybrid.optimizer)[0].optimizer
    kept = [p for g in hdo.gpu_optimizer.param_groups for p in g["params"]]
    assert kept and not any(p in hdo.fp32_param_to_orig_param for p in kept)  # fp32: no copies on the device
    before = [p.detach().clone() for p in kept]
    steps(hybrid, pgc, groups, 2)
    assert all(torch.equal(p, b) for p, b in zip(kept, before))  # megatron's bug: they never moved
    monkeypatch.setattr(HybridDeviceOptimizer, "_set_sub_optimizer_grads", fixed)
    steps(hybrid, pgc, groups, 1)
    assert not any(torch.equal(p, b) for p, b in zip(kept, before))  # with the fix they do


@pytest.mark.slow
def test_offloaded_optimizer_checkpoint_reloads_exactly(groups) -> None:  # noqa: ANN001
    from megatron.core.dist_checkpointing import load_plain_tensors

    from megatron_branch.checkpoint.store import CheckpointStore

    kw = {"optimizer_offload_fraction": 0.5, **OFFLOAD}
    a, pgc = trainee(torch.float64, **kw)
    steps(a, pgc, groups, 2)
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(Path(tmp) / "a")
        path = store.save(2, {"policy": a.sharded_state("", loading=False)}, common={})
        b, _ = trainee(torch.float64, seed=5, **kw)  # other weights until loaded
        state, _ = store.load(path, {"policy": b.sharded_state("", loading=True)})
        b.load(state["policy"], "")
        again = CheckpointStore(Path(tmp) / "b").save(
            2, {"policy": b.sharded_state("", loading=False)}, common={}
        )
        x, y = load_plain_tensors(str(path)), load_plain_tensors(str(again))
        flat = lambda d: {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}  # noqa: E731
        keys = [k for k in flat(x) if k.startswith("optimizer.state.exp_avg_sq.")]
        assert keys and sorted(flat(x)) == sorted(flat(y))
        assert all(torch.equal(flat(x)[k], flat(y)[k]) for k in flat(x))
    start = params(a.model)
    assert all(torch.equal(v, params(b.model)[k]) for k, v in start.items())
    steps(a, pgc, groups, 1)
    steps(b, pgc, groups, 1)
    assert update_error(params(b.model), params(a.model), start) <= 1e-12


def test_distributed_optimizer_holds_float64_through_megatrons_fp32_path(groups) -> None:  # noqa: ANN001
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    tr, pgc = trainee(torch.float64, use_distributed_optimizer=True)
    (inner,) = inner_optimizers(tr.optimizer)
    assert isinstance(inner, DistributedOptimizer)
    shards = [p for g in inner.shard_fp32_groups for p in g]
    assert shards and all(p.dtype == torch.float64 for p in shards) and not any(inner.model_float16_groups)
    assert all(not hasattr(p, "type") or "type" not in vars(p) for p in tr.model.parameters())  # scope undone
    steps(tr, pgc, groups, 1)
    assert all(p.grad is None or p.grad.dtype == torch.float64 for p in shards)


# ---- the shims themselves ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module,attr",
    [
        ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
        ("megatron.core.optimizer.cpu_offloading.hybrid_optimizer", "torch"),
        ("megatron.core.optimizer.cpu_offloading.hybrid_optimizer", "HybridDeviceOptimizer"),
        ("megatron.core.optimizer.optimizer_config", "is_te_min_version"),
        ("megatron.core.utils", "get_te_version"),
    ],
)
def test_patched_names_exist(module: str, attr: str) -> None:
    _resolve(module, attr)


def test_the_refusals_are_still_megatrons() -> None:
    """If megatron-core stops refusing, the shim is obsolete: this fails and says which."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer as H
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as D

    from megatron_branch.compat.optimizer import apply_optimizer_shims

    apply_optimizer_shims()
    assert "'torch.cuda.FloatTensor'" in inspect.getsource(D._build_model_and_main_param_groups)
    assert "shard_model_grad.float()" in inspect.getsource(D._copy_model_grads_to_main_grads._megatron)
    split = inspect.getsource(inspect.unwrap(H._get_sub_optimizer_param_groups))
    assert "param.is_cuda" in split and ".pin_memory()" in split
    dp_zero = inspect.getsource(inspect.unwrap(D.get_parameter_state_dp_zero))
    assert "dtype=torch.float32" in dp_zero
    for name in ("zeros", "ones", "empty", "tensor", "full"):
        assert callable(getattr(torch, name))


def test_scoped_modes_restore_torch() -> None:
    t = torch.zeros(3, dtype=torch.float64)
    with off.cpu_plays_device():
        assert t.is_cuda  # the CPU plays the device
        host = t.cpu()
        assert not host.is_cuda and host.data_ptr() != t.data_ptr()  # a device-to-host copy
        assert not host.detach().clone().float().is_cuda  # what is made of a host copy stays on the host
        assert host.float().dtype == torch.float64 and t.pin_memory() is t
    assert not t.is_cuda and t.float().dtype == torch.float32 and t.cpu() is t
    assert "is_cuda" not in vars(torch.Tensor)
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with cuda_type_names([p]):
        assert p.type() == "torch.cuda.FloatTensor" and p.type(torch.float32).dtype == torch.float32
    assert p.type() == "torch.DoubleTensor"


def test_renamed_target_fails_loudly(monkeypatch) -> None:  # noqa: ANN001
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    monkeypatch.delattr(hybrid_optimizer.HybridDeviceOptimizer, "_move_new_state_to_right_device")
    monkeypatch.delitem(off._FIXED, "offload_device_grads", raising=False)
    with pytest.raises(CompatError, match="_move_new_state_to_right_device is gone"):
        off._shim_state_move()


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"optimizer_cpu_offload": True}, "optimizer_cpu_offload needs use_distributed_optimizer"),
        ({"use_precision_aware_optimizer": True}, "needs use_distributed_optimizer"),
        ({"use_distributed_optimizer": True, "exp_avg_dtype": "bf16"}, "needs use_precision_aware_optimizer"),
        ({**OFFLOAD, "exp_avg_sq_dtype": "bf16"}, "keeps Adam's moments in fp32"),
        ({"optimizer_offload_fraction": 1.5}, r"optimizer_offload_fraction must be in \[0, 1\]"),
        ({"main_grads_dtype": "fp8"}, "main_grads_dtype must be one of"),
    ],
)
def test_settings_refuse_what_megatron_refuses(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerSettings(**kw)


def test_unsupported_here_is_refused_before_building() -> None:
    from megatron_branch.update.optimizer import check_supported

    with pytest.raises(ValueError, match="needs bf16 parameters"):
        check_supported(OptimizerSettings(**OFFLOAD, main_grads_dtype="bf16"), torch.float32)
    if not torch.cuda.is_available():
        aware = OptimizerSettings(use_distributed_optimizer=True, use_precision_aware_optimizer=True)
        with pytest.raises(ValueError, match="needs TransformerEngine's FusedAdam"):
            check_supported(aware, torch.float32)
    check_supported(OptimizerSettings(**OFFLOAD, main_grads_dtype="bf16"), torch.bfloat16)  # fine
