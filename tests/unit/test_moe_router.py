"""Router losses under sharing, routing replay and token dropping (losses/router.py, schedule/moe.py).

The reference is megatron-core's own router: its aux_loss, seq_aux_loss, global_aux_loss and z-loss computed by
its TopKRouter over one micro-batch that holds every rollout as its own sequence (a [s, b] batch). naive (every
rollout alone, with the micro-batch's counts), packed and replay (shared tokens once, rows weighted by
multiplicity) must give its loss and its gradient: float64 <= 1e-9 (measured ~1e-15: megatron's router softmax is
kept float64 by compat/moe.py), float32 <= 1e-5. Where megatron needs padding (rollouts of different lengths) its
token count is a float32 tensor (moe_utils.get_tokens_per_expert_and_token_count: a sum divided by topk), which
bounds the padded oracle at float32 (~6e-8): those trees are compared schedule against schedule at 1e-9.
"""

from __future__ import annotations

import pytest
import torch

from megatron_branch.checkpoint import hf_to_mcore_state, load_full_state
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses import PolicyGradientObjective, router_plan, routing
from megatron_branch.losses.logprobs import vocab_parallel_logprobs
from megatron_branch.losses.router import GlobalAuxState, MoEOptions, RouterLossConfig
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import hf_state, random_tree_rollouts, tiny_hf_config, tiny_hf_model

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
TREE = ("naive", "packed", "replay")


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.fixture(scope="module")
def qwen3_moe() -> tuple[ModelArch, dict[str, torch.Tensor]]:
    hf = tiny_hf_model(tiny_hf_config("qwen3_moe", ffn=48), seed=2, dtype=torch.float64)
    arch = ModelArch.from_hf_config(hf.config)
    return arch, hf_to_mcore_state(hf_state(hf), arch, padded_vocab=37)


def equal_length_rollouts() -> list[Rollout]:
    """Two prompt groups, a shared response beginning, every sequence 13 tokens (megatron's [s, b] batch)."""
    g = torch.Generator().manual_seed(5)

    def rand(n: int) -> list[int]:
        return [int(x) for x in torch.randint(0, 37, (n,), generator=g)]

    pa, pb = rand(7), rand(7)
    return [
        Rollout(prompt=pa, response=[3, 4, 5] + rand(3), advantage=1.0),
        Rollout(prompt=pa, response=[3, 4, 5] + rand(3), advantage=-0.5),
        Rollout(prompt=pa, response=rand(6), advantage=0.7),
        Rollout(prompt=pb, response=rand(6), advantage=-1.2),
        Rollout(prompt=pb, response=rand(6), advantage=0.3),
    ]


def model_of(state: dict, arch: ModelArch, dtype: torch.dtype, **overrides: object) -> torch.nn.Module:
    model = build_model(arch, dtype=dtype, **overrides)
    load_full_state(model, {k: v.to(dtype) for k, v in state.items()}, None)
    return model


def objective_of(rollouts: list[Rollout]) -> PolicyGradientObjective:
    T = sum(len(r.response) for r in rollouts)
    return PolicyGradientObjective.grpo([r.advantage for r in rollouts], T)


def megatron_losses(coeffs: RouterLossConfig) -> dict:
    """TransformerConfig overrides that turn megatron's own router losses on (the oracle)."""
    types = [n for n in ("aux_loss", "seq_aux_loss", "global_aux_loss") if getattr(coeffs, f"{n}_coeff")]
    kw: dict = {}
    if types:
        kw.update(
            moe_router_load_balancing_type=types,
            moe_aux_loss_coeff=[getattr(coeffs, f"{n}_coeff") for n in types],
        )
    if coeffs.z_loss_coeff:
        kw.update(moe_z_loss_coeff=coeffs.z_loss_coeff)
    return kw


