"""loss_mask x the new objectives: GSPO, CISPO, SAPO, GMPO (geo_mean), clip_cov, kl_cov and verl:<name> on rollouts
with context tokens (loss_mask 0) inside their responses and one rollout with no trained token at all.

The oracle is test_policy_modes'/test_cov_modes' (each rollout alone through the model with its graph, verl 0.9.1's
own `get_policy_loss_fn(mode)` on the padded batch) with verl's `response_mask` = the rollouts' loss_mask: naive
must match its gradient per parameter (1e-9; 1e-8 under seq-mean-token-mean, whose |o| + 1e-8 is verl's), packed
and replay must match naive to 1e-9. The masks are drawn per rollout, so a shared token is trained for one rollout
and context for another (asserted). GSPO's and GMPO's sequence means are over a rollout's TRAINED tokens (verl's
masked_mean): a planted bug taking GSPO's mean over every response token must fail.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from test_cov_modes import SETTINGS
from test_policy_modes import CLIP, MODES, VOCAB, max_err, mode_rollouts, response_logprobs, run

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import GSPOObjective, ObjectiveConfig, build_objective
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import tiny_branch_model

SCHEDULES = [("naive", {}), ("packed", {}), ("replay", {"branch_micro_batch": 2})]


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def masked_rollouts(model: torch.nn.Module, seed: int) -> list[Rollout]:
    """mode_rollouts with a random loss_mask per rollout (about a third context tokens, at least one trained
    token) and rollout 2 all context."""
    rng = random.Random(seed + 1)
    out = []
    for i, r in enumerate(mode_rollouts(model, seed)):
        mask = [rng.random() > 0.35 for _ in r.response]
        mask[rng.randrange(len(mask))] = True
        out.append(dataclasses.replace(r, loss_mask=tuple(False for _ in mask) if i == 2 else tuple(mask)))
    return out


def response_mask(rollouts: list[Rollout]) -> torch.Tensor:
    """verl's response_mask [batch, response]: the loss_mask, 0 on the padding."""
    mask = torch.zeros(len(rollouts), max(len(r.response) for r in rollouts), dtype=torch.float64)
    for i, r in enumerate(rollouts):
        mask[i, : len(r.response)] = torch.tensor(
            r.loss_mask or (True,) * len(r.response), dtype=torch.float64
        )
    return mask


