"""bf16: megatron's mixed precision on CPU, and the bound that replaces bitwise exactness (docs/design.md "bf16").

- megatron's Float16OptimizerWithFloat16Params, DistributedOptimizer and its CPU offload step fp32 main parameters
  from DDP's fp32 main gradients for bf16 parameters; the update equals torch AdamW on those gradients; the shim it
  needs on CPU is guarded (megatron still refuses CPU bf16 parameters without it).
- The bound: against float64 naive training of the same weights and batch, each schedule's bf16 error (per
  parameter tensor of the fp32 main gradient, the loss, the logprobs) is at most RATIO x naive's bf16 error; trees
  with shared response tokens carrying different advantages; several seeds. Over several optimizer steps the
  fp32 main parameters of replay stay within RATIO x naive's distance to the float64 run.
- What the engine keeps in fp32, each checked sharply and planted: replay's dK/dV sums (a bf16 accumulator is
  caught), DDP's main gradients (bf16 main gradients are caught), the logprobs (bf16 logprobs are caught); the
  CPU flash kernel in bf16 hands back fp32 lse, merged in fp32.
"""

from __future__ import annotations

import pytest
import torch
from optimizer_helpers import VARIANTS

from megatron_branch.bench import precision as bp
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

RATIO = 2.0
"""A schedule's bf16 error is at most RATIO x naive's, per tensor (module doc; measured: benchmarks/bf16_bound.py)."""
BF16_UNIT = 2.0**-8
"""bf16's unit roundoff (8 significant bits): the floor of the loss bound."""
FP32_SUM = 1e-6
"""Relative error of an fp32 sum of bf16 terms against their float64 sum (a bf16 sum: ~1e-3)."""


@pytest.fixture(scope="module")
def groups():  # noqa: ANN201
    return initialize_parallel(ParallelConfig())


