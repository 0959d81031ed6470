"""GSPO and CISPO (losses/policy_modes.py): equal to verl's own loss functions on the unshared batch and exact under
sharing, float64.

The oracle runs every rollout alone through the model WITH its graph, pads the response logprobs into verl's
[batch, response] layout and calls verl 0.9.1's `get_policy_loss_fn(mode)` on them; its backward gives the
per-parameter gradient of per-rollout training: `naive` must match it to 1e-9 (1e-8 under verl's
seq-mean-token-mean, which divides by |o| + 1e-8), packed and replay (two-pass for GSPO: a forward-only pass,
then the gradient pass) must match naive to 1e-9. The trees share response tokens, and each rollout's old
logprobs are its current ones shifted by a per-rollout offset plus noise, so rollouts sharing a token have
different sequence-level ratios, some clipped and some not (asserted). A planted bug (one sequence ratio per tree
token instead of per rollout) must fail.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import (
    CISPOObjective,
    GMPOObjective,
    GSPOObjective,
    ObjectiveConfig,
    SAPOObjective,
    build_objective,
    objective_class,
)
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model

VOCAB = 37
DEMO = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo.yaml")
SHIFTS = (
    -0.5,
    -0.12,
    -0.02,
    0.0,
    0.03,
    0.15,
    0.6,
)  # per rollout: log s_i around these, clipped or not at 0.2
CLIP = {"clip_low": 0.2, "clip_high": 0.28}


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def response_logprobs(model: torch.nn.Module, r: Rollout) -> torch.Tensor:
    """[len(response)] logprobs of r's response tokens, r alone through the model, with the graph."""
    seq = torch.tensor(r.prompt + r.response)
    mask = torch.triu(torch.ones(len(seq), len(seq), dtype=torch.bool), diagonal=1)[None, None]
    logits = model(seq[None], torch.arange(len(seq))[None], mask)[0, :-1, :VOCAB]
    return torch.log_softmax(logits, -1).gather(1, seq[1:, None])[len(r.prompt) - 1 :, 0]


def mode_rollouts(model: torch.nn.Module, seed: int) -> list[Rollout]:
    rng = random.Random(seed)
    rs = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 4), seed=seed)
    out = []
    for r in rs:
        with torch.no_grad():
            cur = response_logprobs(model, r).tolist()
        shift = rng.choice(SHIFTS)
        old = [c - shift - rng.uniform(-0.3, 0.3) for c in cur]
        adv = [rng.uniform(-2, 2) for _ in cur]
        out.append(
            dataclasses.replace(r, token_fields={"old_logprobs": tuple(old), "advantages": tuple(adv)})
        )
    return out


