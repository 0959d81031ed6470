"""The RL objectives under sharing: packed and replay gradients equal naive per parameter, and each loss equals a
plain per-rollout formula written here independently.

The trees share RESPONSE tokens (two levels below the prompt), and every rollout gets its own old logprobs (a
per-token shift of its own current logprob, so r = e^shift) and advantages of both signs: at the same shared
token clipping is active for some rollouts and not for others (asserted).
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.dpo import DPOObjective, preference_pairs
from megatron_branch.losses.policy import PolicyObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model

VOCAB = 37
SHIFTS = (
    -1.5,
    -0.5,
    -0.1,
    0.05,
    0.4,
    1.3,
)  # r = e^shift: clipped below, unclipped, above, past the dual clip


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def policy_data(model: torch.nn.Module, rollouts: list[Rollout], seed: int) -> list[Rollout]:
    """Rollouts with old/ref logprobs and per-token advantages around the model's own current logprobs."""
    rng = random.Random(seed)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    lp = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB)).logprobs
    out = []
    for i, r in enumerate(rollouts):
        cur = lp[i].nan_to_num(-1.0).tolist()
        old = [c - rng.choice(SHIFTS) for c in cur]
        ref = [c + rng.uniform(-3.5, 0.5) for c in cur]
        adv = [rng.uniform(-2, 2) for _ in cur]
        fields = {"old_logprobs": tuple(old), "ref_logprobs": tuple(ref), "advantages": tuple(adv)}
        out.append(dataclasses.replace(r, token_fields=fields))
    return out


def grads_of(model, tree, objective, schedule, dtype=torch.float64, **kw):  # noqa: ANN001, ANN201
    model.zero_grad(set_to_none=True)
    opts = ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    res = run_schedule(schedule, model, tree, objective, opts)
    return res, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, tol: float) -> None:
    for name in want:
        err = ((got[name] - want[name]).double().norm() / want[name].double().norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def rollouts_for(seed: int) -> list[Rollout]:
    rs = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 4), seed=seed)
    return rs + [Rollout(prompt=(), response=(3, 1, 4, 1), advantage=0.5)]  # an empty prompt too


AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_CASES = {
    "clip": dict(),
    "clip_higher": dict(clip_low=0.2, clip_high=0.28),
    "dual_clip": dict(clip_c=3.0),
    "kl_k1": dict(kl_coef=0.3, kl_type="k1"),
    "kl_k2": dict(kl_coef=0.3, kl_type="mse"),
    "kl_k3": dict(kl_coef=0.3, kl_type="low_var_kl"),
    "entropy": dict(entropy_coef=0.05),
    "all": dict(clip_c=3.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.01),
    **{f"agg_{m}": dict(agg=m) for m in AGG[1:]},
}


def make_policy(rollouts: list[Rollout], case: dict) -> PolicyObjective:
    kw = dict(case)
    mode = kw.pop("agg", "token-mean")
    agg = Aggregation.of_batch(rollouts, mode, norm=7.0 if mode.endswith("norm") else None)
    return PolicyObjective(agg=agg, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_policy_packed_and_replay_equal_naive_float64(case: str) -> None:
    model = tiny_branch_model(torch.float64, seed=1)
    rollouts = policy_data(model, rollouts_for(5), seed=6)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = make_policy(rollouts, POLICY_CASES[case])
    naive, want = grads_of(model, tree, obj, "naive")
    assert 0 < naive.stats["actor/pg_clipfrac"] < 1
    for schedule, kw in [
        ("packed", {}),
        ("replay", {}),
        ("replay", {"recompute": True, "branch_micro_batch": 2}),
    ]:
        res, got = grads_of(model, tree, obj, schedule, **kw)
        assert res.loss == pytest.approx(naive.loss, rel=1e-11, abs=1e-14)
        assert_grads_close(got, want, 1e-9)
        assert res.stats.keys() == naive.stats.keys()
        for k, v in naive.stats.items():
            assert res.stats[k] == pytest.approx(v, rel=1e-10, abs=1e-14), k


@pytest.mark.slow
def test_policy_float32_packed_and_replay_equal_naive() -> None:
    model = tiny_branch_model(torch.float32, seed=2)
    rollouts = policy_data(model, rollouts_for(8), seed=9)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = make_policy(rollouts, POLICY_CASES["all"])
    _, want = grads_of(model, tree, obj, "naive")
    for schedule in ("packed", "replay"):
        _, got = grads_of(model, tree, obj, schedule)
        assert_grads_close(got, want, 1e-5)


def test_shared_tokens_are_clipped_for_some_rollouts_only() -> None:
    """The premise of the parity tests: at one shared response token, one rollout's term is clipped, another's not."""
    model = tiny_branch_model(torch.float64, seed=1)
    rollouts = policy_data(model, rollouts_for(5), seed=6)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    lp = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB)).logprobs
    clipped: dict[int, set[bool]] = {}
    for i, r in enumerate(rollouts):
        idx = tree.response_indices(i)
        for j in range(len(r.response)):
            if math.isnan(lp[i][j]):
                continue
            ratio = math.exp(lp[i][j] - r.field("old_logprobs")[j])
            a = r.field("advantages")[j]
            clipped.setdefault(int(idx[j]), set()).add((a > 0 and ratio > 1.2) or (a < 0 and ratio < 0.8))
    assert any(len(v) == 2 for v in clipped.values())