# ---- the optimizer: megatron's mixed precision ------------------------------------------------------------------
def test_float16_optimizer_shim_targets_megatron_and_is_still_needed(groups) -> None:  # noqa: ANN001
    """Without the shim megatron refuses CPU bf16 parameters (its CUDA type check); with it, fp32 main copies."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_branch.compat.optimizer import apply_optimizer_shims

    apply_optimizer_shims()
    assert Float16OptimizerWithFloat16Params.__init__._megatron_branch_cpu
    megatron_init = Float16OptimizerWithFloat16Params.__init__._megatron
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16)
    bare = object.__new__(Float16OptimizerWithFloat16Params)
    with pytest.raises(TypeError, match="Wrapped parameters must be one of"):
        megatron_init(bare, torch.optim.Adam([p]), cfg, None, lambda *a: None)
    opt = Float16OptimizerWithFloat16Params(torch.optim.Adam([p]), cfg, None, lambda *a: None)
    (main,) = opt.fp32_from_float16_groups[0]
    assert main.dtype == torch.float32 and torch.equal(main, p.float()) and p.main_param is main
    assert (
        "type" not in p.__dict__ and p.type() == "torch.BFloat16Tensor"
    )  # the scoped CUDA name is gone again


def _trainee(weights: dict, **kw: object):  # noqa: ANN202
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.train.policy import Trainee
    from megatron_branch.update import OptimizerSettings

    # no weight decay: megatron exempts biases and norms from it, the AdamW oracle below would not
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.0, clip_grad=0.05, **kw)  # type: ignore[arg-type]
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    model = bp.model_with(weights, torch.bfloat16)
    return Trainee(model, dtype=torch.bfloat16, settings=settings, pgc=pgc), pgc


def _plan(groups, pgc, schedule: str = "replay"):  # noqa: ANN001, ANN202
    from megatron_branch.schedule import ScheduleOptions
    from megatron_branch.update import UpdatePlan

    opts = ScheduleOptions(groups=groups, vocab_size=bp.VOCAB, branch_micro_batch=4, chunk_tokens=None)
    return UpdatePlan(opts=opts, schedule=schedule, pg_collection=pgc)


def _main_params(trainee) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Each parameter's fp32 main copy, whole (one process: every shard is here): megatron's `main_param`, or with
    the precision-aware path (the offload) the hybrid optimizer's fp32 copy of the parameter's shard."""
    from megatron_branch.update.optimizer import inner_optimizers

    (inner,) = inner_optimizers(trainee.optimizer)
    to_inner = getattr(inner.optimizer, "param_to_inner_param", {})
    shards = [q for g in inner.optimizer.param_groups for q in g["params"]]
    out = {}
    for n, p in trainee.model.named_parameters():
        main = getattr(p, "main_param", None)
        if main is None:
            shard = next(s for s in shards if s.data_ptr() == p.data_ptr() and s.numel() == p.numel())
            main = to_inner.get(shard, shard)
        assert main.dtype == torch.float32, (n, main.dtype)
        out[n] = main.detach().reshape(p.shape).clone()
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_update_is_megatrons_mixed_precision(groups, variant: str) -> None:  # noqa: ANN001
    """bf16 parameters, fp32 main gradients and main parameters; the step is AdamW on the clipped fp32 main
    gradients from the fp32 main parameters, and the bf16 parameters are those rounded (megatron's copy back)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_branch.losses import build_objective
    from megatron_branch.update import update_step
    from megatron_branch.update.optimizer import inner_optimizers

    weights = bp.bf16_weights(1)
    rollouts = bp.tree_batch(1, branches=3)
    tr, pgc = _trainee(weights, **VARIANTS[variant])
    (inner,) = inner_optimizers(tr.optimizer)
    if variant == "plain":
        assert isinstance(inner, Float16OptimizerWithFloat16Params)
    start = _main_params(tr)
    assert all(torch.equal(start[n], weights[n].float()) for n in start)  # main copies of the bf16 values
    res = update_step(tr.ddp, rollouts, build_objective(bp.objective_config(), rollouts), _plan(groups, pgc),
                      optimizer=tr.optimizer, scheduler=tr.scheduler)  # fmt: skip
    assert res.stepped and res.metrics["actor/grad_norm"] > 0.05  # clipping was active
    for n, p in tr.model.named_parameters():
        assert p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32, n
    grads = {n: p.main_grad.detach().clone() for n, p in tr.model.named_parameters()}  # clipped in place
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    adam = torch.optim.AdamW(ref.values(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for n, q in ref.items():
        q.grad = grads[n]
    adam.step()
    after = _main_params(tr)
    for n, p in tr.model.named_parameters():
        torch.testing.assert_close(
            after[n], ref[n].detach(), rtol=1e-6, atol=1e-7
        )  # megatron's AdamW in fp32
        assert torch.equal(p.detach(), after[n].to(torch.bfloat16)), (
            n
        )  # the bf16 parameter: the main one rounded
    assert any(
        not torch.equal(after[n].to(torch.bfloat16).float(), after[n]) for n in after
    )  # fp32 bits kept


# ---- the bound --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])  # fmt: skip
def test_bf16_gradients_within_ratio_of_naive(groups, seed: int) -> None:  # noqa: ANN001
    errs = bp.measure(seed, groups=groups)
    naive = errs["naive"]
    assert 0 < max(naive["grads"].values()) < 0.1  # bf16 is not exact, and naive's own error is small
    for s in ("packed", "replay"):
        r = bp.ratios(errs, s)
        loss = r.pop("loss")
        worst = max(r, key=r.__getitem__)
        assert r[worst] <= RATIO, f"{s}: {worst} error {r[worst]:.2f} x naive's (bound {RATIO})"
        # the loss is one number: naive's error can be ~0 by chance, so the floor is one bf16 rounding of it
        assert errs[s]["loss"] <= RATIO * max(naive["loss"], BF16_UNIT), (s, loss, errs[s]["loss"])


# ---- what stays fp32, planted --------------------------------------------------------------------------------------
def _accumulator_error(groups, monkeypatch) -> float:  # noqa: ANN001
    """Largest relative error of replay's dK/dV sums (what is injected) against the float64 sum of the very bf16
    gradients the children sent."""
    from megatron_branch.schedule import prefix_cache

    sent: dict[tuple[int, int], torch.Tensor] = {}
    worst = [0.0]
    add, grad = prefix_cache.WideSum.add, prefix_cache.WideSum.grad

    def spy_add(self, j: int, leaf: torch.Tensor) -> None:  # noqa: ANN001
        key = (id(self), j)
        if leaf.grad is not None:
            sent[key] = sent.get(key, 0) + leaf.grad.double()
        add(self, j, leaf)

    def spy_grad(self, j: int, leaf: torch.Tensor):  # noqa: ANN001, ANN202
        got = grad(self, j, leaf)
        want = sent.pop((id(self), j), None)
        if got is not None and want is not None and want.norm() > 0:
            worst[0] = max(worst[0], float((got.double() - want).norm() / want.norm()))
        return got

    monkeypatch.setattr(prefix_cache.WideSum, "add", spy_add)
    monkeypatch.setattr(prefix_cache.WideSum, "grad", spy_grad)
    weights = bp.bf16_weights(3)
    bp.gradients(
        weights,
        torch.bfloat16,
        "replay",
        bp.tree_batch(3, branches=8),
        groups=groups,
        branch_micro_batch=1,
        chunk_tokens=None,  # the walk: one leaf per backward, so every cached prefix sums many children's gradients
    )
    assert not sent  # every sum was injected
    return worst[0]


def test_dkdv_sums_are_fp32_and_a_bf16_accumulator_is_caught(groups, monkeypatch) -> None:  # noqa: ANN001
    from megatron_branch.schedule import prefix_cache

    fp32 = _accumulator_error(groups, monkeypatch)
    monkeypatch.setattr(prefix_cache, "accumulation_dtype", lambda dtype: dtype)  # planted: sum in bf16
    planted = _accumulator_error(groups, monkeypatch)
    print(f"\n[dK/dV sums vs float64] fp32 {fp32:.1e}, planted bf16 {planted:.1e}")
    assert fp32 <= FP32_SUM and planted > 100 * FP32_SUM


def _main_grad_error(groups, *, fp32: bool) -> float:  # noqa: ANN001
    """Largest relative error of DDP's main gradients against the float64 sum of every backward's bf16 gradient."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.losses import build_objective
    from megatron_branch.parallel.ddp import wrap_megatron_ddp
    from megatron_branch.update import accumulate_gradients, finalize

    model = bp.model_with(bp.bf16_weights(4), torch.bfloat16)
    sent: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        p.register_hook(lambda g, n=n: sent.__setitem__(n, sent.get(n, 0) + g.double()))
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    ddp = wrap_megatron_ddp(
        model, dtype=torch.bfloat16, pg_collection=pgc, grad_reduce_in_fp32=None if fp32 else False
    )
    rollouts = bp.tree_batch(4, branches=8)
    plan = _plan(groups, pgc, "naive")  # one backward per rollout: 32 terms per parameter
    accumulate_gradients(ddp, rollouts, build_objective(bp.objective_config(), rollouts), plan)
    finalize(ddp, plan)
    return max(
        float((p.main_grad.double() - sent[n]).norm() / sent[n].norm()) for n, p in model.named_parameters()
    )


