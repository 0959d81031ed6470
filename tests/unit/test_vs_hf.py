"""benchmarks/vs_hf.py: the per-rollout HF + SDPA peer computes the same loss and gradient as `grad --schedule
replay` (so the from-outside timing compares equal work), and its FLOP limit counts HF's logits on every row."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _vs_hf():
    spec = importlib.util.spec_from_file_location("vs_hf", ROOT / "benchmarks" / "vs_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_peer_and_replay_agree_and_the_limit_counts_every_row(tmp_path: Path) -> None:
    vs_hf = _vs_hf()
    vs_hf.assets(tmp_path)
    for name, cmd in vs_hf.commands(tmp_path).items():
        if name.endswith("/tiny"):
            subprocess.run(cmd, check=True, capture_output=True)
    (tmp_path / "hf_rollouts.safetensors").symlink_to(tmp_path / "hf_tiny.safetensors")
    (tmp_path / "replay_rollouts.safetensors").symlink_to(tmp_path / "replay_tiny.safetensors")
    assert vs_hf.check(tmp_path) < 1e-5
    limit = vs_hf.flop_limit(tmp_path / "hf", tmp_path / "rollouts.jsonl")
    # P=3000, G=8, S=100: the 8 x 3100-token rollouts' FLOPs with logits on all rows over the tree's minimal
    # FLOPs; above the fair (loss rows only) limit of the same tree, which the bench prints as 5.72x
    assert 7.0 < limit["limit"] < 8.5, limit
