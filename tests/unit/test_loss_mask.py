"""Per-token loss masks (issue 31): context tokens inside a response (loss_mask 0: a tool's output) condition later
tokens but carry no loss term and count in no token count, exactly, in every schedule and objective.

The oracle is per-rollout training written here from the formulas (verl's `agg_loss` with the mask): every rollout
run alone through the model with autograd, its masked per-token terms summed with plain torch. The test trees
share RESPONSE tokens, and the masks are per rollout: at some shared tokens one rollout trains and another does
not (asserted), one rollout is wholly masked (the sequence modes must not count it), one has an empty prompt.
Planted bugs (mask ignored, masked tokens counted, KL/entropy unmasked, an all-zero rollout counted, a shared
token's mask taken from the wrong rollout) each fail the comparison.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import AdvantagePolicyGradient, ValueObjective
from megatron_branch.losses.aggregation import AGG_MODES, Aggregation
from megatron_branch.losses.dpo import DPOObjective
from megatron_branch.losses.policy import PolicyObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model

VOCAB = 37
NORM = 7.0
SCHEDULES = [
    ("naive", {}),
    ("packed", {}),
    ("replay", {}),
    ("replay", {"recompute": True, "branch_micro_batch": 2}),
    ("naive-fused", {}),
    ("packed-nosharing", {}),
]


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def masked_rollouts(seed: int) -> list[Rollout]:
    """A tree sharing response tokens, random per-rollout masks (30% context), one all-zero rollout, one with an
    empty prompt; per-token advantages, old and reference logprobs around -3."""
    rng = random.Random(seed)
    rs = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 4), seed=seed)
    rs.append(Rollout(prompt=(), response=(3, 1, 4, 1, 5), advantage=0.5))
    out = []
    for k, r in enumerate(rs):
        n = len(r.response)
        mask = [0] * n if k == 2 else [int(rng.random() > 0.3) for _ in range(n)]
        if k != 2 and not any(mask[1:]):
            mask[-1] = 1
        fields = {
            "advantages": tuple(rng.uniform(-2, 2) for _ in range(n)),
            "old_logprobs": tuple(rng.uniform(-4.5, -2.0) for _ in range(n)),
            "ref_logprobs": tuple(rng.uniform(-5.0, -1.5) for _ in range(n)),
        }
        out.append(dataclasses.replace(r, token_fields=fields, loss_mask=mask))
    return out


def mask_of(r: Rollout) -> tuple[bool, ...]:
    return r.loss_mask or (True,) * len(r.response)


def test_premise_masks_differ_at_shared_tokens_and_one_rollout_is_all_context() -> None:
    rs = masked_rollouts(5)
    tree = PrefixTree.build(rs, vocab_size=VOCAB)
    seen: dict[int, set[bool]] = {}
    for i, r in enumerate(rs):
        for j, t in enumerate(tree.response_indices(i).tolist()):
            seen.setdefault(t, set()).add(mask_of(r)[j])
    assert any(len(v) == 2 for v in seen.values())  # trained for one rollout, context for another
    assert sum(r.num_trained == 0 for r in rs) == 1
    assert tree.positions_computed < tree.positions_logical


# ---- the oracle: per-rollout training from the formulas ---------------------------------------------------------


def per_rollout(model: torch.nn.Module, r: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [n], entropy [n], mask [n] float64) of rollout r's response tokens that have a predictor, run alone."""
    seq = torch.tensor(r.prompt + r.response)
    causal = torch.triu(torch.ones(len(seq), len(seq), dtype=torch.bool), diagonal=1)[None, None]
    logits = model(seq[None], torch.arange(len(seq))[None], causal)[0, :-1, :VOCAB]
    logq = torch.log_softmax(logits, -1)
    lp = logq.gather(1, seq[1:, None]).squeeze(1)
    ent = -(logq.exp() * logq).sum(-1)
    first = len(r.prompt) - 1 if r.prompt else 0
    mask = torch.tensor(r.loss_mask or [1] * len(r.response), dtype=torch.float64)
    return lp[first:], ent[first:], (mask if r.prompt else mask[1:])


