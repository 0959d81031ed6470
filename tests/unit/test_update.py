"""The update step: megatron's optimizer on CPU (shimmed), micro-batch invariance, naive == replay over updates.

One update over a batch split into 1, 2 or 4 micro-batches must give the same parameters (the objectives are
normalised on the global batch); five updates with naive and with replay must too (float64 1e-9, float32 1e-5).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megatron_branch.compat.cpu import CompatError
from megatron_branch.compat.optimizer import apply_optimizer_shims, clip_grad_by_total_norm, local_l2_norm
from megatron_branch.data import Rollout
from megatron_branch.losses import Aggregation, DPOObjective, PolicyObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model
from megatron_branch.update import OptimizerSettings, UpdatePlan, attach_scores, build_optimizer, update_step

VOCAB = 37


@pytest.fixture(scope="module")
def groups():  # noqa: ANN201
    return initialize_parallel(ParallelConfig())


def trainer(groups, dtype, *, seed=0, **settings):  # noqa: ANN001, ANN201
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.parallel.ddp import wrap_megatron_ddp

    model = tiny_branch_model(dtype, seed=seed)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    ddp = wrap_megatron_ddp(model, dtype=dtype, pg_collection=pgc)
    opt, sched = build_optimizer(ddp, OptimizerSettings(**{"lr": 1e-3, **settings}), dtype=dtype)
    return model, ddp, opt, sched, pgc


def params(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_params_close(got: dict, want: dict, start: dict, tol: float) -> None:
    """Relative error of the parameter CHANGE (what the update did), per parameter."""
    for n in want:
        d_want, d_got = want[n] - start[n], got[n] - start[n]
        assert d_want.norm() > 0, n
        err = ((d_got - d_want).double().norm() / d_want.double().norm()).item()
        assert err <= tol, f"{n}: relative error of the update {err:.3e} > {tol:.0e}"


def batch(seed: int = 0) -> list[Rollout]:
    return random_tree_rollouts(groups=4, prompt_len=5, branches=3, levels=2, seg_len=(2, 3), seed=seed)


def with_old_and_ref(groups, rollouts, dtype, seed=0):  # noqa: ANN001, ANN201
    """Old logprobs from a differently seeded model (so clipping bites), reference from a third."""
    opts = ScheduleOptions(groups=groups, vocab_size=VOCAB)
    plan = UpdatePlan(opts=opts, schedule="naive")
    rollouts = attach_scores(
        tiny_branch_model(dtype, seed=seed + 11, scale=1.0), rollouts, "old_logprobs", plan
    )
    return attach_scores(tiny_branch_model(dtype, seed=seed + 12, scale=1.0), rollouts, "ref_logprobs", plan)


def test_optimizer_shims_target_existing_names_and_compute_the_same() -> None:
    from megatron_branch.compat.cpu import _resolve

    for module, attr in [
        ("megatron.core.optimizer.optimizer", "torch"),
        ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
        ("megatron.core.optimizer.clip_grads", "l2_norm_impl"),
        ("megatron.core.optimizer.grad_scaler", "torch"),
        ("megatron.core.utils", "local_multi_tensor_l2_norm"),
    ]:
        _resolve(module, attr)
    with pytest.raises(CompatError, match="is gone"):
        _resolve("megatron.core.optimizer.optimizer", "no_such_name")
    apply_optimizer_shims()
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(5, 3, dtype=torch.float64, generator=g),
        torch.randn(4, dtype=torch.float64, generator=g),
    ]
    norm, _ = local_l2_norm(0, None, [ts], False)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm[0], torch.cat([t.flatten() for t in ts]).norm(), rtol=1e-15, atol=0)
    ps = [torch.nn.Parameter(t.clone()) for t in ts]
    for p, t in zip(ps, ts):
        p.grad = t.clone()
    clip_grad_by_total_norm(ps, 0.5, float(norm))
    want = [t.clone() for t in ts]
    torch.nn.utils.clip_grad_norm_(want, 0.5)  # the grads of `want` are absent: compare by hand instead
    for p, t in zip(ps, ts):
        torch.testing.assert_close(p.grad, t * (0.5 / (float(norm) + 1e-6)), rtol=1e-15, atol=0)


def test_megatron_optimizer_step_equals_torch_adamw_with_clipping(groups) -> None:  # noqa: ANN001
    model, ddp, opt, sched, pgc = trainer(groups, torch.float64, weight_decay=0.0, clip_grad=0.05)
    start = params(model)
    rollouts = batch(1)
    obj = PolicyObjective(agg=Aggregation.of_batch(rollouts))
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None),
        schedule="replay",
        pg_collection=pgc,
    )
    res = update_step(ddp, rollouts, obj, plan, optimizer=opt, scheduler=sched)
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}  # clipped in place
    norm = res.metrics["actor/grad_norm"]
    assert norm > 0.05  # clipping was active
    # oracle: torch AdamW on the same (clipped) gradients from the same start
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    adam = torch.optim.AdamW(ref.values(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for n, p in ref.items():
        p.grad = grads[n]
    adam.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-13, atol=1e-15)
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    assert float(total) == pytest.approx(
        0.05 / (norm + 1e-6) * norm, rel=1e-9
    )  # the grads were scaled to 0.05
    assert res.metrics["actor/lr"] == 1e-3 and res.stepped


OBJECTIVES = {
    "grpo": lambda rs: PolicyObjective(
        agg=Aggregation.of_batch(rs), clip_c=3.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.01
    ),
    "seq_mean": lambda rs: PolicyObjective(agg=Aggregation.of_batch(rs, "seq-mean-token-mean")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_micro_batches_give_the_same_update(groups, name: str) -> None:  # noqa: ANN001
    rollouts = with_old_and_ref(groups, batch(2), torch.float64)
    obj = OBJECTIVES[name](rollouts)
    results, metrics = {}, {}
    for n in (1, 2, 4):
        model, ddp, opt, sched, pgc = trainer(groups, torch.float64, weight_decay=0.1)
        start = params(model)
        plan = UpdatePlan(
            opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, branch_micro_batch=2, chunk_tokens=None),
            schedule="replay",
            micro_batches=n,
            pg_collection=pgc,
        )
        metrics[n] = update_step(ddp, rollouts, obj, plan, optimizer=opt, scheduler=sched).metrics
        results[n] = params(model)
    for n in (2, 4):
        assert_params_close(results[n], results[1], start, 1e-9)
        for k, v in metrics[1].items():
            assert metrics[n][k] == pytest.approx(v, rel=1e-10, abs=1e-14), k
    assert metrics[1]["actor/pg_clipfrac"] > 0
    assert metrics[1]["tree/token_ratio"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_five_updates_naive_equal_replay(groups, dtype: torch.dtype) -> None:  # noqa: ANN001
    rollouts = with_old_and_ref(groups, batch(3), dtype)
    obj = OBJECTIVES["grpo"](rollouts)
    out = {}
    for schedule in ("naive", "replay"):
        model, ddp, opt, sched, pgc = trainer(
            groups, dtype, warmup_steps=2, decay_steps=5, decay_style="cosine", min_lr=1e-4
        )
        start = params(model)
        plan = UpdatePlan(
            opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None),
            schedule=schedule,
            micro_batches=2,
            pg_collection=pgc,
        )
        lrs = [
            update_step(ddp, rollouts, obj, plan, optimizer=opt, scheduler=sched).metrics["actor/lr"]
            for _ in range(5)
        ]
        out[schedule] = params(model)
    assert (
        lrs[0] == 0.0 and lrs[2] == pytest.approx(1e-3) and 1e-4 < lrs[4] < 1e-3
    )  # warm-up then cosine decay
    if dtype == torch.float64:  # the update itself (the stricter measure) agrees to 1e-9
        assert_params_close(out["replay"], out["naive"], start, 1e-9)
    else:  # float32: Adam normalises near-zero gradient entries, so their rounding noise is amplified in the
        # CHANGE; the parameters agree to 1e-5 relative (the acceptance bound)
        for n, want in out["naive"].items():
            err = ((out["replay"][n] - want).double().norm() / want.double().norm()).item()
            assert err <= 1e-5, f"{n}: {err:.3e}"


def test_dpo_update_is_micro_batch_invariant(groups) -> None:  # noqa: ANN001
    rng = random.Random(4)
    rollouts = []
    for k in range(4):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(4))
        for chosen, first in ((True, 1), (False, 2)):
            resp = (5, first) + tuple(rng.randrange(VOCAB) for _ in range(2))
            rollouts.append(Rollout(prompt=prompt, response=resp, pair=k, chosen=chosen))
    ref = tiny_branch_model(torch.float64, seed=21, scale=1.0)
    dpo = DPOObjective(num_pairs=4, beta=0.3)
    results, losses = {}, {}
    for n in (1, 4):
        model, ddp, opt, sched, pgc = trainer(groups, torch.float64)
        start = params(model)
        plan = UpdatePlan(
            opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None),
            micro_batches=n,
            pg_collection=pgc,
        )
        losses[n] = update_step(ddp, rollouts, dpo, plan, optimizer=opt, ref_model=ref).metrics["actor/loss"]
        results[n] = params(model)
    assert losses[4] == pytest.approx(losses[1], rel=1e-12)
    assert_params_close(results[4], results[1], start, 1e-9)
    assert dataclasses.is_dataclass(dpo)