def verl_oracle(model, rollouts, mode, agg, is_weights=None, **policy_loss):  # noqa: ANN001, ANN003, ANN201
    """(verl's loss, the parameter gradients) of verl's own function on the padded batch, response_mask = loss_mask
    (and verl's rollout-correction weights `is_weights`, if given)."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig

    model.zero_grad(set_to_none=True)
    width = max(len(r.response) for r in rollouts)
    logp = torch.stack(
        [torch.nn.functional.pad(response_logprobs(model, r), (0, width - len(r.response))) for r in rollouts]
    )
    old, adv = (torch.zeros_like(logp).detach() for _ in range(2))
    for i, r in enumerate(rollouts):
        k = len(r.response)
        old[i, :k] = torch.tensor(r.field("old_logprobs"), dtype=torch.float64)
        adv[i, :k] = torch.tensor(r.field("advantages"), dtype=torch.float64)
    mask = response_mask(rollouts)
    cfg = ActorConfig(
        strategy="megatron", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=CLIP["clip_low"], clip_ratio_high=CLIP["clip_high"], loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode=mode, **policy_loss),
    )  # fmt: skip
    torch.manual_seed(123)  # clip_cov draws with the global generator
    extra = {} if is_weights is None else {"rollout_is_weights": is_weights}
    loss, _ = get_policy_loss_fn(mode)(old, logp, adv, mask, agg, cfg, **extra)
    loss.backward()
    return float(loss), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def check_schedules(model, tree, objective, want_loss, want, tol):  # noqa: ANN001, ANN201
    torch.manual_seed(123)
    naive, per_rollout = run(model, tree, objective, "naive")
    assert naive.loss == pytest.approx(want_loss, rel=tol)
    assert max_err(per_rollout, want) <= tol
    for schedule, kw in SCHEDULES[1:]:
        torch.manual_seed(123)
        res, got = run(model, tree, objective, schedule, **kw)
        assert res.loss == pytest.approx(naive.loss, rel=1e-11), schedule
        assert max_err(got, per_rollout) <= 1e-9, schedule


def test_masks_differ_at_a_shared_token() -> None:
    """The premise: some shared token is trained for one rollout and context for another; rollout 2 has none."""
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = masked_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    assert rollouts[2].num_trained == 0 and all(r.num_trained > 0 for i, r in enumerate(rollouts) if i != 2)
    pairs = TokenPairs(tree)
    trained = {(int(r), int(t)) for r, t in zip(pairs.rollout, pairs.token)}
    holders: dict[int, set[int]] = {}
    for i in range(len(rollouts)):
        for t in tree.response_indices(i).tolist():
            holders.setdefault(t, set()).add(i)
    assert any(len({(i, t) in trained for i in h}) == 2 for t, h in holders.items() if len(h) > 1)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("mode", list(MODES))
def test_native_mode_with_loss_mask_equals_verl(mode: str, agg: str) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = masked_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    want_loss, want = verl_oracle(model, rollouts, mode, agg)
    objective = MODES[mode](agg=Aggregation.of_batch(rollouts, agg), **CLIP)
    check_schedules(model, tree, objective, want_loss, want, 1e-9 if agg == "token-mean" else 1e-8)


@pytest.mark.parametrize("mode", list(SETTINGS))
def test_cov_mode_with_loss_mask_equals_verl(mode: str) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = masked_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    want_loss, want = verl_oracle(model, rollouts, mode, "token-mean", **SETTINGS[mode])
    cfg = ObjectiveConfig(policy_loss=mode, clip_ratio_high=CLIP["clip_high"], **SETTINGS[mode])
    check_schedules(model, tree, build_objective(cfg, rollouts), want_loss, want, 1e-9)


@pytest.mark.parametrize("mode", ["gspo", "geo_mean", "vanilla"])
def test_verl_loss_with_loss_mask_equals_verl(mode: str) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = masked_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    want_loss, want = verl_oracle(model, rollouts, mode, "token-mean")
    cfg = ObjectiveConfig(policy_loss=f"verl:{mode}", clip_ratio_high=CLIP["clip_high"])
    check_schedules(model, tree, build_objective(cfg, rollouts), want_loss, want, 1e-9)


class AllTokensGSPO(GSPOObjective):
    """Planted bug: GSPO's sequence mean log-ratio over EVERY response token, context ones included."""

    def prepare(self, tree, scores):  # noqa: ANN001, ANN201
        pairs = TokenPairs(tree)
        seq = []
        for i, r in enumerate(tree.rollouts):
            cur = scores.logprobs[i].to(torch.float64)
            old = torch.tensor(r.field("old_logprobs"), dtype=torch.float64)
            seq.append(float((cur - old).mean()) if pairs.start[i + 1] > pairs.start[i] else 0.0)
        from megatron_branch.losses.objective import Prepared

        return Prepared(objective=dataclasses.replace(self, seq=torch.tensor(seq, dtype=torch.float64)))


def test_planted_bug_sequence_mean_over_all_tokens_fails() -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = masked_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    _, want = verl_oracle(model, rollouts, "gspo", "token-mean")
    agg = Aggregation.of_batch(rollouts, "token-mean")
    _, good = run(model, tree, GSPOObjective(agg=agg, **CLIP), "replay", branch_micro_batch=2)
    _, bad = run(model, tree, AllTokensGSPO(agg=agg, **CLIP), "replay", branch_micro_batch=2)
    assert max_err(good, want) <= 1e-9
    assert max_err(bad, want) > 1e-3