def field(r: Rollout, name: str) -> torch.Tensor:
    vals = torch.tensor(r.field(name), dtype=torch.float64)
    return vals if r.prompt else vals[1:]


def agg_weight(rollouts: list[Rollout], r: Rollout, mode: str) -> float:
    """verl's agg_loss with loss_mask over the whole batch, as the weight of each of r's masked terms."""
    n = sum(r.loss_mask or [1] * len(r.response))  # trained tokens (an empty prompt's first token included)
    T = sum(sum(x.loss_mask or [1] * len(x.response)) for x in rollouts)
    N = sum(any(x.loss_mask or [1]) for x in rollouts)  # verl's seq_mask: only rollouts with a trained token
    if n == 0:
        return 0.0
    return {
        "token-mean": 1 / T,
        "token-sum": 1.0,
        "seq-mean-token-mean": 1 / (N * n),
        "seq-mean-token-sum": 1 / N,
        "seq-mean-token-sum-norm": 1 / (N * NORM),
    }[mode]


def policy_terms(x: torch.Tensor, h: torch.Tensor, r: Rollout, case: dict) -> torch.Tensor:
    a, old, ref = field(r, "advantages"), field(r, "old_logprobs"), field(r, "ref_logprobs")
    ratio = (x - old).clamp(-20, 20).exp()
    pg = torch.maximum(
        -a * ratio, -a * ratio.clamp(0.8, 1.2 if "clip_high" not in case else 1 + case["clip_high"])
    )
    if case.get("clip_c"):
        pg = torch.where(a < 0, torch.minimum(pg, -a * case["clip_c"]), pg)
    d = (ref - x).clamp(-20, 20)
    kl = {"k1": x - ref, "k3": (d.exp() - d - 1).clamp(-10, 10)}[case.get("kl_type", "k1")]
    return pg + case.get("kl_coef", 0.0) * kl - case.get("entropy_coef", 0.0) * h