def test_main_gradients_are_fp32_and_bf16_main_gradients_are_caught(groups) -> None:  # noqa: ANN001
    fp32, planted = (
        _main_grad_error(groups, fp32=True),
        _main_grad_error(groups, fp32=False),
    )  # planted: bf16 buffer
    print(f"\n[main gradients vs float64] fp32 {fp32:.1e}, planted bf16 {planted:.1e}")
    assert fp32 <= FP32_SUM and planted > 100 * FP32_SUM


def _logprob_error() -> float:
    """The fused logprob of bf16 hidden states against float64 log-softmax of the same bf16 logits."""
    from megatron_branch.losses.fused_logprobs import fused_linear_logprobs

    g = torch.Generator().manual_seed(5)
    h = (torch.randn(64, 32, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(37, 32, generator=g) * 0.5).to(torch.bfloat16)
    t = torch.randint(0, 37, (64,), generator=g)
    logp = fused_linear_logprobs(h, w, t, vocab_size=37, chunk_rows=16)
    assert logp.dtype == torch.float32
    logits = torch.cat(
        [h[i : i + 16] @ w.t() for i in range(0, 64, 16)]
    )  # the same bf16 GEMMs, chunk by chunk
    want = torch.log_softmax(logits.double(), -1).gather(1, t[:, None]).squeeze(1)
    return float((logp.double() - want).abs().max() / want.abs().max())


def test_logprobs_are_fp32_and_bf16_logprobs_are_caught(monkeypatch) -> None:  # noqa: ANN001
    from megatron_branch.losses import fused_logprobs

    fp32 = _logprob_error()
    real = fused_logprobs._FusedLinearLogprob.forward

    def planted(ctx, hidden, *a):  # noqa: ANN001, ANN202
        logp, ent = real(ctx, hidden, *a)
        return logp.to(hidden.dtype).float(), ent  # what returning them in the model dtype would do

    monkeypatch.setattr(fused_logprobs._FusedLinearLogprob, "forward", staticmethod(planted))
    bf16 = _logprob_error()
    print(f"\n[logprobs vs float64 of the same logits] fp32 {fp32:.1e}, planted bf16 {bf16:.1e}")
    assert fp32 <= FP32_SUM and bf16 > 100 * FP32_SUM


def test_cpu_flash_attention_in_bf16_keeps_fp32_statistics() -> None:
    """bf16 attention on CPU runs torch's flash kernel; its lse is fp32 and the merge over key blocks is fp32."""
    from megatron_branch.attention.kernels import fused_attention_forward, fused_kernel_name
    from megatron_branch.attention.merge import lse_merge

    g = torch.Generator().manual_seed(6)
    q, k1, v1, k2, v2 = (torch.randn(1, 2, n, 16, generator=g).to(torch.bfloat16) for n in (8, 5, 5, 7, 7))
    assert fused_kernel_name(q) == "cpu-flash"
    o1, l1 = fused_attention_forward(q, k1, v1, False, 0.25)
    o2, l2 = fused_attention_forward(q, k2, v2, False, 0.25)
    assert o1.dtype == torch.bfloat16 and l1.dtype == torch.float32
    out, lse = lse_merge(*lse_merge(None, None, o1, l1), o2, l2)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    k, v = torch.cat([k1, k2], 2).double(), torch.cat([v1, v2], 2).double()
    s = q.double() @ k.transpose(-1, -2) * 0.25
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ v, rtol=2e-2, atol=2e-2)  # bf16 outputs


