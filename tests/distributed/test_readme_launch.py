"""The README's multi-process lines (`python -m megatron_branch.launch --standalone --nproc_per_node N -m
megatron_branch ...`) run as written inside this world-2 launch: the command after `-m megatron_branch`, its
placeholders bound to the tiny assets of examples/make_tiny_assets.py (MODEL_DIR: qwen2, HYBRID_DIR: the Qwen3.5
hybrid, CONFIG.yaml: a tiny config-defined policy), on both ranks, each rank's status 0. The launcher itself
(torchrun's arguments, one line and exit 2 on a user error) is tests/unit/test_torchrun_errors.py; the one-process
lines are tests/unit/test_readme.py.

The README's lines name 4 processes where the layout is TP2 (world = tp * cp * dp): at world 2 the same line runs
with dp 1, which is the same schedule on each TP group.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
from dist_helpers import shared_tmp
from readme_helpers import HYBRID_FAMILY, LAUNCH, bind, launched_args, make_tiny_assets, readme_commands

from megatron_branch.cli import main


@pytest.fixture(scope="module")
def assets() -> tuple[Path, Path]:
    d = shared_tmp("readme-launch-")
    if dist.get_rank() == 0:
        make_tiny_assets(d / "qwen2", "qwen2")
        make_tiny_assets(d / "hybrid", HYBRID_FAMILY)
    dist.barrier()
    yield d / "qwen2", d / "hybrid"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


def launcher_lines() -> list[str]:
    return [c for c in readme_commands() if c.startswith(LAUNCH)]


def test_the_readme_has_launcher_lines() -> None:
    lines = launcher_lines()
    assert len(lines) >= 3, lines
    assert {launched_args(c)[1].split()[1] for c in lines} >= {"train", "grad"}


@pytest.mark.parametrize("k", range(len(launcher_lines())))
def test_readme_launcher_line_runs_at_world_2(k: int, assets: tuple[Path, Path], capsys) -> None:
    nproc, cmd = launched_args(launcher_lines()[k])
    assert nproc in (2, 4), nproc  # a README line for a world this launch can stand for (TP2: dp 2 -> dp 1)
    argv = bind(cmd, "", assets[0], hybrid=assets[1])
    rc = main(argv)
    err = capsys.readouterr().err
    codes = [None] * dist.get_world_size()
    dist.all_gather_object(codes, rc)
    assert codes == [0] * len(codes), (argv, codes, err[-2000:])
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    if out is not None:
        assert out.exists(), out  # the output the line names was written