def verl_oracle(
    model: torch.nn.Module, rollouts: list[Rollout], mode: str, agg: str
) -> tuple[float, dict, dict[str, torch.Tensor]]:
    """(verl's loss, its metrics, the parameter gradients) on the padded unshared batch."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    model.zero_grad(set_to_none=True)
    n, width = len(rollouts), max(len(r.response) for r in rollouts)
    logp = torch.zeros(n, width, dtype=torch.float64)
    old, adv, mask = torch.zeros_like(logp), torch.zeros_like(logp), torch.zeros_like(logp)
    rows = []
    for i, r in enumerate(rollouts):
        rows.append(response_logprobs(model, r))
        k = len(r.response)
        old[i, :k] = torch.tensor(r.field("old_logprobs"), dtype=torch.float64)
        adv[i, :k] = torch.tensor(r.field("advantages"), dtype=torch.float64)
        mask[i, :k] = 1.0
    logp = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in rows])
    cfg = ActorConfig(
        strategy="megatron",
        ppo_mini_batch_size=n,
        ppo_micro_batch_size_per_gpu=n,
        rollout_n=1,
        clip_ratio_low=CLIP["clip_low"],
        clip_ratio_high=CLIP["clip_high"],
    )
    loss, metrics = get_policy_loss_fn(mode)(old, logp, adv, mask, agg, cfg)
    loss.backward()
    return float(loss), metrics, {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def run(model, tree, objective, schedule, **kw):  # noqa: ANN001, ANN201
    """What an update runs on one micro-batch (update/step.py): score when asked, prepare, the gradient pass."""
    opts = ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    scores = score_rollouts(schedule, model, tree, opts) if objective.needs_scores else None
    prepared = objective.prepare(tree, scores)
    model.zero_grad(set_to_none=True)
    res = run_schedule(schedule, model, tree, prepared.objective, opts)
    return res, {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def max_err(got: dict, want: dict) -> float:
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)).item() for k in want)


MODES = {"gspo": GSPOObjective, "cispo": CISPOObjective, "sapo": SAPOObjective, "geo_mean": GMPOObjective}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", list(MODES))
def test_mode_equals_verl_and_is_exact_under_sharing(mode: str, agg: str) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = mode_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    assert tree.positions_computed < tree.positions_logical
    want_loss, want_metrics, want = verl_oracle(model, rollouts, mode, agg)
    objective = MODES[mode](agg=Aggregation.of_batch(rollouts, agg), **CLIP)
    # verl's seq-mean-token-mean divides by |o_i| + 1e-8: a relative 1e-8 / |o_i| from the exact mean
    tol = 1e-9 if agg == "token-mean" else 1e-8
    naive, per_rollout = run(model, tree, objective, "naive")
    assert naive.loss == pytest.approx(want_loss, rel=tol)
    assert max_err(per_rollout, want) <= tol
    for k in ("actor/pg_clipfrac", "actor/ppo_kl"):  # verl takes the clip fraction in float32
        assert naive.stats[k] == pytest.approx(want_metrics[k], rel=1e-7, abs=1e-12), k
    for schedule, kw in [("packed", {}), ("replay", {"branch_micro_batch": 2})]:
        res, got = run(model, tree, objective, schedule, **kw)
        assert res.loss == pytest.approx(naive.loss, rel=1e-11), schedule
        assert max_err(got, per_rollout) <= 1e-9, schedule
        for k, v in naive.stats.items():
            assert res.stats[k] == pytest.approx(v, rel=1e-10, abs=1e-14), (schedule, k)
    if mode != "sapo":  # SAPO gates, never clips
        assert 0 < res.stats["actor/pg_clipfrac"] < 1


def test_rollouts_sharing_a_token_have_different_sequence_ratios() -> None:
    """The premise: at one shared response token, GSPO's s_i differ, and one rollout is clipped, another not."""
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = mode_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    scores = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB))
    agg = Aggregation.of_batch(rollouts, "token-mean")
    s = GSPOObjective(agg=agg, **CLIP).prepare(tree, scores).objective.seq.exp()
    pairs = TokenPairs(tree)
    holders: dict[int, set[int]] = {}
    for p in range(pairs.num_pairs):
        holders.setdefault(int(pairs.token[p]), set()).add(int(pairs.rollout[p]))
    shared = [sorted(v) for v in holders.values() if len(v) > 1]
    assert any(len({round(float(s[i]), 9) for i in h}) > 1 for h in shared)
    outside = [(s[i] < 1 - CLIP["clip_low"]) | (s[i] > 1 + CLIP["clip_high"]) for i in range(len(s))]
    assert any(len({bool(outside[i]) for i in h}) == 2 for h in shared)


class SharedRatioGSPO(GSPOObjective):
    """Planted bug: at a shared token every rollout uses the sequence ratio of the first rollout holding it."""

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        data = super().pair_data(pairs)
        first: dict[int, int] = {}
        for p in range(pairs.num_pairs):
            first.setdefault(int(pairs.token[p]), p)
        data["seq"] = data["seq"][[first[int(t)] for t in pairs.token]]
        return data


