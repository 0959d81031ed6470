"""patches/branch_replay.patch applies cleanly to the plain step and gives the same gradients."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]


def run_script(path: Path, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    runpy.run_path(str(path), run_name="__main__")


@pytest.mark.slow
def test_patch_applies_and_matches_plain_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "plain_grpo_step.py", tmp_path / "examples" / "plain_grpo_step.py")
    plain = tmp_path / "plain.py"
    shutil.copy(ROOT / "examples" / "plain_grpo_step.py", plain)
    subprocess.run(["git", "apply", str(ROOT / "patches" / "branch_replay.patch")], cwd=tmp_path, check=True)
    patched = tmp_path / "examples" / "plain_grpo_step.py"
    assert "run_schedule" in patched.read_text() and "run_schedule" not in plain.read_text()

    tiny_hf_model(tiny_hf_config("qwen2"), seed=4).save_pretrained(tmp_path / "hf")
    rollouts = random_tree_rollouts(prompt_len=12, branches=3, levels=2, seed=6)
    rollouts.append(
        Rollout(prompt=[], response=[3, 1, 4, 1, 5], advantage=0.7)
    )  # no prompt: first token unscored
    write_rollouts_jsonl(tmp_path / "r.jsonl", rollouts)
    common = ["--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "r.jsonl"), "--out"]
    run_script(plain, [*common, str(tmp_path / "plain.safetensors")], monkeypatch)
    run_script(patched, [*common, str(tmp_path / "patched.safetensors")], monkeypatch)
    a, b = load_file(tmp_path / "plain.safetensors"), load_file(tmp_path / "patched.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        err = ((a[name] - b[name]).norm() / a[name].norm()).item()
        assert err <= 1e-5, f"{name}: {err:.2e}"
