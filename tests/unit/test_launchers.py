"""Every launcher under examples/launch/ in dry-run mode (MB_DRY_RUN=1 prints its commands): the printed
`megatron-branch grad` command parses, its world size is tp * cp * dp, its layout is valid for the model and the
data, the preflight's planner command parses and plans the same layout, and each script's stated planner verdict
(header) is what the planner says today.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branch.cli import build_parser, main
from megatron_branch.data import PrefixTree, read_rollouts_jsonl
from megatron_branch.models import ModelArch
from megatron_branch.parallel.cp_layout import check_cp_fits
from megatron_branch.plan import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"
SCRIPTS = sorted(p.name for p in LAUNCH.glob("*.sh") if p.name != "common.sh")


def dry_run(script: str, work: Path) -> list[list[str]]:
    env = {**os.environ, "MB_DRY_RUN": "1", "MODEL": str(work / "hf"), "ROLLOUTS": str(work / "r.jsonl")}
    res = subprocess.run(["bash", str(LAUNCH / script), str(work)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return [shlex.split(line) for line in res.stdout.splitlines() if line.strip()]


def grad_args(cmds: list[list[str]]) -> tuple[int, list[str]]:
    (cmd,) = [c for c in cmds if Path(c[0]).name == "torchrun"]
    nproc = int(cmd[cmd.index("--nproc_per_node") + 1])
    i = cmd.index("-m")
    assert cmd[i + 1 : i + 3] == ["megatron_branch", "grad"], cmd
    return nproc, cmd[i + 2 :]


def plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_launchers_use_the_checkouts_venv_without_path_changes(tmp_path: Path) -> None:
    """A fresh clone after `make setup`: PATH without .venv/bin, the launcher still runs the venv's tools."""
    env = {"PATH": "/usr/bin:/bin", "MB_DRY_RUN": "1", "HOME": str(tmp_path)}
    res = subprocess.run(["bash", str(LAUNCH / "cpu_world2.sh"), str(tmp_path)], env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 0, res.stderr
    firsts = [shlex.split(line)[0] for line in res.stdout.splitlines() if line.strip()]
    venv = (ROOT / ".venv" / "bin").resolve()
    assert f"{venv}/python" in firsts and f"{venv}/torchrun" in firsts, firsts
    assert all(Path(f).exists() for f in firsts if f.startswith("/")), firsts


def test_every_launcher_is_tested() -> None:
    assert {"cpu_world1.sh", "cpu_world2.sh", "cpu_world4.sh"} <= set(SCRIPTS)
    assert {"target_7b_cp8.sh", "target_7b_tp2cp4.sh", "target_32b_cp8.sh", "target_32b_tp2cp4.sh"} <= set(
        SCRIPTS
    )


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("demo")
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_assets.py"), "--out", str(work)], check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True)  # fmt: skip
    return work


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.startswith("cpu_")])
def test_cpu_launcher_dry_run(script: str, tiny_assets: Path) -> None:
    cmds = dry_run(script, tiny_assets)
    assert any(
        Path(c[0]).name == "python" and c[1] == str(LAUNCH / ".." / "make_tiny_assets.py") for c in cmds
    )
    nproc, argv = grad_args(cmds)
    assert nproc == int(re.search(r"world(\d)", script).group(1))
    args = build_parser().parse_args(argv)  # argument parsing exactly as the command does it
    assert nproc % (args.tp * args.cp) == 0
    # config validation against the files the script points at (made by make_tiny_assets)
    arch = ModelArch.from_hf_config(json.loads((Path(args.hf) / "config.json").read_text()))
    arch.check_tensor_parallel(args.tp)
    tree = PrefixTree.build(read_rollouts_jsonl(args.rollouts, vocab_size=arch.vocab_size))
    check_cp_fits(tree, args.cp)
    assert Path(args.out).parent == tiny_assets


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.startswith("target_")])
def test_target_launcher_dry_run(script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cmds = dry_run(script, tmp_path)
    nproc, argv = grad_args(cmds)
    args = build_parser().parse_args(argv)
    assert nproc == 8 and args.tp * args.cp == 8  # dp 1: one prompt group
    assert args.schedule == "replay" and args.sequence_parallel == (args.tp > 1)
    # the preflight plans exactly this run
    (pre,) = [c for c in cmds if Path(c[0]).name == "megatron-branch" and c[1] == "plan"]
    run = plan_json(pre[1:], capsys)
    mode = "full" if args.recompute_layers else "selective" if args.recompute else "none"
    assert args.recompute or not args.recompute_layers  # full = segment recompute + layer checkpointing
    assert run["layout"] == {"tp": args.tp, "cp": args.cp, "dp": 1, "pp": 1, "recompute": mode}
    assert run["dtype"] == args.dtype == "float32"
    model = pre[pre.index("--model") + 1]
    MODEL_PRESETS[model].check_tensor_parallel(args.tp)
    # the header's planner command and verdict are what the planner says
    text = (LAUNCH / script).read_text()
    m = re.search(r"#\s+(megatron-branch plan .*?)\n#\s+(--gpus .*?)\n", text.replace("\\\n", "\n"))
    assert m, "the script must state its planner command"
    stated = shlex.split(m.group(1) + " " + m.group(2))
    d = plan_json([*stated[1:], "--json"], capsys)
    assert d["layout"]["tp"] == args.tp and d["layout"]["cp"] == args.cp
    total = f"{d['memory_bytes_per_rank']['total'] / 1e9:.1f} GB"
    assert total in text, (script, total)
    assert ("-> fits" in text) == d["fits"], script