def plain_policy_loss(rollouts, lp, ent, cfg):  # noqa: ANN001, ANN201
    """The policy loss and metrics, rollout by rollout, in plain Python floats (written from the formulas)."""
    n_tok = sum(len(r.response) for r in rollouts)
    n = len(rollouts)
    loss = pg_sum = kl_sum = ent_sum = 0.0
    clip_n = lower_n = ppo_kl = 0.0
    for i, r in enumerate(rollouts):
        if cfg["agg"] == "token-mean":
            w = 1 / n_tok
        elif cfg["agg"] == "seq-mean-token-mean":
            w = 1 / (n * len(r.response))
        elif cfg["agg"] == "seq-mean-token-sum":
            w = 1 / n
        else:
            w = 1 / (n * cfg["norm"])
        for j in range(len(r.response)):
            x = float(lp[i][j])
            if math.isnan(x):
                continue
            a, old, ref, h = (
                r.field("advantages")[j],
                r.field("old_logprobs")[j],
                r.field("ref_logprobs")[j],
                ent[i][j],
            )
            lr = min(max(x - old, -20.0), 20.0)
            ratio = math.exp(lr)
            u = -a * ratio
            c = -a * min(max(ratio, 1 - cfg["clip_low"]), 1 + cfg["clip_high"])
            pg = max(u, c)
            clip_n += c > u
            if cfg["clip_c"] is not None and a < 0:
                lower_n += pg > -a * cfg["clip_c"]
                pg = min(pg, -a * cfg["clip_c"])
            d = min(max(ref - x, -20.0), 20.0)
            kl = {
                "k1": x - ref,
                "k2": 0.5 * (x - ref) ** 2,
                "k3": min(max(math.exp(d) - d - 1, -10.0), 10.0),
            }[cfg["kl"]]
            loss += w * (pg + cfg["kl_coef"] * kl - cfg["ent_coef"] * float(h))
            pg_sum += w * pg
            kl_sum += w * kl
            ent_sum += w * float(h)
            ppo_kl += -lr / n_tok
    metrics = {
        "actor/pg_loss": pg_sum,
        "actor/kl_loss": kl_sum,
        "actor/entropy": ent_sum,
        "actor/pg_clipfrac": clip_n / n_tok,
        "actor/pg_clipfrac_lower": lower_n / n_tok,
        "actor/ppo_kl": ppo_kl,
    }
    return loss, metrics