def with_rollout_logprobs(rollouts: list[Rollout], seed: int) -> list[Rollout]:
    """The engine's logprobs off old by a per-rollout shift plus noise: weights above and below the threshold."""
    rng = random.Random(seed)
    out = []
    for r in rollouts:
        shift = rng.choice((-0.9, -0.1, 0.0, 0.3))
        eng = tuple(o + shift + rng.uniform(-0.3, 0.3) for o in r.field("old_logprobs"))
        out.append(dataclasses.replace(r, token_fields={**r.token_fields, "rollout_logprobs": eng}))
    return out


def verl_is_weights(rollouts: list[Rollout], level: str, threshold: float) -> torch.Tensor:
    """verl's compute_rollout_correction_and_add_to_batch weights, response_mask = loss_mask."""
    from test_rollout_correction import padded
    from verl.protocol import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    batch = DataProto.from_dict(
        tensors={
            "old_log_probs": padded(rollouts, "old_logprobs"),
            "rollout_log_probs": padded(rollouts, "rollout_logprobs"),
            "response_mask": response_mask(rollouts),
        }
    )
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold)
    out, _ = compute_rollout_correction_and_add_to_batch(batch, cfg)
    return out.batch["rollout_is_weights"]


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_with_loss_mask_equals_verl(level: str, mode: str) -> None:
    """The IS weights over trained tokens only (a sequence weight sums the rollout's trained log-ratios), equal
    to verl's with its response_mask; the weighted loss equal to verl's function given those weights."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from megatron_branch.losses.rollout_correction import rollout_is_weights

    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = with_rollout_logprobs(masked_rollouts(model, seed=11), seed=5)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    pairs = TokenPairs(tree)
    weights = verl_is_weights(rollouts, level, 1.5)
    got_w = rollout_is_weights(pairs, level, 1.5)
    assert got_w.tolist() == pytest.approx(weights[pairs.rollout, pairs.position].tolist(), rel=1e-12)
    assert 0 < float((got_w == 1.5).double().mean()) < 1  # some truncated, some not
    want_loss, want = verl_oracle(model, rollouts, mode, "token-mean", is_weights=weights)
    cfg = ObjectiveConfig(
        policy_loss=mode, clip_ratio_high=CLIP["clip_high"], rollout_is=level, rollout_is_threshold=1.5
    )
    check_schedules(model, tree, build_objective(cfg, rollouts), want_loss, want, 1e-9)


@pytest.mark.parametrize(
    "rs, threshold",
    [
        ("token_k1", "0.7_1.4"),
        ("seq_sum_k1", "0.5_2.0"),
        ("seq_mean_k3,token_k2", "0.05,0.2"),
        ("seq_max_k2", 0.3),
    ],
)
def test_rejection_equals_verls_mask_and_metrics_and_the_loss(rs: str, threshold: str | float) -> None:
    """rollout_rs: the rejected tokens' loss_mask is 0 exactly where verl's compute_rollout_correction_and_add_to_batch
    zeroes its response_mask, the rollout_corr/ metrics are verl's, and the loss on the rejected batch is verl's
    function given that response_mask (naive, packed, replay)."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from test_rollout_correction import padded
    from verl.protocol import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    from megatron_branch.losses.rollout_correction import reject_rollouts

    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = with_rollout_logprobs(masked_rollouts(model, seed=11), seed=5)
    batch = DataProto.from_dict(
        tensors={
            "old_log_probs": padded(rollouts, "old_logprobs"),
            "rollout_log_probs": padded(rollouts, "rollout_logprobs"),
            "response_mask": response_mask(rollouts),
        }
    )
    out, want_metrics = compute_rollout_correction_and_add_to_batch(
        batch, RolloutCorrectionConfig(rollout_rs=rs, rollout_rs_threshold=threshold)
    )
    cfg = ObjectiveConfig(
        policy_loss="gspo",
        clip_ratio_high=CLIP["clip_high"],
        rollout_rs=rs,
        rollout_rs_threshold=str(threshold),
    )
    kept, metrics = reject_rollouts(rollouts, cfg.rollout_rs, cfg.rollout_rs_threshold)
    assert torch.equal(response_mask(kept), out.batch["response_mask"])
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1  # some rejected, some kept
    for k, v in metrics.items():
        assert want_metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert {k for k in want_metrics if k.startswith("rollout_corr/rollout_rs")} == set(metrics)

    tree = PrefixTree.build(kept, vocab_size=VOCAB)
    want_loss, want = verl_oracle(model, kept, "gspo", "seq-mean-token-mean")
    objective = build_objective(dataclasses.replace(cfg, loss_agg_mode="seq-mean-token-mean"), kept)
    check_schedules(model, tree, objective, want_loss, want, 1e-8)


