"""patches/megatron_train_loop.patch at TP2: the plain and the patched megatron-core loop (examples/
megatron_train_loop.py), run in this launch's process group, give the same parameter shards on every rank after
three optimizer steps (float32, 1e-5 relative per parameter). The TP1 case is tests/unit/test_train_loop_patch.py.
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_branch.data import write_rollouts_jsonl
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/megatron_train_loop.py"


def _prepare(tmp: Path) -> tuple[Path, Path]:
    """This rank's own copy of the plain example and of the patched one (applied as a user would), plus inputs."""
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
    return plain, patched


def _run(script: Path, tmp: Path, out: str) -> None:
    """The script's `main(argv)`, in this process (it keeps the existing process group)."""
    main = runpy.run_path(str(script), run_name="megatron_train_loop")["main"]
    main(["--config", str(tmp / "config.json"), "--rollouts", str(tmp / "r.jsonl"), "--out", str(tmp / out),
          "--tp", "2", "--steps", "3", "--lr", "1e-4"])  # fmt: skip


def _mismatches(a_file: Path, b_file: Path) -> list[str]:
    a, b = load_file(a_file), load_file(b_file)
    if not a or a.keys() != b.keys():
        return [f"parameter names differ: {sorted(a)} vs {sorted(b)}"]
    bad = []
    for name in a:
        err = ((a[name] - b[name]).norm() / a[name].norm()).item()
        if not err <= 1e-5:
            bad.append(f"{name}: {err:.2e}")
    return bad


def _losses(text: str) -> list[float]:
    return [float(line.split()[-1]) for line in text.splitlines() if line.startswith("step ")]


@pytest.mark.world(2)
def test_patched_loop_matches_plain_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    rank = dist.get_rank()
    tmp = Path(tempfile.mkdtemp(prefix=f"loop-patch-tp2-rank{rank}-"))
    try:
        plain, patched = _prepare(tmp)
        seen = []
        for script, out in ((plain, "plain"), (patched, "patched")):
            _run(script, tmp, out)
            seen.append(_losses(capsys.readouterr().out))
        assert (tmp / "plain" / f"rank{rank}.safetensors").exists()
        bad = [f"rank {rank} {m}" for m in _mismatches(tmp / "plain" / f"rank{rank}.safetensors",
                                                       tmp / "patched" / f"rank{rank}.safetensors")]  # fmt: skip
        if rank == 0:  # TP rank 0 prints the losses: three steps happened and both loops saw the same ones
            if not (len(seen[0]) == 3 and seen[0][0] != seen[0][2]):
                bad.append(f"plain losses {seen[0]}: not three moving steps")
            if seen[1] != pytest.approx(seen[0], rel=1e-5):
                bad.append(f"losses differ: plain {seen[0]} patched {seen[1]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # every rank learns every rank's verdict (the launch shows rank 0's output only)
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, bad)
    assert [m for ms in every for m in ms] == []
