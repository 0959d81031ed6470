"""verl's rollout rejection (`rollout_rs`) at its edges: a train step whose every token is rejected skips its update
(a warning line, `actor/skipped_updates`, the parameters unchanged, no traceback); `grad` with every token rejected
is one line and exit status 2; `rollout_rs_threshold` takes what verl takes (a number or a string of bounds)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from train_helpers import params

from megatron_branch.errors import SettingError
from megatron_branch.losses import ObjectiveConfig

REWARD = """
def reward(prompt, response, row):
    return sum(ord(c) * (k + 1) for k, c in enumerate(response)) % 11 / 10
"""


def _train_cfg(tmp_path: Path, threshold: str):  # noqa: ANN202
    from megatron_branch.train.config_io import load_config

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"ab{c}"}) + "\n" for c in "abcd"))
    (tmp_path / "edge_reward.py").write_text(REWARD)
    return load_config(None, [
        "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
        "ffn_hidden_size: 32, max_position_embeddings: 64}",
        f"data.train_files={tmp_path / 'prompts.jsonl'}", "data.reward=edge_reward:reward",
        "data.train_batch_size=2", "rollout.n=2", "rollout.response_length=4", "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.plot=false", "checkpoint.hf_export=false", "actor.ppo_mini_batch_size=1",
        "actor.rollout_rs=token_k1", f"actor.rollout_rs_threshold={threshold}",
    ])  # fmt: skip


def test_a_train_step_with_every_token_rejected_skips_its_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sampler's own logprobs give ratio 1 at every token: token_k1 with bounds [1.5, 2] rejects them all (two
    mini-batches: both skipped); bounds [0.5, 2] keep them all (the control: the update runs)."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from megatron_branch.train.loop import Trainer

    monkeypatch.syspath_prepend(str(tmp_path))
    tr = Trainer(_train_cfg(tmp_path, "1.5_2.0"))
    before = params(tr)
    row = tr.train_step()
    err = capsys.readouterr().err
    assert "every response token of 2 of 2 mini-batches: their updates are skipped" in err
    assert "Traceback" not in err
    assert row["actor/skipped_updates"] == 2.0 and math.isnan(row["loss"])
    assert row["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        1.0
    )  # verl: masked / (count + 1e-8)
    after = params(tr)
    assert all((before[k] == after[k]).all() for k in before)  # nothing trained
    kept = Trainer(_train_cfg(tmp_path / "kept", "0.5_2.0"))
    row = kept.train_step()
    assert row["actor/skipped_updates"] == 0.0 and math.isfinite(row["loss"])
    assert any((before[k] != v).any() for k, v in params(kept).items())  # the control trains


def test_grad_with_every_token_rejected_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from megatron_branch.cli import main
    from megatron_branch.data import write_rollouts_jsonl
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    rollouts = [
        dataclasses.replace(r, token_fields={"old_logprobs": (-1.0,) * len(r.response),
                                             "rollout_logprobs": (-1.0,) * len(r.response)})
        for r in random_tree_rollouts(groups=1, branches=2, seed=5)
    ]  # fmt: skip
    tiny_hf_model(tiny_hf_config("qwen2"), seed=0).save_pretrained(tmp_path / "hf")
    write_rollouts_jsonl(tmp_path / "r.jsonl", rollouts)
    capsys.readouterr()
    argv = ["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "r.jsonl"), "--out",
            str(tmp_path / "g.safetensors"), "--rollout-rs", "token_k1"]  # fmt: skip
    assert main([*argv, "--rollout-rs-threshold", "1.5_2.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rejects every response token" in err and "\n" not in err, err
    assert not (tmp_path / "g.safetensors").exists()
    assert main([*argv, "--rollout-rs-threshold", "2"]) == 0  # a number, as verl takes it: nothing rejected


@pytest.mark.parametrize("threshold", [2, 2.0, "2", "0.5_2.0"])
def test_rollout_rs_threshold_takes_what_verl_takes(threshold: float | str) -> None:
    cfg = ObjectiveConfig(rollout_rs="token_k1", rollout_rs_threshold=threshold)
    assert cfg.rollout_rs_threshold == threshold


@pytest.mark.parametrize("threshold, message", [(True, "must be a number or a string"), (-2.0, "must be a positive"),
                                                ([2.0], "must be a number or a string")])  # fmt: skip
def test_rollout_rs_threshold_is_checked(threshold: object, message: str) -> None:
    with pytest.raises(SettingError, match=message):
        ObjectiveConfig(rollout_rs="token_k1", rollout_rs_threshold=threshold)


def test_the_config_reads_a_number_or_a_string(tmp_path: Path) -> None:
    from megatron_branch.errors import UserError
    from megatron_branch.train.config_io import load_config

    base = ["model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2, "
            "ffn_hidden_size: 32, max_position_embeddings: 64}", "data.task=needles",
            f"trainer.default_local_dir={tmp_path}", "actor.rollout_rs=token_k1"]  # fmt: skip
    assert load_config(None, [*base, "actor.rollout_rs_threshold=2.0"]).actor.rollout_rs_threshold == 2.0
    assert (
        load_config(None, [*base, "actor.rollout_rs_threshold=0.5_2"]).actor.rollout_rs_threshold == "0.5_2"
    )
    with pytest.raises(UserError, match="rollout_rs_threshold"):
        load_config(None, [*base, "actor.rollout_rs_threshold=true"])
    from megatron_branch.commands.flags import _number_or_text  # grad's --rollout-rs-threshold reads the same

    assert _number_or_text("2") == 2.0 and _number_or_text("0.5_2") == "0.5_2"