def test_grad_rejects_like_loss_mask_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`grad --rollout-rs`: the gradient equals grad's on the same rollouts with the rejected tokens' loss_mask set
    to 0 by hand (one mechanism), and the rollout_corr/ metrics come out."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from safetensors.torch import load_file

    from megatron_branch.cli import main
    from megatron_branch.data import write_rollouts_jsonl
    from megatron_branch.losses.rollout_correction import reject_rollouts
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    rng = random.Random(7)
    rollouts = []
    for r in random_tree_rollouts(groups=2, levels=2, branches=3, seed=4):
        old = tuple(-rng.uniform(0.5, 3.0) for _ in r.response)
        shift = rng.choice((-0.9, 0.0, 0.4))
        eng = tuple(o + shift + rng.uniform(-0.2, 0.2) for o in old)
        fields = {
            "old_logprobs": old,
            "rollout_logprobs": eng,
            "advantages": tuple(rng.uniform(-1, 1) for _ in old),
        }
        rollouts.append(dataclasses.replace(r, token_fields=fields))
    rs, threshold = "seq_mean_k1", "0.6_1.5"
    kept, _ = reject_rollouts(rollouts, rs, threshold)
    assert 0 < sum(r.num_trained for r in kept) < sum(r.num_trained for r in rollouts)
    tiny_hf_model(tiny_hf_config("llama"), seed=3).save_pretrained(tmp_path / "hf")
    write_rollouts_jsonl(tmp_path / "all.jsonl", rollouts)
    write_rollouts_jsonl(tmp_path / "kept.jsonl", kept)

    def grad(name: str, *flags: str) -> dict:
        argv = ["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / f"{name}.jsonl")]
        argv += ["--out", str(tmp_path / f"{name}.st"), "--dtype", "float64", "--objective", "gspo", *flags]
        assert main(argv) == 0
        return json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.strip()][-1])

    got = grad("all", "--rollout-rs", rs, "--rollout-rs-threshold", threshold)
    want = grad("kept")
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-12)
    g, w = load_file(tmp_path / "all.st"), load_file(tmp_path / "kept.st")
    for k in w:
        assert torch.equal(g[k], w[k]), k
    assert 0 < got["metrics"]["rollout_corr/rollout_rs_masked_fraction"] < 1


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": "2"}, "comma-separated criteria among token_k1"),
        ({"rollout_rs": "token_k2"}, "is required with rollout_rs"),
        (
            {"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_2"},
            "for token_k2 must be one positive bound",
        ),
        (
            {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "2_0.5"},
            "for seq_sum_k1 must be a positive upper",
        ),
        (
            {"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1,2,3"},
            "one per rollout_rs criterion",
        ),
        ({"rollout_rs_threshold": "2"}, "rollout_rs is off"),
        (
            {"rollout_rs": "token_k1", "rollout_rs_threshold": "2", "rollout_is": "sequence"},
            "reject whole rollouts",
        ),
    ],
)
def test_rollout_rs_settings_are_checked(kw: dict, message: str) -> None:
    from megatron_branch.errors import SettingError

    with pytest.raises(SettingError, match=message):
        ObjectiveConfig(**kw)
    ObjectiveConfig(
        rollout_rs="seq_mean_k3,token_k1", rollout_rs_threshold="0.05,0.5_2"
    )  # verl accepts these