def test_planted_bug_a_ratio_per_tree_token_fails() -> None:
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = mode_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    agg = Aggregation.of_batch(rollouts, "token-mean")
    _, want = run(model, tree, GSPOObjective(agg=agg, **CLIP), "naive")
    _, good = run(model, tree, GSPOObjective(agg=agg, **CLIP), "replay")
    _, bad = run(model, tree, SharedRatioGSPO(agg=agg, **CLIP), "replay")
    assert max_err(good, want) <= 1e-9
    assert max_err(bad, want) > 1e-3


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_with_kl_entropy_and_empty_prompt_replay_equals_naive(mode: str) -> None:
    """The vanilla extras (KL, entropy bonus) ride on every mode; an empty prompt's first token has no pair."""
    model = tiny_branch_model(torch.float64, seed=4)
    rollouts = mode_rollouts(model, seed=12)
    rng = random.Random(1)
    rollouts = [
        dataclasses.replace(
            r,
            token_fields={
                **r.token_fields,
                "ref_logprobs": tuple(x - rng.uniform(0, 1) for x in r.field("old_logprobs")),
            },
        )
        for r in rollouts
    ] + [Rollout(prompt=(), response=(3, 1, 4, 1), advantage=0.5)]  # on-policy: no old_logprobs, no ref
    rollouts[-1] = dataclasses.replace(rollouts[-1], token_fields={"ref_logprobs": (-3.0,) * 4})
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    objective = MODES[mode](
        agg=Aggregation.of_batch(rollouts, "seq-mean-token-sum"),
        kl_coef=0.1,
        kl_type="k3",
        entropy_coef=0.02,
        **CLIP,
    )
    want_res, want = run(model, tree, objective, "naive")
    for schedule in ("packed", "replay"):
        res, got = run(model, tree, objective, schedule)
        assert res.loss == pytest.approx(want_res.loss, rel=1e-10)
        assert max_err(got, want) <= 1e-9
        for k, v in want_res.stats.items():
            assert res.stats[k] == pytest.approx(v, rel=1e-10, abs=1e-14), k


def test_train_reads_verls_loss_mode_spelling(tmp_path) -> None:  # noqa: ANN001
    """`actor.policy_loss.loss_mode` (verl's key) is an alias of `actor.policy_loss`, in the YAML and overrides."""
    from megatron_branch.train.algorithm import resolve_algorithm
    from megatron_branch.train.config_io import load_config

    assert (
        resolve_algorithm(load_config(DEMO, ["actor.policy_loss.loss_mode=gspo"])).objective.policy_loss
        == "gspo"
    )
    import yaml

    raw = yaml.safe_load(Path(DEMO).read_text())
    f = tmp_path / "c.yaml"
    raw["actor"]["policy_loss"] = {"loss_mode": "cispo"}
    f.write_text(yaml.safe_dump(raw))
    assert load_config(f).actor.policy_loss == "cispo"
    raw["actor"]["policy_loss"]["clip_cov_ratio"] = 0.1
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"actor\.policy_loss\.clip_cov_ratio \(only loss_mode is read\)"):
        load_config(f)


VERL_MODES = ["vanilla", "gspo", "cispo", "sapo", "geo_mean", "kl_cov", "gpg"]