def oracle(model: torch.nn.Module, rollouts: list[Rollout], loss_of) -> tuple[float, dict]:  # noqa: ANN001
    """(loss, grads) of sum over rollouts of loss_of(r, logp, entropy, mask), each rollout alone, autograd."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for r in rollouts:
        total = total + loss_of(r, *per_rollout(model, r))
    total.backward()
    return float(total), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def run(model, rollouts, objective, schedule, **kw):  # noqa: ANN001, ANN201
    model.zero_grad(set_to_none=True)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    res = run_schedule(
        schedule, model, tree, objective, ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    )
    return res, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_err(got: dict, want: dict) -> float:
    return max(((got[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in want.items())


POLICY = {
    "clip": dict(),
    "dual_clip_higher": dict(clip_high=0.28, clip_c=3.0),
    "kl_k1": dict(kl_coef=0.3, kl_type="k1"),
    "kl_k3": dict(kl_coef=0.3, kl_type="k3"),
    "entropy": dict(entropy_coef=0.05),
    **{f"agg_{m}": dict(agg=m, kl_coef=0.1, kl_type="k3", entropy_coef=0.02) for m in AGG_MODES},
}


def policy_objective(rollouts: list[Rollout], case: dict) -> PolicyObjective:
    kw = {k: v for k, v in case.items() if k != "agg"}
    mode = case.get("agg", "token-mean")
    agg = Aggregation.of_batch(rollouts, mode, norm=NORM if mode.endswith("norm") else None)
    return PolicyObjective(agg=agg, clip_low=0.2, **{"clip_high": 0.2, **kw})


def policy_oracle(model, rollouts, case):  # noqa: ANN001, ANN201
    mode = case.get("agg", "token-mean")

    def loss_of(r: Rollout, x: torch.Tensor, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return agg_weight(rollouts, r, mode) * (m * policy_terms(x, h, r, case)).sum()

    return oracle(model, rollouts, loss_of)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(POLICY))
def test_policy_every_schedule_equals_per_rollout_training_float64(case: str) -> None:
    model = tiny_branch_model(torch.float64, seed=1)
    rollouts = masked_rollouts(5)
    want_loss, want = policy_oracle(model, rollouts, POLICY[case])
    obj = policy_objective(rollouts, POLICY[case])
    for schedule, kw in SCHEDULES:
        res, got = run(model, rollouts, obj, schedule, **kw)
        assert res.loss == pytest.approx(want_loss, rel=1e-11), schedule
        assert max_err(got, want) <= 1e-9, schedule


@pytest.mark.slow
def test_policy_float32_tree_schedules_equal_per_rollout_training() -> None:
    """float32 model: the tree schedules against the same per-rollout oracle, 1e-5 per parameter."""
    model = tiny_branch_model(torch.float32, seed=2)
    rollouts = masked_rollouts(8)
    case = POLICY["agg_seq-mean-token-mean"]
    _, want = policy_oracle(model, rollouts, case)
    for schedule, kw in SCHEDULES[1:4]:
        _, got = run(model, rollouts, policy_objective(rollouts, case), schedule, **kw)
        assert max_err(got, want) <= 1e-5, schedule


def test_pg_and_metrics_count_trained_tokens_only() -> None:
    """The linear pg objective (grad's default) and the token-mean metrics: T = trained tokens."""
    model = tiny_branch_model(torch.float64, seed=2)
    rollouts = [dataclasses.replace(r, advantage=r.field("advantages")[0]) for r in masked_rollouts(6)]
    T = sum(r.num_trained for r in rollouts)
    assert T < sum(len(r.response) for r in rollouts)

    def loss_of(r: Rollout, x: torch.Tensor, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return -(r.advantage / T) * (m * x).sum()

    want_loss, want = oracle(model, rollouts, loss_of)
    obj = AdvantagePolicyGradient(num_response_tokens=T)
    for schedule, kw in SCHEDULES:
        res, got = run(model, rollouts, obj, schedule, **kw)
        assert res.loss == pytest.approx(want_loss, rel=1e-11) and max_err(got, want) <= 1e-9, schedule
    # clip fraction and ppo_kl: means over the trained tokens (a masked token with a clipped ratio counts nowhere)
    res, _ = run(model, rollouts, policy_objective(rollouts, {}), "replay")
    lp = score_rollouts(
        "naive", model, PrefixTree.build(rollouts, vocab_size=VOCAB), ScheduleOptions(vocab_size=VOCAB)
    )
    ppo_kl = sum(
        (field(r, "old_logprobs") - lp.logprobs[i][0 if r.prompt else 1 :])[
            per_rollout(model, r)[2].bool()
        ].sum()
        for i, r in enumerate(rollouts)
    )
    assert res.stats["actor/ppo_kl"] == pytest.approx(float(ppo_kl) / T, rel=1e-10)


def test_all_ones_mask_is_bit_identical_to_no_mask() -> None:
    model = tiny_branch_model(torch.float64, seed=3)
    plain = [dataclasses.replace(r, loss_mask=None) for r in masked_rollouts(7)]
    ones = [dataclasses.replace(r, loss_mask=[1] * len(r.response)) for r in plain]
    for schedule in ("naive", "replay"):
        a, ga = run(model, plain, policy_objective(plain, POLICY["agg_seq-mean-token-mean"]), schedule)
        b, gb = run(model, ones, policy_objective(ones, POLICY["agg_seq-mean-token-mean"]), schedule)
        assert a.loss == b.loss and a.stats == b.stats
        assert all(torch.equal(ga[n], gb[n]) for n in ga)


# ---- planted bugs: each must fail the comparison with the oracle -----------------------------------------------


def _tree_level_masks(rollouts: list[Rollout]) -> list[Rollout]:
    """The bug of a mask per TREE token: every rollout takes, at a shared token, the first holder's mask."""
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    first: dict[int, bool] = {}
    for i, r in enumerate(rollouts):
        for j, t in enumerate(tree.response_indices(i).tolist()):
            first.setdefault(t, mask_of(r)[j])
    return [
        dataclasses.replace(r, loss_mask=[first[t] for t in tree.response_indices(i).tolist()])
        for i, r in enumerate(rollouts)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["mask_ignored", "masked_counted", "kl_entropy_unmasked", "zero_rollout_counted",
                                 "wrong_rollouts_mask"])  # fmt: skip
def test_planted_bugs_fail(bug: str) -> None:
    model = tiny_branch_model(torch.float64, seed=1)
    rollouts = masked_rollouts(5)
    case = POLICY["agg_seq-mean-token-sum"] if bug == "zero_rollout_counted" else POLICY["agg_token-mean"]
    _, want = policy_oracle(model, rollouts, case)
    good = policy_objective(rollouts, case)
    nomask = [dataclasses.replace(r, loss_mask=None) for r in rollouts]
    if bug == "mask_ignored":
        bad_rollouts, obj = nomask, policy_objective(nomask, case)
    elif bug == "masked_counted":  # right pairs, but the normaliser counts every response token
        bad_rollouts, obj = (
            rollouts,
            dataclasses.replace(good, agg=Aggregation.of_batch(nomask, "token-mean")),
        )
    elif bug == "kl_entropy_unmasked":  # masking by zeroing the advantage: pg vanishes, KL and entropy stay
        bad_rollouts = [
            dataclasses.replace(
                r,
                loss_mask=None,
                token_fields={
                    **r.token_fields,
                    "advantages": tuple(a if m else 0.0 for a, m in zip(r.field("advantages"), mask_of(r))),
                },
            )  # fmt: skip
            for r in rollouts
        ]
        obj = good
    elif bug == "zero_rollout_counted":
        agg = dataclasses.replace(good.agg, num_rollouts=len(rollouts))
        bad_rollouts, obj = rollouts, dataclasses.replace(good, agg=agg)
    else:
        bad_rollouts, obj = _tree_level_masks(rollouts), good
        assert bad_rollouts != rollouts
    _, ok = run(model, rollouts, good, "packed")
    assert max_err(ok, want) <= 1e-9
    _, got = run(model, bad_rollouts, obj, "packed")
    assert max_err(got, want) > 1e-4, bug


# ---- DPO and the critic ---------------------------------------------------------------------------------------


def dpo_rollouts(seed: int) -> list[Rollout]:
    """Pairs sharing a prompt and a response start; masks differ inside the shared start."""
    rng = random.Random(seed)
    out = []
    for k in range(3):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(4 + k))
        common = tuple(rng.randrange(VOCAB) for _ in range(3))
        for chosen, first in ((True, 1), (False, 2)):
            resp = common + (first,) + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 4)))
            mask = [int(rng.random() > 0.35) for _ in resp]
            mask[3] = 1
            ref = tuple(rng.uniform(-4.5, -2.5) for _ in resp)
            out.append(Rollout(prompt=prompt, response=resp, pair=f"p{k}", chosen=chosen, loss_mask=mask,
                               token_fields={"ref_logprobs": ref}))  # fmt: skip
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_sums_trained_tokens_only(kind: str) -> None:
    model = tiny_branch_model(torch.float64, seed=4)
    rollouts = dpo_rollouts(8)
    assert any(r.loss_mask is not None and not all(r.loss_mask[:3]) for r in rollouts)
    dpo = DPOObjective(num_pairs=3, beta=0.5, loss_type=kind)
    model.zero_grad(set_to_none=True)
    logratio = {}
    for r in rollouts:
        x, _, m = per_rollout(model, r)
        logratio[(r.pair, r.chosen)] = ((x - field(r, "ref_logprobs")) * m).sum() / (
            m.sum() if kind == "ipo" else 1.0
        )
    total = torch.zeros((), dtype=torch.float64)
    for k in range(3):
        c, rj = logratio[(f"p{k}", True)], logratio[(f"p{k}", False)]
        if kind == "sigmoid":
            total = total - torch.nn.functional.logsigmoid(0.5 * (c - rj)) / 3
        else:
            total = total + ((c - rj) - 1 / (2 * 0.5)).square() / 3
    total.backward()
    want = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    for schedule, kw in SCHEDULES[:3]:
        pi = score_rollouts(
            schedule, model, tree, ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
        ).sums()
        lin, loss, _ = dpo.linearise(tree, pi)
        _, got = run(model, rollouts, lin, schedule, **kw)
        assert loss == pytest.approx(float(total), rel=1e-11) and max_err(got, want) <= 1e-9, schedule
    # planted: the unmasked sums give another loss
    nomask = PrefixTree.build([dataclasses.replace(r, loss_mask=None) for r in rollouts], vocab_size=VOCAB)
    pi = score_rollouts("naive", model, nomask, ScheduleOptions(vocab_size=VOCAB)).sums()
    assert abs(dpo.linearise(nomask, pi)[1] - float(total)) > 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_masked_equals_plain_formula(mode: str) -> None:
    from megatron_branch.models import ModelArch, build_critic

    torch.manual_seed(0)
    arch = ModelArch(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=64)  # fmt: skip
    model = build_critic(arch, dtype=torch.float64, head_seed=0, head_std=0.5)
    rng = random.Random(3)
    rollouts = [
        dataclasses.replace(
            r,
            token_fields={
                "values": tuple(rng.uniform(-1, 1) for _ in r.response),
                "returns": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )  # fmt: skip
        for r in masked_rollouts(9)
    ]
    obj = ValueObjective(agg=Aggregation.of_batch(rollouts, mode), clip=0.5)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    naive, want = run(model, rollouts, obj, "naive")
    v = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB)).logprobs
    loss = 0.0
    for i, r in enumerate(rollouts):
        x, m = v[i][0 if r.prompt else 1 :], per_rollout_mask(r)
        ret, old = field(r, "returns"), field(r, "values")
        vf = 0.5 * torch.maximum(
            (x - ret).square(), (torch.minimum(torch.maximum(x, old - 0.5), old + 0.5) - ret).square()
        )
        loss += agg_weight(rollouts, r, mode) * float((vf * m).sum())
    assert naive.loss == pytest.approx(loss, rel=1e-12)
    for schedule, kw in SCHEDULES[1:]:
        res, got = run(model, rollouts, obj, schedule, **kw)
        assert res.loss == pytest.approx(loss, rel=1e-11) and max_err(got, want) <= 1e-9, schedule
    unmasked = [dataclasses.replace(r, loss_mask=None) for r in rollouts]
    bad, _ = run(model, unmasked, ValueObjective(agg=Aggregation.of_batch(unmasked, mode), clip=0.5), "naive")
    assert abs(bad.loss - loss) > 1e-6


