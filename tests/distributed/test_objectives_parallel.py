"""The RL objectives under TP2+SP, CP2 and DP2 against single-rank references (float64, 1e-9 per parameter).

    python tests/distributed/launch.py 2 -k objectives

- Per objective, under each layout (TP2+SP, CP2, DP2 = two ranks with one prompt group each): the replay and the
  packed gradient (through accumulate_gradients + finalize, the gradient part of the update) of
  * the clipped surrogate with dual clip, KL and entropy (float64 1e-9, float32 1e-5), against an HF float64 oracle
    that runs every rollout alone and evaluates the SAME bound objective's per-rollout loss on HF's logprobs and
    entropies (so the vocab-parallel entropy is checked too);
  * GSPO, CISPO and GMPO (float64 1e-9) with KL and entropy, the same oracle (GSPO's s_i and GMPO's m_i from HF's
    own logprobs), and
    verl's own cispo function (`verl:cispo`, replay) against the native cispo's oracle;
  * DPO, sigmoid and ipo (float64 1e-9, float32 1e-5): the forward-only pass, then the linearised gradient pass,
    against autograd through HF's per-rollout logprob sums; the two responses of a pair share their first tokens;
  * the critic's value loss with clipping (float64 1e-9, float32 1e-5), against HF's hidden states through the same head.
- DP2: one full update (megatron DDP + megatron's optimizer, clipping active) against the update computed on one
  rank (whole batch, no DDP) with torch's AdamW.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.checkpoint.tp import gather_full_grads, load_full_state
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import (
    Aggregation,
    CISPOObjective,
    GMPOObjective,
    GSPOObjective,
    PolicyObjective,
)
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, ParallelGroups, initialize_parallel
from megatron_branch.schedule import ScheduleOptions
from megatron_branch.testing import exact_hf_norms, random_tree_rollouts, tiny_hf_config, tiny_hf_model

VOCAB = 37


def _rollouts() -> list[Rollout]:
    rng = random.Random(31)
    rs = random_tree_rollouts(groups=2, prompt_len=7, branches=3, levels=2, seg_len=(2, 5), seed=32)
    return [
        dataclasses.replace(
            r,
            token_fields={
                "old_logprobs": tuple(rng.uniform(-4.5, -2.5) for _ in r.response),
                "ref_logprobs": tuple(rng.uniform(-4.5, -2.5) for _ in r.response),
                "advantages": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )
        for r in rs
    ]


def _objective(rollouts: list[Rollout]) -> PolicyObjective:
    return PolicyObjective(
        agg=Aggregation.of_batch(rollouts, "seq-mean-token-mean"),
        clip_c=3.0,
        kl_coef=0.2,
        kl_type="k3",
        entropy_coef=0.05,
    )


def _hf() -> torch.nn.Module:
    return exact_hf_norms(
        tiny_hf_model(tiny_hf_config("llama", vocab_size=VOCAB), seed=9, dtype=torch.float64)
    )


def _seq(r: Rollout) -> torch.Tensor:
    return torch.tensor([list(r.prompt) + list(r.response)])


def _hf_logq(hf: torch.nn.Module, r: Rollout) -> torch.Tensor:
    return torch.log_softmax(hf(input_ids=_seq(r)).logits[0, :-1], dim=-1)


def _oracle(hf: torch.nn.Module, rollouts: list[Rollout], objective: PolicyObjective) -> tuple[float, dict]:
    """HF float64, rollout by rollout, through the objective's own per-rollout loss (naive's formula)."""
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    if objective.needs_scores:  # GSPO: s_i from HF's own forward-only logprobs, then the same per-pair loss
        with torch.no_grad():
            lp = [_hf_logq(hf, r).gather(1, _seq(r)[0, 1:, None])[len(r.prompt) - 1 :, 0] for r in rollouts]
        objective = objective.prepare(tree, SimpleNamespace(logprobs=lp)).objective
    bound = objective.bind(tree)
    hf.zero_grad(set_to_none=True)
    total = 0.0
    for i, r in enumerate(rollouts):
        seq = _seq(r)
        logq = _hf_logq(hf, r)  # [L-1, V]
        logp = logq.gather(1, seq[0, 1:, None]).squeeze(1)
        ent = -(logq.exp() * logq).sum(-1)
        loss, _ = bound.rollout_loss(i, logp, ent)
        loss.backward()
        total += float(loss)
    return total, {n: p.grad.clone() for n, p in hf.named_parameters()}


def _close(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for n, g in want.items():
        err = ((got[n].double() - g).norm() / g.norm()).item()
        assert err <= tol, f"{n}: {err:.2e}"


LAYOUTS = ["tp2_sp", "cp2", "dp2"]


def _layout(layout: str) -> ParallelGroups:
    cfg = {
        "tp2_sp": ParallelConfig(tp=2, sequence_parallel=True),
        "cp2": ParallelConfig(cp=2),
        "dp2": ParallelConfig(),  # world 2, tp = cp = 1: two DP ranks, each with one prompt group
    }[layout]
    return initialize_parallel(cfg)


def _policy(hf: torch.nn.Module, groups: ParallelGroups, dtype: torch.dtype) -> torch.nn.Module:
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(groups.tp_size))
    load_full_state(model, {k: v.to(dtype) for k, v in state.items()}, groups.tp)
    return model


def _layout_grads(
    model: torch.nn.Module,
    rollouts: list[Rollout],
    objective: object,
    groups: ParallelGroups,
    schedule: str,
    **options: Any,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(global metrics, full gradients) of one gradient pass over the GLOBAL batch under `groups`.

    accumulate_gradients gives each DP rank its prompt groups (all of them under TP/CP); for DPO it runs what the
    single-process DPO tests run: score_rollouts(...).sums(), DPOObjective.linearise, then the schedule.
    """
    from megatron_branch.update import UpdatePlan, accumulate_gradients, finalize, reduce_metrics

    kw = {"branch_micro_batch": 2, **options} if schedule == "replay" else options
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, **{"chunk_tokens": None, **kw}),
        schedule=schedule,
    )
    model.zero_grad(set_to_none=True)
    acc = accumulate_gradients(model, rollouts, objective, plan)  # type: ignore[arg-type]
    finalize(model, plan)  # SP grads over TP, every grad SUMMED over DP x CP (global normalisation)
    role = "critic" if type(objective).__name__ == "ValueObjective" else "actor"
    return reduce_metrics(acc, objective, groups, role), gather_full_grads(model, groups.tp)


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_policy_objective_under_tp_sp_cp_and_dp(layout: str, dtype: torch.dtype) -> None:
    hf, rollouts = _hf(), _rollouts()
    objective = _objective(rollouts)
    want_loss, want = _oracle(hf, rollouts, objective)
    groups = _layout(layout)
    model = _policy(hf, groups, dtype)
    arch = ModelArch.from_hf_config(hf.config)
    tol = 1e-9 if dtype == torch.float64 else 1e-5  # float32 against the float64 oracle
    # replay with small subtrees packed by a token budget (schedule/walk.py) too: under SP, the ring and DP
    for schedule, options in (("replay", {}), ("packed", {}), ("replay", {"chunk_tokens": 16})):
        metrics, grads = _layout_grads(model, rollouts, objective, groups, schedule, **options)
        assert metrics["actor/loss"] == pytest.approx(want_loss, rel=tol)
        _close(mcore_to_hf_state(grads, arch), want, tol)
        assert 0 < metrics["actor/pg_clipfrac"] < 1 and metrics["actor/entropy"] > 0


