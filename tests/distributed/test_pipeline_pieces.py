"""Root pieces (`root_pieces`, data/pieces.py) through the entry points users reach, at PP2 (world-2 launch).

    python tests/distributed/launch.py 2 -k pieces_through

- `megatron-branch grad --pp 2 --root-pieces 3 --dtype float64` equals `grad --schedule naive` (megatron's own
  attention, every rollout alone; on the same two ranks, DP2) per parameter at 1e-9.
- `train` with `schedule.root_pieces=3` at `parallel.pp=2`: tests/distributed/test_pipeline_train.py.

Each run also records what the pipeline was given (a spy on schedule/pipeline.py's `split_roots`): the flag must
reach the pipeline and cut every shared segment into 3 pieces, so a flag that were parsed and then dropped
(the pipeline running whole roots, which gives the same gradient) fails here. The pieces' own exactness, order and
planted bugs: tests/distributed/test_pipeline.py and tests/unit/test_root_pieces.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from dist_helpers import shared_tmp
from safetensors.torch import load_file
from test_objectives_parallel import VOCAB, _close, _rollouts

from megatron_branch.data import PrefixTree, Rollout, write_rollouts_jsonl
from megatron_branch.data.pieces import piece_lengths
from megatron_branch.schedule import pipeline as pipeline_mod
from megatron_branch.testing import tiny_hf_config, tiny_hf_model

LAYERS = 4


def spy_on_pieces(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Record every cut the pipeline makes: (pieces asked for, segments before, segments after)."""
    cuts: list[tuple[int, int, int]] = []
    real = pipeline_mod.split_roots

    def split_roots(tree: PrefixTree, pieces: int) -> PrefixTree:
        out = real(tree, pieces)
        cuts.append((pieces, len(tree.segments), len(out.segments)))
        return out

    monkeypatch.setattr(pipeline_mod, "split_roots", split_roots)
    return cuts


def expected_growth(tree: PrefixTree, pieces: int) -> int:
    """Segments a cut into `pieces` adds: pieces - 1 per shared segment (root or inner, with children) at least
    `pieces` tokens long, fewer for a shorter one (data/pieces.py)."""
    shared = [s for s in tree.segments if s.children]
    assert any(s.length >= pieces for s in shared)
    return sum(len(piece_lengths(s.length, pieces)) - 1 for s in shared)


def _grad(d: Path, name: str, capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    from megatron_branch.cli import main

    capsys.readouterr()
    rc = main(["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(d / f"{name}.st"),
               "--dtype", "float64", *flags])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, name
    dist.barrier()
    return json.loads(lines[-1]) if dist.get_rank() == 0 else {}


@pytest.mark.world(2)
def test_grad_root_pieces_through_the_command_equal_naive(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rollouts = _rollouts()
    d = shared_tmp("pp_pieces_")
    try:
        if dist.get_rank() == 0:
            config = tiny_hf_config("qwen2", vocab_size=VOCAB, num_layers=LAYERS, heads=4, kv_heads=2)
            tiny_hf_model(config, seed=5).save_pretrained(d / "hf")
            write_rollouts_jsonl(d / "r.jsonl", [Rollout(prompt=r.prompt, response=r.response,
                                                         advantage=r.advantage) for r in rollouts])  # fmt: skip
        dist.barrier()
        cuts = spy_on_pieces(monkeypatch)
        _grad(d, "naive", capsys, "--schedule", "naive")  # DP2: one prompt group per rank
        assert cuts == []  # naive runs no pipeline
        summary = _grad(d, "pieces", capsys, "--schedule", "replay", "--pp", "2", "--root-pieces", "3",
                        "--branch-micro-batch", "2")  # fmt: skip
        tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
        assert cuts == [(3, len(tree.segments), len(tree.segments) + expected_growth(tree, 3))], cuts
        if dist.get_rank() == 0:
            assert (summary["pp"], summary["root_pieces"], summary["schedule"]) == (2, 3, "replay")
            _close(load_file(d / "pieces.st"), load_file(d / "naive.st"), 1e-9)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(d, ignore_errors=True)
