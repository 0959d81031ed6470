"""patches/megatron_train_loop.patch: the multi-step megatron-core loop (model from a spec, megatron DDP, optimizer +
megatron scheduler, megatron's get_forward_backward_func) patched to branch replay gives the same parameters after
three optimizer steps as the plain loop, at TP1 in this process, float32 1e-5 per parameter. The TP2 case runs in
the distributed suite's launch: tests/distributed/test_train_loop_patch_tp.py.
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_branch.data import write_rollouts_jsonl
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/megatron_train_loop.py"


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("loop")
    (tmp / "examples").mkdir()
    plain = tmp / "plain.py"
    shutil.copy(ROOT / SCRIPT, plain)
    shutil.copy(ROOT / SCRIPT, tmp / SCRIPT)
    subprocess.run(["git", "apply", str(ROOT / "patches" / "megatron_train_loop.patch")], cwd=tmp, check=True)
    patched = tmp / SCRIPT
    assert "megatron_branch.integration" in patched.read_text()
    assert "megatron_branch.integration" not in plain.read_text()
    (tmp / "config.json").write_text(json.dumps(tiny_hf_config("qwen2", vocab_size=38).to_dict()))
    rollouts = random_tree_rollouts(vocab_size=38, groups=2, prompt_len=10, branches=3, levels=2, seed=8)
    write_rollouts_jsonl(tmp / "r.jsonl", rollouts)
    return tmp, plain, patched


def args(tmp: Path, out: str, tp: int) -> list[str]:
    return ["--config", str(tmp / "config.json"), "--rollouts", str(tmp / "r.jsonl"), "--out", str(tmp / out),
            "--tp", str(tp), "--steps", "3", "--lr", "1e-4"]  # fmt: skip


def compare(a_dir: Path, b_dir: Path, world: int) -> None:
    for r in range(world):
        a, b = load_file(a_dir / f"rank{r}.safetensors"), load_file(b_dir / f"rank{r}.safetensors")
        assert a.keys() == b.keys() and a
        for name in a:
            err = ((a[name] - b[name]).norm() / a[name].norm()).item()
            assert err <= 1e-5, f"rank {r} {name}: {err:.2e}"


def losses(text: str) -> list[float]:
    return [float(line.split()[-1]) for line in text.splitlines() if line.startswith("step ")]


@pytest.mark.slow
def test_patched_loop_matches_plain_tp1(
    scripts: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tmp, plain, patched = scripts
    seen = []
    for script, out in ((plain, "plain1"), (patched, "patched1")):
        monkeypatch.setattr(sys, "argv", [str(script), *args(tmp, out, 1)])
        runpy.run_path(str(script), run_name="__main__")
        seen.append(losses(capsys.readouterr().out))
    compare(tmp / "plain1", tmp / "patched1", 1)
    # three optimizer steps happened (the loss moves) and both loops saw the same losses
    assert len(seen[0]) == 3 and seen[0][0] != seen[0][2]
    assert seen[1] == pytest.approx(seen[0], rel=1e-5)