@pytest.mark.world(2)
@pytest.mark.parametrize("mode", ["gspo", "cispo", "geo_mean"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_policy_modes_under_tp_sp_cp_and_dp(layout: str, mode: str) -> None:
    """GSPO and GMPO (the forward-only pass gives each rollout its s_i / m_i, then the gradient pass) and CISPO,
    float64."""
    hf, rollouts = _hf(), _rollouts()
    cls = {"gspo": GSPOObjective, "cispo": CISPOObjective, "geo_mean": GMPOObjective}[mode]
    objective = cls(
        agg=Aggregation.of_batch(rollouts, "token-mean"),
        clip_low=0.2,
        clip_high=0.28,
        kl_coef=0.1,
        kl_type="k3",
        entropy_coef=0.05,
    )
    want_loss, want = _oracle(hf, rollouts, objective)
    groups = _layout(layout)
    model = _policy(hf, groups, torch.float64)
    arch = ModelArch.from_hf_config(hf.config)
    for schedule in ("replay", "packed"):
        metrics, grads = _layout_grads(model, rollouts, objective, groups, schedule)
        assert metrics["actor/loss"] == pytest.approx(want_loss, rel=1e-9)
        _close(mcore_to_hf_state(grads, arch), want, 1e-9)
        assert 0 < metrics["actor/pg_clipfrac"] < 1


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_verl_loss_function_under_tp_sp_cp_and_dp(layout: str) -> None:
    """verl:cispo (verl's own function, linearised per micro-batch with the GLOBAL counts) equals the native
    cispo's oracle; under DP2 each rank calls verl's function on its own share."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from megatron_branch.losses import ObjectiveConfig, build_objective

    hf, rollouts = _hf(), _rollouts()
    cfg = ObjectiveConfig(policy_loss="verl:cispo", clip_ratio_high=0.28, kl_loss_coef=0.1, kl_loss_type="k3")
    native = dataclasses.replace(cfg, policy_loss="cispo")
    want_loss, want = _oracle(hf, rollouts, build_objective(native, rollouts))
    groups = _layout(layout)
    model = _policy(hf, groups, torch.float64)
    arch = ModelArch.from_hf_config(hf.config)
    metrics, grads = _layout_grads(model, rollouts, build_objective(cfg, rollouts), groups, "replay")
    assert metrics["actor/loss"] == pytest.approx(want_loss, rel=1e-9)
    _close(mcore_to_hf_state(grads, arch), want, 1e-9)


def _dpo_rollouts() -> list[Rollout]:
    """Four pairs; the two responses of a pair share their first two tokens (shared response rows whose
    gradient coefficient differs between the chosen and the rejected rollout)."""
    rng = random.Random(51)
    out = []
    for k in range(4):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(5))
        common = tuple(rng.randrange(VOCAB) for _ in range(2))
        for chosen, first in ((True, 1), (False, 2)):
            resp = common + (first,) + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
            ref = tuple(rng.uniform(-4.5, -2.5) for _ in resp)
            out.append(
                Rollout(
                    prompt=prompt, response=resp, pair=k, chosen=chosen, token_fields={"ref_logprobs": ref}
                )
            )
    return out


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dpo_under_tp_sp_cp_and_dp(layout: str, kind: str, dtype: torch.dtype) -> None:
    """Forward-only pass, then the linearised gradient pass, against autograd through HF's logprob sums."""
    from megatron_branch.losses import DPOObjective

    hf, rollouts = _hf(), _dpo_rollouts()
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    assert tree.positions_computed < tree.positions_logical
    dpo = DPOObjective(num_pairs=4, beta=0.5, loss_type=kind)
    hf.zero_grad(set_to_none=True)
    pis = []
    for r in rollouts:  # the oracle: every rollout alone, float64
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        logq = torch.log_softmax(hf(input_ids=seq).logits[0, :-1], dim=-1)
        pis.append(logq.gather(1, seq[0, 1:, None]).squeeze(1)[len(r.prompt) - 1 :].sum())
    oracle, _ = dpo.loss(tree, torch.stack(pis))
    oracle.backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters()}

    groups = _layout(layout)
    model = _policy(hf, groups, dtype)
    arch = ModelArch.from_hf_config(hf.config)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    for schedule in ("replay", "packed"):
        metrics, grads = _layout_grads(model, rollouts, dpo, groups, schedule)
        assert metrics["actor/loss"] == pytest.approx(float(oracle), rel=tol)
        _close(mcore_to_hf_state(grads, arch), want, tol)


@pytest.mark.world(2)
def test_dp2_update_equals_one_rank_update() -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.parallel.ddp import wrap_megatron_ddp
    from megatron_branch.update import (
        OptimizerSettings,
        UpdatePlan,
        accumulate_gradients,
        build_optimizer,
        update_step,
    )

    hf, rollouts = _hf(), _rollouts()
    objective = _objective(rollouts)
    groups = initialize_parallel(ParallelConfig())
    assert groups.dp_size == 2
    arch = ModelArch.from_hf_config(hf.config)
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1))

    # one rank alone: the whole batch, no DDP, torch AdamW on the clipped gradient
    ref = build_model(arch, dtype=torch.float64)
    load_full_state(ref, state, None)
    single = UpdatePlan(
        opts=ScheduleOptions(groups=ParallelGroups.single(), vocab_size=VOCAB), schedule="naive"
    )
    accumulate_gradients(ref, rollouts, objective, single)
    grads = [p.grad for p in ref.parameters()]
    norm = torch.sqrt(sum((g**2).sum() for g in grads))
    scale = min(1.0, 0.05 / (float(norm) + 1e-6))
    adam = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    for g in grads:
        g.mul_(scale)
    adam.step()

    # DP2: megatron DDP + megatron's optimizer, replay, two micro-batches per rank
    model = build_model(arch, dtype=torch.float64)
    load_full_state(model, state, None)
    start = [p.detach().clone() for p in model.parameters()]
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    ddp = wrap_megatron_ddp(model, dtype=torch.float64, pg_collection=pgc)
    opt, sched = build_optimizer(
        ddp, OptimizerSettings(lr=1e-3, weight_decay=0.0, clip_grad=0.05), dtype=torch.float64
    )
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None),
        micro_batches=2,
        pg_collection=pgc,
    )
    metrics = update_step(ddp, rollouts, objective, plan, optimizer=opt, scheduler=sched).metrics
    assert metrics["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-10)  # the global norm, over DP
    for (n, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start):
        err = ((p.detach() - q.detach()).norm() / (q.detach() - p0).norm()).item()  # relative to the update
        assert err <= 1e-9, f"{n}: {err:.2e}"


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_value_loss_under_tp_sp_cp_and_dp(layout: str, dtype: torch.dtype) -> None:
    """The value head is replicated over TP (on gathered hidden states) and over CP / DP: still exact."""
    from megatron_branch.losses import ValueObjective
    from megatron_branch.models import build_critic

    hf, rng = _hf(), random.Random(41)
    rollouts = [
        dataclasses.replace(
            r,
            token_fields={
                "values": tuple(rng.uniform(-1, 1) for _ in r.response),
                "returns": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )
        for r in random_tree_rollouts(groups=2, prompt_len=7, branches=3, levels=2, seg_len=(2, 5), seed=42)
    ]
    objective = ValueObjective(agg=Aggregation.of_batch(rollouts), clip=0.2)
    g = torch.Generator().manual_seed(5)
    head_w = torch.randn(1, hf.config.hidden_size, generator=g, dtype=torch.float64)
    head_b = torch.randn(1, generator=g, dtype=torch.float64)

    # oracle: HF's final hidden states, the same head, every rollout alone
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    bound = objective.bind(tree)
    w, b = head_w.clone().requires_grad_(), head_b.clone().requires_grad_()
    hf.zero_grad(set_to_none=True)
    for i, r in enumerate(rollouts):
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        h = hf.model(input_ids=seq).last_hidden_state[0, :-1]  # [L-1, h]: the row before each token
        bound.rollout_loss(i, (h @ w.t() + b).squeeze(-1))[0].backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}

    groups = _layout(layout)
    arch = ModelArch.from_hf_config(hf.config)
    critic = build_critic(arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(groups.tp_size))
    state = {**state, "value_head.weight": head_w, "value_head.bias": head_b}
    load_full_state(critic, {k: v.to(dtype) for k, v in state.items()}, groups.tp)
    tol = 1e-9 if dtype == torch.float64 else 1e-5  # float32 against the float64 oracle
    for schedule in ("replay", "packed"):
        metrics, full = _layout_grads(critic, rollouts, objective, groups, schedule)
        head = {"w": full.pop("value_head.weight"), "b": full.pop("value_head.bias")}
        _close(head, {"w": w.grad, "b": b.grad}, tol)
        if dtype == torch.float64:  # element by element too
            torch.testing.assert_close(head["w"], w.grad, rtol=1e-9, atol=0)
            torch.testing.assert_close(head["b"], b.grad, rtol=1e-9, atol=0)
        got = {n: t for n, t in mcore_to_hf_state(full, arch).items() if n in want}
        _close(got, want, tol)
        assert 0 < metrics["critic/vf_clipfrac"] < 1


@pytest.mark.world(2)
def test_attach_scores_gathers_the_whole_batch_over_dp() -> None:
    import torch.distributed as dist

    from megatron_branch.update import UpdatePlan, attach_scores

    hf = _hf()
    rollouts = [dataclasses.replace(r, token_fields={}) for r in _rollouts()]
    groups = initialize_parallel(ParallelConfig())
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=torch.float64)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    dp2 = attach_scores(
        model,
        rollouts,
        "values",
        UpdatePlan(opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, chunk_tokens=None)),
    )
    one = attach_scores(
        model,
        rollouts,
        "values",
        UpdatePlan(opts=ScheduleOptions(groups=ParallelGroups.single(), vocab_size=VOCAB, chunk_tokens=None)),
    )
    assert [r.field("values") for r in dp2] == [
        r.field("values") for r in one
    ]  # complete, and the same numbers
    both: list = [None, None]
    dist.all_gather_object(both, [r.field("values") for r in dp2], group=groups.dp)
    assert both[0] == both[1]