# ---- several steps -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
def test_several_bf16_steps_replay_stays_within_ratio_of_naive(groups, seed: int) -> None:  # noqa: ANN001
    """Three optimizer steps from the same bf16 weights: the fp32 main parameters' distance to the float64 run,
    per tensor, is at most RATIO x naive's (each step's update relative to the float64 update)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.losses import build_objective
    from megatron_branch.train.policy import Trainee
    from megatron_branch.update import OptimizerSettings, update_step

    weights = bp.bf16_weights(seed)
    rollouts = bp.tree_batch(seed, branches=4)
    objective = build_objective(bp.objective_config(), rollouts)
    settings = OptimizerSettings(lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    out = {}
    for name, dtype, schedule in (("ref", torch.float64, "naive"), ("naive", torch.bfloat16, "naive"),
                                  ("replay", torch.bfloat16, "replay")):  # fmt: skip
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        tr = Trainee(bp.model_with(weights, dtype), dtype=dtype, settings=settings, pgc=pgc)
        for _ in range(3):
            assert update_step(tr.ddp, rollouts, objective, _plan(groups, pgc, schedule), optimizer=tr.optimizer,
                               scheduler=tr.scheduler).stepped  # fmt: skip
        out[name] = (
            _main_params(tr)
            if dtype == torch.bfloat16
            else {n: p.detach().clone() for n, p in tr.model.named_parameters()}
        )
    start = {n: w.double() for n, w in weights.items()}
    ratios = []
    for n, ref in out["ref"].items():
        move = (ref.double() - start[n]).norm()
        e_naive = float((out["naive"][n].double() - ref).norm() / move)
        e_replay = float((out["replay"][n].double() - ref).norm() / move)
        ratios.append(e_replay / e_naive)
        assert e_replay <= RATIO * e_naive, f"{n}: replay {e_replay:.2e} vs naive {e_naive:.2e}"
    print(f"\n[3 steps] replay / naive distance to float64, per tensor: worst {max(ratios):.2f}")