@pytest.mark.parametrize(
    ("mode", "kl"), [(m, "k3") for m in AGG] + [("token-mean", "k1"), ("token-mean", "k2")]
)
def test_policy_loss_and_metrics_equal_plain_formula(mode: str, kl: str) -> None:
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = policy_data(model, rollouts_for(12), seed=13)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    norm = 6.0 if mode.endswith("norm") else None
    cfg = dict(
        agg=mode, norm=norm, clip_low=0.2, clip_high=0.3, clip_c=3.0, kl=kl, kl_coef=0.2, ent_coef=0.03
    )
    obj = PolicyObjective(
        agg=Aggregation.of_batch(rollouts, mode, norm=norm),
        clip_low=0.2,
        clip_high=0.3,
        clip_c=3.0,
        kl_coef=0.2,
        kl_type=kl,
        entropy_coef=0.03,
    )
    sc = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB), entropy=True)
    want, metrics = plain_policy_loss(rollouts, sc.logprobs, sc.entropy, cfg)
    for schedule in ("naive", "replay"):
        res, _ = grads_of(model, tree, obj, schedule)
        assert res.loss == pytest.approx(want, rel=1e-12, abs=1e-15)
        for k, v in metrics.items():
            assert res.stats[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert metrics["actor/pg_clipfrac_lower"] > 0 and metrics["actor/pg_clipfrac"] > 0


def test_grpo_without_clipping_kl_entropy_is_pg_token_mean() -> None:
    model = tiny_branch_model(torch.float64, seed=4)
    rollouts = rollouts_for(3)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    pg = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    grpo = PolicyObjective(agg=Aggregation.of_batch(rollouts), clip_low=None, clip_high=None)
    a, ga = grads_of(model, tree, pg, "replay")
    b, gb = grads_of(model, tree, grpo, "replay")
    # the values differ by design (-A r with r = 1 vs -A logp); the gradients are the same
    assert b.loss == pytest.approx(
        -sum(r.advantage * (len(r.response) - (not r.prompt)) for r in rollouts)
        / tree.num_response_tokens_logical(),
        rel=1e-12,
    )
    assert_grads_close(gb, ga, 1e-12)
    # and on-policy with clipping: r = 1 is never clipped, the gradient is the same
    c, gc = grads_of(model, tree, PolicyObjective(agg=Aggregation.of_batch(rollouts)), "replay")
    assert_grads_close(gc, ga, 1e-12)
    assert c.stats["actor/pg_clipfrac"] == 0 and c.stats["actor/ppo_kl"] == 0


def test_missing_fields_name_the_rollout() -> None:
    rs = [Rollout(prompt=(1, 2), response=(3,), where="batch.jsonl:7")]
    tree = PrefixTree.build(rs, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"batch.jsonl:7: missing field 'advantage'"):
        PolicyObjective(agg=Aggregation.of_batch(rs)).bind(tree)
    rs = [Rollout(prompt=(1, 2), response=(3,), advantage=1.0, where="batch.jsonl:8")]
    with pytest.raises(ValueError, match=r"batch.jsonl:8: missing field 'ref_logprobs'"):
        PolicyObjective(agg=Aggregation.of_batch(rs), kl_coef=0.1).bind(PrefixTree.build(rs))
    with pytest.raises(ValueError, match="dual-clip constant must be > 1"):
        PolicyObjective(agg=Aggregation.of_batch(rs), clip_c=1.0)
    with pytest.raises(ValueError, match="needs a positive L_norm"):
        Aggregation.of_batch(rs, "seq-mean-token-sum-norm")


# ---- DPO -------------------------------------------------------------------------------------------------------


def dpo_rollouts(model: torch.nn.Module, seed: int) -> list[Rollout]:
    """Pairs whose responses share a first segment (and a prompt per pair), plus reference logprobs."""
    rng = random.Random(seed)
    out = []
    for k in range(3):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(4 + k))
        common = tuple(rng.randrange(VOCAB) for _ in range(2))
        for chosen, first in ((True, 1), (False, 2)):
            resp = common + (first,) + tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 3)))
            out.append(Rollout(prompt=prompt, response=resp, pair=f"p{k}", chosen=chosen))
    tree = PrefixTree.build(out, vocab_size=VOCAB)
    lp = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB)).logprobs
    return [
        dataclasses.replace(
            r, token_fields={"ref_logprobs": tuple(x + rng.uniform(-1, 1) for x in lp[i].tolist())}
        )
        for i, r in enumerate(out)
    ]