# ---- loss masks (issue 31): context tokens inside responses, per rollout -----------------------------------------


def _mask(rollouts: list[Rollout], seed: int) -> list[Rollout]:
    """Per-rollout loss masks (about a third context; masks differ at shared response tokens), rollout 1 wholly
    context (the sequence modes must not count it)."""
    rng = random.Random(seed)
    out = []
    for k, r in enumerate(rollouts):
        mask = [0] * len(r.response) if k == 1 else [int(rng.random() > 0.35) for _ in r.response]
        if k != 1:
            mask[-1] = 1
        out.append(dataclasses.replace(r, loss_mask=mask))
    return out


def _m(r: Rollout) -> tuple[bool, ...]:
    return r.loss_mask or (True,) * len(r.response)


@pytest.mark.world(2)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_policy_under_tp_sp_cp_and_dp(layout: str, mode: str) -> None:
    """GRPO with dual clip, k3 KL and entropy on masked rollouts: replay and packed equal HF's per-rollout
    masked loss (float64, 1e-9 per parameter); the trained-token fraction is global."""
    hf, rollouts = _hf(), _mask(_rollouts(), seed=61)
    objective = dataclasses.replace(_objective(rollouts), agg=Aggregation.of_batch(rollouts, mode))
    want_loss, want = _oracle(hf, rollouts, objective)
    groups = _layout(layout)
    model = _policy(hf, groups, torch.float64)
    arch = ModelArch.from_hf_config(hf.config)
    fraction = sum(r.num_trained for r in rollouts) / sum(len(r.response) for r in rollouts)
    for schedule in ("replay", "packed"):
        metrics, grads = _layout_grads(model, rollouts, objective, groups, schedule)
        assert metrics["actor/loss"] == pytest.approx(want_loss, rel=1e-9)
        assert metrics["tree/trained_token_fraction"] == pytest.approx(fraction, rel=1e-12)
        _close(mcore_to_hf_state(grads, arch), want, 1e-9)