def stock_step(model: torch.nn.Module, batches: list[list[Rollout]], obj: PolicyGradientObjective) -> dict:
    """megatron's router on [s, b] micro-batches (padded at the end, megatron's padding_mask: True = padding):
    the policy loss per rollout plus megatron's attached router losses, one backward per micro-batch."""
    model.zero_grad(set_to_none=True)
    coef = iter(obj.coef.tolist())
    for batch in batches:
        L, B = max(len(r.sequence) for r in batch), len(batch)
        ids = torch.zeros(B, L, dtype=torch.long)
        pad = torch.ones(B, L, dtype=torch.bool)
        for b, r in enumerate(batch):
            ids[b, : len(r.sequence)] = torch.tensor(r.sequence)
            pad[b, : len(r.sequence)] = False
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)[None, None]
        kw = {"padding_mask": pad} if pad.any() else {}
        logits = model(ids, torch.arange(L)[None].expand(B, L), mask, **kw)
        loss = logits.new_zeros(())
        for b, r in enumerate(batch):
            n = len(r.sequence)
            lp = vocab_parallel_logprobs(logits[b, : n - 1], ids[b, 1:n], vocab_size=37)
            loss = loss - next(coef) * lp[len(r.prompt) - 1 :].sum()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def schedule_step(
    model: torch.nn.Module, schedule: str, batches: list[list[Rollout]], obj_all: PolicyGradientObjective,
    losses: RouterLossConfig, **kw: object,
) -> tuple[dict, dict]:  # fmt: skip
    """Our schedule over the same micro-batches (the objective's coefficients of the whole batch)."""
    model.zero_grad(set_to_none=True)
    state = GlobalAuxState()
    stats: dict = {}
    at = 0
    for batch in batches:
        tree = PrefixTree.build(batch, vocab_size=37)
        obj = PolicyGradientObjective(coef=obj_all.coef[at : at + len(batch)])
        at += len(batch)
        opts = ScheduleOptions(
            vocab_size=37,
            branch_micro_batch=2,
            moe=MoEOptions(losses=losses, global_state=state),
            **{"chunk_tokens": None, **kw},
        )
        res = run_schedule(schedule, model, tree, obj, opts)
        for k, v in res.stats.items():
            stats[k] = stats.get(k, 0.0) + v
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def worst(got: dict, want: dict) -> tuple[float, str]:
    return max(
        (((got[n].double() - g.double()).norm() / g.double().norm().clamp_min(1e-30)).item(), n)
        for n, g in want.items()
    )