@pytest.mark.parametrize("mode", VERL_MODES)
def test_verl_loss_through_verls_function_is_exact_under_sharing(mode: str) -> None:
    """policy_loss = "verl:<mode>": verl's function on the scored logprobs, its dL/dlogp through the tree."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = mode_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    want_loss, _, want = verl_oracle(model, rollouts, mode, "token-mean")
    cfg = ObjectiveConfig(policy_loss=f"verl:{mode}", clip_ratio_low=0.2, clip_ratio_high=0.28)
    objective = build_objective(cfg, rollouts)
    for schedule, kw in [("naive", {}), ("packed", {}), ("replay", {"branch_micro_batch": 2})]:
        res, got = run(model, tree, objective, schedule, **kw)
        assert res.loss == pytest.approx(want_loss, rel=1e-10), schedule
        assert max_err(got, want) <= 1e-9, schedule


def test_verl_loss_names_are_checked_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    with pytest.raises(ValueError, match=r"unknown --policy-loss 'verl:nope'; verl registers: .*gspo"):
        objective_class("verl:nope")
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", None)  # as if verl were not installed
    with pytest.raises(ValueError, match=r"^--policy-loss verl:gspo needs verl, which is not installed") as e:
        objective_class("verl:gspo")
    assert "\n" not in str(e.value)


def test_trl_options_bias_corrected_kl_and_token_mean_entropy_equal_plain_formula() -> None:
    """use_bias_correction_kl: k3 r (r with its gradient); entropy_token_mean: the bonus is sum H / T whatever the
    loss's aggregation (seq-mean-token-sum here: the rest weighs 1/N)."""
    model = tiny_branch_model(torch.float64, seed=4)
    rng = random.Random(2)
    rollouts = [
        dataclasses.replace(
            r,
            token_fields={
                **r.token_fields,
                "ref_logprobs": tuple(x - rng.uniform(-1, 1) for x in r.field("old_logprobs")),
            },
        )
        for r in mode_rollouts(model, seed=12)
    ]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    N, T = len(rollouts), sum(len(r.response) for r in rollouts)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for r in rollouts:
        seq = torch.tensor(r.prompt + r.response)
        mask = torch.triu(torch.ones(len(seq), len(seq), dtype=torch.bool), diagonal=1)[None, None]
        logq = torch.log_softmax(model(seq[None], torch.arange(len(seq))[None], mask)[0, :-1, :VOCAB], -1)
        logq = logq[len(r.prompt) - 1 :]
        logp = logq.gather(1, seq[len(r.prompt) :, None])[:, 0]
        ent = -(logq.exp() * logq).sum(-1)
        old, ref, adv = (
            torch.tensor(r.field(k), dtype=torch.float64)
            for k in ("old_logprobs", "ref_logprobs", "advantages")
        )
        ratio = (logp - old).exp()
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        x = ref - logp
        kl = (x.exp() - x - 1).clamp(-10, 10) * ratio
        total = total + (pg + 0.3 * kl).sum() / N - 0.05 * ent.sum() / T
    total.backward()
    want = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    cfg = ObjectiveConfig(
        policy_loss="vanilla",
        clip_ratio_high=0.28,
        kl_loss_coef=0.3,
        kl_loss_type="k3",
        entropy_coeff=0.05,
        loss_agg_mode="seq-mean-token-sum",
        use_bias_correction_kl=True,
        entropy_token_mean=True,
    )
    objective = build_objective(cfg, rollouts)
    for schedule in ("naive", "replay"):
        res, got = run(model, tree, objective, schedule)
        assert res.loss == pytest.approx(float(total), rel=1e-10), schedule
        assert max_err(got, want) <= 1e-9, schedule
    plain = build_objective(
        dataclasses.replace(cfg, use_bias_correction_kl=False, entropy_token_mean=False), rollouts
    )
    _, other = run(model, tree, plain, "replay")
    assert max_err(other, want) > 1e-4  # the options change the gradient


def test_gspo_sequence_level_equals_trls_formula() -> None:
    """importance_sampling_level="sequence" (TRL's GSPO): L = sum_t -min(A_t s_i, A_t clip(s_i)) / T with s_i =
    exp(mean_t(logp - old)) differentiated whole; per-token advantages make it differ from GSPO-token (asserted)."""
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = mode_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    T = sum(len(r.response) for r in rollouts)
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for r in rollouts:
        logp = response_logprobs(model, r)
        old, adv = (torch.tensor(r.field(k), dtype=torch.float64) for k in ("old_logprobs", "advantages"))
        coef1 = ((logp - old).sum() / len(logp)).exp()
        coef2 = coef1.clamp(1 - CLIP["clip_low"], 1 + CLIP["clip_high"])
        total = total - torch.minimum(coef1 * adv, coef2 * adv).sum() / T
    total.backward()
    want = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    cfg = ObjectiveConfig(policy_loss="gspo", clip_ratio_high=0.28, importance_sampling_level="sequence")
    objective = build_objective(cfg, rollouts)
    for schedule, kw in [("naive", {}), ("packed", {}), ("replay", {"branch_micro_batch": 2})]:
        res, got = run(model, tree, objective, schedule, **kw)
        assert res.loss == pytest.approx(float(total), rel=1e-10), schedule
        assert max_err(got, want) <= 1e-9, schedule
    _, token_level = run(
        model,
        tree,
        build_objective(dataclasses.replace(cfg, importance_sampling_level="token"), rollouts),
        "replay",
    )
    assert max_err(token_level, want) > 1e-4
    with pytest.raises(ValueError, match="importance-sampling-level sequence is gspo's"):
        ObjectiveConfig(policy_loss="vanilla", importance_sampling_level="sequence")