@pytest.mark.world(2)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_dpo_and_critic_under_tp_sp_cp_and_dp(layout: str) -> None:
    """IPO (pi, ref and |o| over trained tokens) and the clipped value loss on masked rollouts, float64 1e-9."""
    from megatron_branch.losses import DPOObjective, ValueObjective
    from megatron_branch.models import build_critic

    hf = _hf()
    pairs = _mask(_dpo_rollouts(), seed=62)
    pairs = [dataclasses.replace(r, loss_mask=[*_m(r)[:-1], 1]) for r in pairs]  # every response trains
    tree = PrefixTree.build(pairs, vocab_size=VOCAB)
    dpo = DPOObjective(num_pairs=4, beta=0.5, loss_type="ipo")
    hf.zero_grad(set_to_none=True)
    pis = []
    for r in pairs:
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        logq = torch.log_softmax(hf(input_ids=seq).logits[0, :-1], dim=-1)
        lp = logq.gather(1, seq[0, 1:, None]).squeeze(1)[len(r.prompt) - 1 :]
        pis.append((lp * torch.tensor(_m(r), dtype=lp.dtype)).sum())
    oracle, _ = dpo.loss(tree, torch.stack(pis))
    oracle.backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters()}
    groups = _layout(layout)
    model = _policy(hf, groups, torch.float64)
    arch = ModelArch.from_hf_config(hf.config)
    for schedule in ("replay", "packed"):
        metrics, grads = _layout_grads(model, pairs, dpo, groups, schedule)
        assert metrics["actor/loss"] == pytest.approx(float(oracle), rel=1e-9)
        _close(mcore_to_hf_state(grads, arch), want, 1e-9)

    rng = random.Random(63)
    rollouts = [
        dataclasses.replace(
            r,
            token_fields={
                "values": tuple(rng.uniform(-1, 1) for _ in r.response),
                "returns": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )  # fmt: skip
        for r in _mask(_rollouts(), seed=64)
    ]
    objective = ValueObjective(agg=Aggregation.of_batch(rollouts, "seq-mean-token-mean"), clip=0.2)
    g = torch.Generator().manual_seed(6)
    head_w = torch.randn(1, hf.config.hidden_size, generator=g, dtype=torch.float64)
    head_b = torch.randn(1, generator=g, dtype=torch.float64)
    bound = objective.bind(PrefixTree.build(rollouts, vocab_size=VOCAB))
    w, b = head_w.clone().requires_grad_(), head_b.clone().requires_grad_()
    hf.zero_grad(set_to_none=True)
    for i, r in enumerate(rollouts):
        h = hf.model(input_ids=torch.tensor([list(r.prompt) + list(r.response)])).last_hidden_state[0, :-1]
        bound.rollout_loss(i, (h @ w.t() + b).squeeze(-1))[0].backward()
    critic = build_critic(
        arch, dtype=torch.float64, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel
    )
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(groups.tp_size))
    load_full_state(critic, {**state, "value_head.weight": head_w, "value_head.bias": head_b}, groups.tp)
    body = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    for schedule in ("replay", "packed"):
        _, full = _layout_grads(critic, rollouts, objective, groups, schedule)
        _close(
            {"w": full.pop("value_head.weight"), "b": full.pop("value_head.bias")},
            {"w": w.grad, "b": b.grad},
            1e-9,
        )
        _close({n: t for n, t in mcore_to_hf_state(full, arch).items() if n in body}, body, 1e-9)