LOSSES = {
    "aux+z": RouterLossConfig(aux_loss_coeff=0.3, z_loss_coeff=0.05),
    "seq_aux": RouterLossConfig(seq_aux_loss_coeff=0.4),
    "all": RouterLossConfig(aux_loss_coeff=0.2, seq_aux_loss_coeff=0.4, z_loss_coeff=0.1),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_router_losses_equal_megatrons_on_one_micro_batch(qwen3_moe, dtype: torch.dtype) -> None:
    arch, state = qwen3_moe
    rollouts = equal_length_rollouts()
    obj = objective_of(rollouts)
    model = model_of(state, arch, dtype)
    without, _ = schedule_step(model, "packed", [rollouts], obj, RouterLossConfig())
    for which, losses in LOSSES.items():
        if dtype == torch.float32 and which != "all":
            continue
        want = stock_step(model_of(state, arch, dtype, **megatron_losses(losses)), [rollouts], obj)
        assert worst(without, want)[0] > 1e-4  # the losses do move the gradient
        for schedule in TREE:
            got, _ = schedule_step(model, schedule, [rollouts], obj, losses)
            assert worst(got, want)[0] <= TOL[dtype], (which, schedule, worst(got, want))


def test_metrics_are_megatrons_tracker_values(qwen3_moe) -> None:
    """load_balancing_loss / z_loss (megatron's tracker names) per layer: megatron's value (the loss over its
    coefficient), the same in every schedule; the headline is the mean over MoE layers. (megatron's tracker holds
    float32: compared at 1e-6.)"""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    arch, state = qwen3_moe
    losses = LOSSES["all"]
    rollouts = equal_length_rollouts()
    obj = objective_of(rollouts)
    clear_aux_losses_tracker()
    stock_step(model_of(state, arch, torch.float64, **megatron_losses(losses)), [rollouts], obj)
    tracker = get_moe_layer_wise_logging_tracker()
    model = model_of(state, arch, torch.float64)
    for schedule in TREE:
        _, stats = schedule_step(model, schedule, [rollouts], obj, losses)
        for name in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
            values = tracker[name]["values"]
            for layer in arch.moe_layers:
                assert stats[f"moe/{name}_layer_{layer}"] == pytest.approx(float(values[layer]), rel=1e-6)
            assert stats[name] == pytest.approx(float(values.sum()) / len(arch.moe_layers), rel=1e-6)
    clear_aux_losses_tracker()


def test_global_aux_loss_running_average_over_micro_batches(qwen3_moe) -> None:
    """global_aux_loss: megatron's counts averaged over the update's micro-batches so far (its
    global_tokens_per_expert / ga_steps): two micro-batches, each schedule against megatron's router."""
    arch, state = qwen3_moe
    losses = RouterLossConfig(global_aux_loss_coeff=0.5, aux_loss_coeff=0.1)
    rollouts = equal_length_rollouts()
    batches = [rollouts[:3], rollouts[3:]]
    obj = objective_of(rollouts)
    want = stock_step(model_of(state, arch, torch.float64, **megatron_losses(losses)), batches, obj)
    model = model_of(state, arch, torch.float64)
    for schedule in TREE:
        got, _ = schedule_step(model, schedule, batches, obj, losses)
        assert worst(got, want)[0] <= 1e-9, (schedule, worst(got, want))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_trees_of_any_shape_replay_equals_packed_equals_naive(qwen3_moe, dtype: torch.dtype) -> None:
    """The existing tree shapes (shared prompts, shared response beginnings, rollouts of different lengths): the
    schedules agree with each other at 1e-9 / 1e-5, and with megatron's padded batch within its float32 token
    count (rel 1e-6)."""
    arch, state = qwen3_moe
    losses = LOSSES["all"]
    rollouts = random_tree_rollouts(prompt_len=6, branches=3, levels=2, seed=11, seg_len=(1, 4))
    obj = objective_of(rollouts)
    model = model_of(state, arch, dtype)
    naive, naive_stats = schedule_step(model, "naive", [rollouts], obj, losses)
    for schedule in ("packed", "replay"):
        got, stats = schedule_step(model, schedule, [rollouts], obj, losses)
        assert worst(got, naive)[0] <= TOL[dtype], (schedule, worst(got, naive))
        for k in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
            assert stats[k] == pytest.approx(naive_stats[k], rel=TOL[dtype])
    if dtype == torch.float64:
        stock = stock_step(model_of(state, arch, dtype, **megatron_losses(LOSSES["aux+z"])), [rollouts], obj)
        got, _ = schedule_step(model, "replay", [rollouts], obj, LOSSES["aux+z"])
        assert worst(got, stock)[0] <= 1e-6


def test_replay_with_recompute_and_layer_checkpointing(qwen3_moe) -> None:
    """Per-layer recomputation re-attaches the router's rows (the recomputed graph must route and attach the same
    losses): replay + recompute + recompute_layers == naive, and the metrics are counted once."""
    arch, state = qwen3_moe
    losses = LOSSES["all"]
    rollouts = random_tree_rollouts(prompt_len=6, branches=3, levels=2, seed=3)
    obj = objective_of(rollouts)
    model = model_of(state, arch, torch.float64)
    naive, naive_stats = schedule_step(model, "naive", [rollouts], obj, losses)
    got, stats = schedule_step(
        model, "replay", [rollouts], obj, losses, recompute=True, recompute_layers=True
    )
    assert worst(got, naive)[0] <= 1e-9
    assert stats["z_loss"] == pytest.approx(naive_stats["z_loss"], rel=1e-9)
    layer = arch.moe_layers[0]
    key = f"moe/tokens_per_expert/logical/layer_{layer}/expert_0"
    assert stats[key] == naive_stats[f"moe/tokens_per_expert/computed/layer_{layer}/expert_0"]


def test_planted_bug_dropping_multiplicity_fails(qwen3_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights of 1 for shared rows (a shared token counted once, not once per rollout): the losses and the
    gradient no longer equal naive training's."""
    arch, state = qwen3_moe
    rollouts = random_tree_rollouts(prompt_len=6, branches=3, levels=2, seed=3)
    obj = objective_of(rollouts)
    model = model_of(state, arch, torch.float64)
    naive, _ = schedule_step(model, "naive", [rollouts], obj, LOSSES["aux+z"])
    monkeypatch.setattr(
        router_plan, "token_multiplicity", lambda member: torch.ones(member.shape[0], dtype=member.dtype)
    )
    for schedule in ("packed", "replay"):
        got, _ = schedule_step(model, schedule, [rollouts], obj, LOSSES["aux+z"])
        assert worst(got, naive)[0] > 1e-4, schedule


def test_training_forward_must_route_as_the_counting_pass(qwen3_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that routes differently in training than in the counting pass (non-determinism) is refused: the
    counts the losses multiply would not be the batch's."""
    arch, state = qwen3_moe
    rollouts = random_tree_rollouts(prompt_len=6, branches=3, levels=1, seed=3)
    model = model_of(state, arch, torch.float64)
    real = routing.RowContext.route

    def drifting(self, router, logits):  # noqa: ANN001, ANN202
        if not self.plan.counting and torch.is_grad_enabled():
            logits = logits + torch.linspace(0, 50, logits.shape[-1], dtype=logits.dtype)  # another top-k
        return real(self, router, logits)

    monkeypatch.setattr(routing.RowContext, "route", drifting)
    with pytest.raises(RuntimeError, match="routed differently from the counting pass"):
        schedule_step(model, "packed", [rollouts], objective_of(rollouts), LOSSES["aux+z"])


def test_token_dropping_refused_by_tree_schedules(qwen3_moe) -> None:
    """A capacity factor makes an expert's kept tokens depend on its batch: packed and replay refuse it in one
    line; naive (every rollout alone) runs it."""
    arch, state = qwen3_moe
    rollouts = random_tree_rollouts(prompt_len=6, branches=3, levels=1, seed=3)
    model = model_of(state, arch, torch.float64, moe_expert_capacity_factor=0.5)
    for schedule in ("packed", "replay"):
        with pytest.raises(UserError, match="token dropping") as e:
            schedule_step(model, schedule, [rollouts], objective_of(rollouts), RouterLossConfig())
        assert "\n" not in str(e.value)
    dropped, _ = schedule_step(model, "naive", [rollouts], objective_of(rollouts), RouterLossConfig())
    dropless, _ = schedule_step(model_of(state, arch, torch.float64), "naive", [rollouts], objective_of(rollouts),
                                RouterLossConfig())  # fmt: skip
    assert worst(dropped, dropless)[0] > 1e-3  # tokens over capacity were dropped


def test_router_loss_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="aux_loss_coeff must be a finite number >= 0"):
        RouterLossConfig(aux_loss_coeff=-1.0)
    with pytest.raises(ValueError, match="z_loss_coeff"):
        RouterLossConfig(z_loss_coeff=float("nan"))


def _micro_batch_step(model: torch.nn.Module, schedule: str, rollouts: list[Rollout], batches, obj, losses):
    """One tree over every rollout, the router losses per micro-batch (MoEOptions.micro_batches: verl's engine)."""
    model.zero_grad(set_to_none=True)
    tree = PrefixTree.build(rollouts, vocab_size=37)
    opts = ScheduleOptions(
        vocab_size=37,
        branch_micro_batch=2,
        moe=MoEOptions(losses=losses, micro_batches=batches),
        chunk_tokens=None,
    )
    run_schedule(schedule, model, tree, obj, opts)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_router_losses_per_micro_batch_in_one_tree(qwen3_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's engine: one tree holds several megatron micro-batches; each micro-batch's aux and z losses over its
    own tokens (megatron's router on that micro-batch alone, one backward each) == the tree with
    MoEOptions.micro_batches (fp64 1e-9), a prompt shared across the two micro-batches and a response beginning
    inside one; seq_aux_loss with a micro-batch as its one sequence (verl packs THD, bsz 1) == megatron's aux_loss
    with that coefficient. Planted: a shared token counted once per micro-batch, not once per rollout, fails."""
    arch, state = qwen3_moe
    rollouts = equal_length_rollouts()
    batches = [rollouts[:2], rollouts[2:]]
    parts = ((0, 1), (2, 3, 4))
    obj = objective_of(rollouts)
    model = model_of(state, arch, torch.float64)
    cases = {
        "aux+z": (LOSSES["aux+z"], LOSSES["aux+z"]),
        "seq_aux": (RouterLossConfig(seq_aux_loss_coeff=0.4), RouterLossConfig(aux_loss_coeff=0.4)),
    }
    for which, (ours, megatrons) in cases.items():
        want = stock_step(model_of(state, arch, torch.float64, **megatron_losses(megatrons)), batches, obj)
        whole = _micro_batch_step(model, "packed", rollouts, None, obj, ours)  # one micro-batch: not verl's
        assert worst(whole, want)[0] > 1e-6, which
        for schedule in TREE:
            got = _micro_batch_step(model, schedule, rollouts, parts, obj, ours)
            assert worst(got, want)[0] <= 1e-9, (which, schedule, worst(got, want))
    monkeypatch.setattr(
        router_plan.RouterPlan,
        "_batch_rows",
        lambda self, b, R: (self.member @ self._batch_member(b, R).t()).clamp(max=1.0),
    )
    got = _micro_batch_step(model, "packed", rollouts, parts, obj, LOSSES["aux+z"])
    want = stock_step(model_of(state, arch, torch.float64, **megatron_losses(LOSSES["aux+z"])), batches, obj)
    assert worst(got, want)[0] > 1e-6