def plain_dpo_loss(rollouts, lp, beta, kind):  # noqa: ANN001, ANN201
    pairs = {}
    for i, r in enumerate(rollouts):
        pairs.setdefault(r.pair, {})[r.chosen] = i
    total = 0.0
    for p in pairs.values():
        c, r = p[True], p[False]
        pc, pr = sum(lp[c].tolist()), sum(lp[r].tolist())
        rc, rr = sum(rollouts[c].field("ref_logprobs")), sum(rollouts[r].field("ref_logprobs"))
        if kind == "sigmoid":
            z = beta * ((pc - rc) - (pr - rr))
            total += -math.log(1 / (1 + math.exp(-z)))
        else:
            ac, ar = (pc - rc) / len(rollouts[c].response), (pr - rr) / len(rollouts[r].response)
            total += ((ac - ar) - 1 / (2 * beta)) ** 2
    return total / len(pairs)


def dpo_grads(model, tree, dpo, schedule, **kw):  # noqa: ANN001, ANN201
    pi = score_rollouts(
        schedule, model, tree, ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    ).sums()
    lin, loss, _ = dpo.linearise(tree, pi)
    _, grads = grads_of(model, tree, lin, schedule, **kw)
    return loss, grads


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_exact_under_sharing_and_plain_formula(kind: str) -> None:
    model = tiny_branch_model(torch.float64, seed=5)
    rollouts = dpo_rollouts(model, seed=17)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    assert tree.positions_computed < tree.positions_logical
    dpo = DPOObjective(num_pairs=3, beta=0.5, loss_type=kind)
    lp = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB)).logprobs
    want_loss = plain_dpo_loss(rollouts, lp, 0.5, kind)

    # the oracle: autograd through every rollout's logprob sum, rollout by rollout (naive forward with graph)
    model.zero_grad(set_to_none=True)
    pis = []
    for r in rollouts:
        seq = torch.tensor(r.prompt + r.response)
        mask = torch.triu(torch.ones(len(seq), len(seq), dtype=torch.bool), diagonal=1)[None, None]
        logits = model(seq[None], torch.arange(len(seq))[None], mask)[0, :-1, :VOCAB]
        pis.append(torch.log_softmax(logits, -1).gather(1, seq[1:, None])[len(r.prompt) - 1 :].sum())
    oracle, _ = dpo.loss(tree, torch.stack(pis))
    oracle.backward()
    want = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    assert float(oracle) == pytest.approx(want_loss, rel=1e-12)

    for schedule, kw in [("naive", {}), ("packed", {}), ("replay", {"branch_micro_batch": 1})]:
        loss, got = dpo_grads(model, tree, dpo, schedule, **kw)
        assert loss == pytest.approx(want_loss, rel=1e-12)
        assert_grads_close(got, want, 1e-9)


def test_dpo_pairs_refuse_malformed_input() -> None:
    a = Rollout(prompt=(1,), response=(2,), pair=1, chosen=True, where="f:1")
    b = Rollout(prompt=(1,), response=(3,), pair=1, chosen=True, where="f:2")
    c = Rollout(prompt=(4,), response=(3,), pair=1, chosen=False, where="f:2")
    with pytest.raises(ValueError, match="f:2: pair 1 needs one chosen and one rejected"):
        preference_pairs([a, b])
    with pytest.raises(ValueError, match="f:2: pair 1: the two rollouts have different prompts"):
        preference_pairs([a, c])
    with pytest.raises(ValueError, match="f:2: pair 1 has 3 rollouts"):
        preference_pairs([a, dataclasses.replace(c, prompt=(1,)), b])
    with pytest.raises(ValueError, match="f:2: pair 1 has an empty prompt"):
        preference_pairs([dataclasses.replace(a, prompt=()), dataclasses.replace(c, prompt=())])
    with pytest.raises(ValueError, match="f:1: missing field 'pair'"):
        preference_pairs([dataclasses.replace(a, pair=None)])
    assert preference_pairs([dataclasses.replace(c, prompt=(1,)), a]) == [(1, 0)]
