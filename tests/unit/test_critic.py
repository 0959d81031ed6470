"""PPO's critic: the clipped value loss is exact under sharing (values at a shared row are one number, returns
differ per rollout), equals the plain formula, and trains through the update step like the actor."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import Aggregation, ValueObjective, with_gae
from megatron_branch.models import ModelArch, build_critic
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts
from megatron_branch.update import OptimizerSettings, UpdatePlan, attach_scores, build_optimizer, update_step

VOCAB = 37
ARCH = ModelArch(
    family="llama",
    vocab_size=VOCAB,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
)


@pytest.fixture(scope="module")
def groups():  # noqa: ANN201
    return initialize_parallel(ParallelConfig())


def critic(dtype: torch.dtype = torch.float64, seed: int = 0):  # noqa: ANN201
    torch.manual_seed(seed)
    return build_critic(ARCH, dtype=dtype, head_seed=seed, head_std=0.5)


def ppo_rollouts(model, groups, seed: int) -> list[Rollout]:  # noqa: ANN001
    """Per-token rewards, old values = current values + a per-rollout shift (clipped for some rollouts only at
    a shared row), returns from GAE."""
    rng = random.Random(seed)
    rs = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 3), seed=seed)
    rs.append(Rollout(prompt=(), response=(3, 1, 4), advantage=0.0))
    plan = UpdatePlan(opts=ScheduleOptions(groups=groups, vocab_size=VOCAB), schedule="naive")
    rs = attach_scores(model, rs, "values", plan)
    out = []
    for r in rs:
        shift = rng.choice((-0.9, -0.1, 0.2, 0.8))
        fields = {
            "values": tuple(v + shift for v in r.field("values")),
            "rewards": tuple(rng.uniform(-1, 1) for _ in r.response),
        }
        out.append(dataclasses.replace(r, token_fields=fields))
    return with_gae(out, gamma=0.95, lam=0.9)


def grads(model, tree, obj, schedule, **kw):  # noqa: ANN001, ANN201
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    )
    return res, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_exact_under_sharing_and_plain_formula(groups, mode: str) -> None:  # noqa: ANN001
    model = critic()
    rollouts = ppo_rollouts(model, groups, seed=3)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = ValueObjective(agg=Aggregation.of_batch(rollouts, mode), clip=0.5)
    naive, want = grads(model, tree, obj, "naive")
    assert "value_head.weight" in want and "output_layer.weight" not in want
    for schedule, kw in [("packed", {}), ("replay", {"branch_micro_batch": 2, "recompute": True})]:
        res, got = grads(model, tree, obj, schedule, **kw)
        for n, g in want.items():
            err = ((got[n] - g).norm() / g.norm()).item()
            assert err <= 1e-9, f"{schedule} {n}: {err:.2e}"
        assert res.stats["critic/vf_clipfrac"] == pytest.approx(naive.stats["critic/vf_clipfrac"], abs=1e-15)
    # the plain formula, rollout by rollout, from the critic's scored values
    v = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB)).logprobs
    n_tok, n = sum(len(r.response) for r in rollouts), len(rollouts)
    loss = clipped = 0.0
    for i, r in enumerate(rollouts):
        w = 1 / n_tok if mode == "token-mean" else 1 / (n * len(r.response))
        for j in range(len(r.response)):
            x = float(v[i][j])
            if math.isnan(x):
                continue
            ret, old = r.field("returns")[j], r.field("values")[j]
            a, b = (x - ret) ** 2, (min(max(x, old - 0.5), old + 0.5) - ret) ** 2
            loss += w * 0.5 * max(a, b)
            clipped += (b > a) / n_tok
    assert naive.loss == pytest.approx(loss, rel=1e-12)
    assert naive.stats["critic/vf_loss"] == pytest.approx(loss, rel=1e-12)
    assert naive.stats["critic/vf_clipfrac"] == pytest.approx(clipped, abs=1e-15)
    assert 0 < clipped < 1


@pytest.mark.slow
def test_critic_update_is_micro_batch_invariant(groups) -> None:  # noqa: ANN001
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.parallel.ddp import wrap_megatron_ddp

    rollouts = ppo_rollouts(critic(seed=1), groups, seed=5)
    obj = ValueObjective(agg=Aggregation.of_batch(rollouts))
    out = {}
    for n in (1, 2):
        model = critic(seed=1)
        start = {k: p.detach().clone() for k, p in model.named_parameters()}
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        ddp = wrap_megatron_ddp(model, dtype=torch.float64, pg_collection=pgc)
        opt, sched = build_optimizer(ddp, OptimizerSettings(lr=1e-3), dtype=torch.float64)
        plan = UpdatePlan(
            opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None),
            micro_batches=n,
            pg_collection=pgc,
        )
        m = update_step(ddp, rollouts, obj, plan, optimizer=opt, scheduler=sched).metrics
        out[n] = ({k: p.detach().clone() for k, p in model.named_parameters()}, m)
    assert set(out[1][1]) >= {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr"}
    for k, p in out[1][0].items():
        d = p - start[k]
        if k == "output_layer.weight":
            assert d.abs().max() == 0  # frozen
            continue
        err = ((out[2][0][k] - p).norm() / d.norm()).item()
        assert err <= 1e-9, f"{k}: {err:.2e}"