def per_rollout_mask(r: Rollout) -> torch.Tensor:
    mask = torch.tensor(r.loss_mask or [1] * len(r.response), dtype=torch.float64)
    return mask if r.prompt else mask[1:]


def test_all_masked_batch_is_refused_and_token_sum_exists() -> None:
    rs = [Rollout(prompt=(1,), response=(2, 3), advantage=1.0, loss_mask=[0, 0])]
    with pytest.raises(ValueError, match="no trained response tokens"):
        Aggregation.of_batch(rs)
    assert "token-sum" in AGG_MODES
    agg = Aggregation.of_batch(masked_rollouts(5), "token-sum")
    assert agg.rollout_weight(3) == 1.0 and agg.rollout_weight(0) == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_weights_equal_verls_agg_loss(mode: str) -> None:
    """Our per-rollout weights on a masked batch == verl's own agg_loss with that loss_mask over the whole batch
    (padding masked too; one wholly masked rollout; verl's 1e-8 in seq-mean-token-mean bounds the tolerance)."""
    verl_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(11)
    lengths, width = [5, 3, 6, 4, 2], 6
    loss = torch.randn(len(lengths), width, generator=g, dtype=torch.float64)
    mask = torch.zeros(len(lengths), width, dtype=torch.float64)
    rollouts = []
    for i, n in enumerate(lengths):
        m = [0] * n if i == 3 else [int(x) for x in (torch.rand(n, generator=g) > 0.3)]
        m[0] = int(i != 3)
        mask[i, :n] = torch.tensor(m, dtype=torch.float64)
        rollouts.append(Rollout(prompt=(1,), response=(2,) * n, loss_mask=m))
    norm = NORM if mode.endswith("norm") else None
    agg = Aggregation.of_batch(rollouts, mode, norm=norm)
    ours = sum(
        agg.rollout_weight(r.num_trained) * float((loss[i] * mask[i]).sum()) for i, r in enumerate(rollouts)
    )
    want = verl_algos.agg_loss(loss, mask, mode, loss_scale_factor=norm)
    assert ours == pytest.approx(float(want), rel=1e-7)
