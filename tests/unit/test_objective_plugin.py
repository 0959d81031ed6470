"""A new objective plugs in from outside the package: this file registers a toy per-token objective, and it trains
through `megatron-branch grad` and `train` (the same builder, the same names) without a package file changed.

The toy is half the linear policy gradient, written independently (its own per-token `terms`): every gradient is
exactly half of `--objective pg`'s, and its loss half of pg's, which a wrong registration, a silently substituted
built-in or a lost aggregation weight would break.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_branch.cli import main
from megatron_branch.data import write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.losses import TokenObjective, load_plugins, register_policy_loss
from megatron_branch.losses.registry import POLICY_LOSSES
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

THIS = str(Path(__file__).resolve())


@register_policy_loss("toy_half_pg")
@dataclass(kw_only=True)
class HalfPolicyGradient(TokenObjective):
    """L = sum_{i,t} w_i * (-0.5 A_i logp_{i,t}), aggregated as loss_agg_mode says (token-mean: w_i = 1/T)."""

    def pair_data(self, pairs):  # noqa: ANN001, ANN201
        return {"adv": pairs.field("advantages", scalar="advantage")[0]}

    def stats(self) -> tuple[tuple[str, str], ...]:
        return (("actor/toy_logp", "agg"),)

    def terms(self, logp, entropy, d):  # noqa: ANN001, ANN201
        return -0.5 * d["adv"] * logp, [logp]


# ---- the registry and the plugin loader -----------------------------------------------------------------------


def test_plugin_file_registers_and_names_are_checked(tmp_path: Path) -> None:
    plugin = tmp_path / "my_losses.py"
    plugin.write_text(
        "from dataclasses import dataclass\n"
        "from megatron_branch.losses import TokenObjective, register_policy_loss\n"
        "@register_policy_loss('tmp_plugin_loss')\n"
        "@dataclass(kw_only=True)\n"
        "class Tmp(TokenObjective):\n"
        "    def terms(self, x, entropy, d):\n"
        "        return x, []\n"
    )
    assert "tmp_plugin_loss" not in POLICY_LOSSES
    load_plugins([str(plugin)])
    load_plugins([str(plugin)])  # the same file again: not re-imported, no double registration
    assert POLICY_LOSSES["tmp_plugin_loss"].__name__ == "Tmp"
    load_plugins([THIS])  # pytest already imported this file: recognised by its path
    assert POLICY_LOSSES["toy_half_pg"] is HalfPolicyGradient
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("toy_half_pg")(type("Other", (TokenObjective,), {"terms": None}))
    with pytest.raises(UserError, match="no such file"):
        load_plugins([str(tmp_path / "missing.py")])
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UserError, match="cannot import .*broken.py.*RuntimeError: boom"):
        load_plugins([str(tmp_path / "broken.py")])


# ---- through grad ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plugin")
    tiny_hf_model(tiny_hf_config("llama"), seed=3).save_pretrained(d / "hf")
    write_rollouts_jsonl(d / "r.jsonl", random_tree_rollouts(groups=2, levels=2, branches=3, seed=4))
    return d


def _grad(d: Path, capsys: pytest.CaptureFixture[str], out: str, *extra: str) -> tuple[int, dict, str]:
    argv = ["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(d / out)]
    rc = main([*argv, "--dtype", "float64", "--overwrite", *extra])
    cap = capsys.readouterr()
    lines = [ln for ln in cap.out.splitlines() if ln.strip()]
    return rc, (json.loads(lines[-1]) if rc == 0 else {}), cap.err.strip()


def _half(got: dict[str, torch.Tensor], full: dict[str, torch.Tensor]) -> None:
    assert got.keys() == full.keys()
    for n, g in full.items():
        assert ((got[n] - 0.5 * g).norm() / g.norm()).item() <= 1e-12, n


def test_registered_objective_trains_through_grad(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, pg, _ = _grad(workdir, capsys, "pg.st", "--objective", "pg")
    assert rc == 0
    rc, toy, _ = _grad(workdir, capsys, "toy.st", "--plugin", THIS, "--objective", "toy_half_pg")
    assert rc == 0 and toy["objective"] == "toy_half_pg"
    _half(load_file(workdir / "toy.st"), load_file(workdir / "pg.st"))
    assert toy["loss"] == pytest.approx(0.5 * pg["loss"], rel=1e-12)
    assert "actor/toy_logp" in toy["metrics"]  # its own metric, summed like the loss


def test_unknown_objective_is_one_line(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _grad(workdir, capsys, "never.st", "--objective", "nope")
    assert rc == 2 and "\n" not in err
    assert "unknown --objective 'nope'; registered:" in err and "toy_half_pg" in err and "--plugin" in err
    assert not (workdir / "never.st").exists()


@pytest.mark.slow
def test_plugin_file_loads_in_a_fresh_process(workdir: Path) -> None:
    """The command line alone (a fresh interpreter that never imported this file) finds the objective."""
    out = workdir / "sub.st"
    argv = ["grad", "--hf", str(workdir / "hf"), "--rollouts", str(workdir / "r.jsonl"), "--out", str(out)]
    flags = ["--dtype", "float64", "--overwrite", "--plugin", THIS, "--objective", "toy_half_pg"]
    p = subprocess.run(
        [sys.executable, "-m", "megatron_branch", *argv, *flags], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1])["objective"] == "toy_half_pg"
    ref = workdir / "sub_pg.st"
    assert main([*argv[:-1], str(ref), "--dtype", "float64", "--overwrite"]) == 0
    _half(load_file(out), load_file(ref))


# ---- through train ---------------------------------------------------------------------------------------------

REWARD = '''
def reward(prompt, response, row):
    """Varies with every sampled character, so the group-relative advantages are not all zero."""
    return sum(ord(c) * (k + 1) for k, c in enumerate(response)) % 11 / 10
'''


def _train(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.loop import Trainer

    cfg = load_config(
        None,
        [
            "model.arch={hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 1, "
            "ffn_hidden_size: 32, max_position_embeddings: 64}",
            "model.dtype=float64",
            f"data.train_files={tmp_path / 'prompts.jsonl'}",
            "data.reward=plugin_copy_reward:reward",
            "data.train_batch_size=2",
            "rollout.n=2",
            "rollout.response_length=4",
            "optim.lr=0.01",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / name}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.plot=false",
            "checkpoint.hf_export=false",
            *overrides,
        ],
    )
    tr = Trainer(cfg)
    rows = []
    while tr.step < cfg.trainer.total_training_steps:
        rows.append(tr.train_step())
    return rows


def test_registered_objective_trains_through_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "plugin_copy_reward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": f"copy {w} :", "answer": w} for w in ("abc", "bca", "cab", "acb")]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pg = _train(tmp_path, "pg", "actor.policy_loss=pg")
    toy = _train(tmp_path, "toy", f"algorithm.plugins=[{THIS}]", "actor.policy_loss=toy_half_pg")
    assert [m["step"] for m in toy] == [1, 2]
    assert all("actor/toy_logp" in m for m in toy) and not any("actor/toy_logp" in m for m in pg)
    # step 1 samples the same rollouts from the same initial policy: the toy's loss is exactly half of pg's
    assert toy[0]["critic/score/mean"] == pg[0]["critic/score/mean"]
    assert toy[0]["loss"] == pytest.approx(0.5 * pg[0]["loss"], rel=1e-12)
    assert toy[0]["loss"] != 0
