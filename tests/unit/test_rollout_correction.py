"""Rollout correction (losses/rollout_correction.py): the truncated IS weights equal verl 0.9.1's
compute_rollout_correction_and_add_to_batch on the same batch; the weighted loss equals verl's vanilla loss with
those weights and is exact under sharing (a sequence weight per rollout at a shared token); in train the sampler's
logprobs fill rollout_logprobs and the mismatch metric is ~0 on CPU float32."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from test_policy_modes import VOCAB, response_logprobs

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import ObjectiveConfig, build_objective
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.rollout_correction import rollout_is_weights
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def corrected_rollouts(model: torch.nn.Module, seed: int) -> list[Rollout]:
    """old near the current policy; the engine's logprobs off by a per-rollout shift plus noise (weights
    above and below the threshold)."""
    rng = random.Random(seed)
    out = []
    for r in random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seg_len=(2, 4), seed=seed):
        with torch.no_grad():
            cur = response_logprobs(model, r).tolist()
        old = [c - rng.uniform(-0.2, 0.2) for c in cur]
        shift = rng.choice((-0.9, -0.1, 0.0, 0.3))
        fields = {
            "old_logprobs": tuple(old),
            "rollout_logprobs": tuple(o + shift + rng.uniform(-0.3, 0.3) for o in old),
            "advantages": tuple(rng.uniform(-2, 2) for _ in cur),
        }
        out.append(dataclasses.replace(r, token_fields=fields))
    return out


def padded(rollouts: list[Rollout], name: str) -> torch.Tensor:
    width = max(len(r.response) for r in rollouts)
    out = torch.zeros(len(rollouts), width, dtype=torch.float64)
    for i, r in enumerate(rollouts):
        out[i, : len(r.response)] = torch.tensor(r.field(name), dtype=torch.float64)
    return out


def verl_weights(rollouts: list[Rollout], level: str, threshold: float | str) -> torch.Tensor:
    from verl.protocol import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    mask = torch.zeros(len(rollouts), max(len(r.response) for r in rollouts), dtype=torch.float64)
    for i, r in enumerate(rollouts):
        mask[i, : len(r.response)] = 1.0
    batch = DataProto.from_dict(
        tensors={
            "old_log_probs": padded(rollouts, "old_logprobs"),
            "rollout_log_probs": padded(rollouts, "rollout_logprobs"),
            "response_mask": mask,
        }
    )
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold)
    out, metrics = compute_rollout_correction_and_add_to_batch(batch, cfg)
    assert any(k.startswith("rollout_corr/") for k in metrics)
    return out.batch["rollout_is_weights"]


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_masked_weights_equal_verls(level: str) -> None:
    """rollout_is_threshold_lower: verl's "lower_upper" threshold (IcePop): outside the band the weight is 0."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = corrected_rollouts(model, seed=11)
    pairs = TokenPairs(PrefixTree.build(rollouts, vocab_size=VOCAB))
    want = verl_weights(rollouts, level, "0.8_1.5")[pairs.rollout, pairs.position]
    got = rollout_is_weights(pairs, level, 1.5, 0.8)
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-12)
    assert bool((got == 0).any()) and bool((got > 0).any())


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_equal_verls_and_the_loss_is_exact_under_sharing(level: str) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    model = tiny_branch_model(torch.float64, seed=3)
    rollouts = corrected_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    pairs = TokenPairs(tree)
    want_w = verl_weights(rollouts, level, 1.5)
    got_w = rollout_is_weights(pairs, level, 1.5)
    assert got_w.tolist() == pytest.approx(want_w[pairs.rollout, pairs.position].tolist(), rel=1e-12)
    assert 0 < float((got_w == 1.5).double().mean()) < 1  # some truncated, some not

    # verl's vanilla loss with those weights, on the unshared batch, by autograd through each rollout alone
    model.zero_grad(set_to_none=True)
    width = max(len(r.response) for r in rollouts)
    logp = torch.stack(
        [torch.nn.functional.pad(response_logprobs(model, r), (0, width - len(r.response))) for r in rollouts]
    )
    mask = (padded(rollouts, "advantages") != 0).double()
    actor = ActorConfig(
        strategy="megatron",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio_c=3.0,
    )
    loss, _ = get_policy_loss_fn("vanilla")(
        padded(rollouts, "old_logprobs"),
        logp,
        padded(rollouts, "advantages"),
        mask,
        "token-mean",
        actor,
        rollout_is_weights=want_w,
    )
    loss.backward()
    want = {k: p.grad.detach().clone() for k, p in model.named_parameters()}

    cfg = ObjectiveConfig(policy_loss="vanilla", clip_ratio_c=3.0, rollout_is=level, rollout_is_threshold=1.5)
    objective = build_objective(cfg, rollouts)
    for schedule in ("naive", "replay"):
        model.zero_grad(set_to_none=True)
        res = run_schedule(
            schedule, model, tree, objective, ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None)
        )
        assert res.loss == pytest.approx(float(loss), rel=1e-10), schedule
        for k, g in want.items():
            assert ((model.get_parameter(k).grad - g).norm() / g.norm()).item() <= 1e-9, (schedule, k)
        assert res.stats["rollout_corr/rollout_is_mean"] == pytest.approx(float(got_w.mean()), rel=1e-10)
        assert res.stats["training/rollout_probs_diff_mean"] > 0


def test_rollout_is_is_refused_where_it_has_no_per_token_policy_term() -> None:
    with pytest.raises(
        ValueError, match="weights the per-token policy term of vanilla, gspo, cispo and sapo, not 'dpo'"
    ):
        ObjectiveConfig(policy_loss="dpo", rollout_is="token")


REWARD = """
def reward(prompt, response, row):
    return sum(ord(c) * (k + 1) for k, c in enumerate(response)) % 11 / 10
"""


def test_train_fills_rollout_logprobs_and_the_mismatch_is_zero_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.loop import Trainer

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"ab{c}"}) + "\n" for c in "abcd"))
    (tmp_path / "mismatch_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        None,
        [
            "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
            "ffn_hidden_size: 32, max_position_embeddings: 64}",
            "model.dtype=float32",
            f"data.train_files={tmp_path / 'prompts.jsonl'}",
            "data.reward=mismatch_reward:reward",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.response_length=4",
            "trainer.total_training_steps=1",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.hf_export=false",
            "actor.rollout_is=token",
            "actor.rollout_rs=token_k1,seq_max_k2",
            "actor.rollout_rs_threshold=0.5_2.0,0.1",
        ],
    )
    tr = Trainer(cfg)
    row = tr.train_step()
    assert all(r.field("rollout_logprobs") == r.field("old_logprobs") for r in tr.last_batch)
    assert 0 <= row["training/rollout_probs_diff_mean"] < 1e-5
    assert row["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-12)  # the sampler's own: weight 1
    # rollout_rs runs on the step's batch: the sampler's own logprobs reject nothing
    assert row["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    assert row["rollout_corr/rollout_rs_token_k1_masked_fraction"] == 0.0
