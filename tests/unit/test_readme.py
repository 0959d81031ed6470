"""The README's blocks run as written on the tiny assets (examples/make_tiny_assets.py): every command line of every
```bash block is either run here (placeholders such as MODEL_DIR bound to the tiny assets, `[optional]` parts
dropped, `...` standing for the line above's arguments; tests/readme_helpers.py) or listed in SKIPPED with where
it is tested; every ```python block runs as written; the lines that read an HF folder (`grad`, `convert`,
`verify-conversion`) run on the tiny assets of every family make_tiny_assets.py offers (its --family choices), the
others once; the launcher lines run at world 2 (tests/distributed/test_readme_launch.py); the rollout format names
every optional field the reader takes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from readme_helpers import (
    LAUNCH,
    ROOT,
    TINY_YAML,
    asset_families,
    bind,
    make_tiny_assets,
    readme_blocks,
    readme_commands,
)

from megatron_branch.cli import main

SKIPPED = {
    "make ": "the make targets are what CI runs (`.ci/run` -> make test)",
    LAUNCH: "several processes: run at world 2 in tests/distributed/test_readme_launch.py (the launcher itself: "
    "tests/unit/test_torchrun_errors.py)",
    ".venv/bin/python benchmarks/": "benchmarks are timed runs, not tests",
    "--plugin my_objectives.py": "a user's plugin file: tests/unit/test_objective_plugin.py",
}

ASSET_COMMANDS = ("grad", "convert", "verify-conversion")
"""The commands that read the tiny HF assets: their lines run on every family's (the others once)."""


def skipped(cmd: str) -> bool:
    return any(cmd.startswith(k) or k in cmd for k in SKIPPED)


def test_every_readme_command_is_run_or_skipped_for_a_reason() -> None:
    cmds = readme_commands()
    assert len(cmds) >= 15
    for cmd in cmds:
        assert cmd.startswith(".venv/bin/") or cmd.startswith("make "), (
            f"README command not runnable as is: {cmd}"
        )


@pytest.mark.slow
def test_readme_commands_run_on_the_tiny_assets(tmp_path: Path, capsys) -> None:
    """The lines that need no HF folder (train on CONFIG.yaml and the shipped tiny MoE config, plan), once."""
    (tmp_path / "tiny.yaml").write_text(TINY_YAML.replace("RUN_DIR", str(tmp_path / "run")))
    ran = []
    for cmd in readme_commands():
        if skipped(cmd) or cmd.split()[1] in ASSET_COMMANDS:
            continue
        argv = bind(cmd, "", tmp_path)
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 0, (cmd, argv, err[-2000:])
        ran.append(argv[0])
    assert ran.count("train") >= 2 and "plan" in ran, ran


def test_the_demo_prints_the_summary_the_readme_shows() -> None:
    """The README's demo lines are what `train` prints (metrics.run_summary), figures aside."""
    from megatron_branch.train.metrics import run_summary

    text = (ROOT / "README.md").read_text()
    shown = [ln for ln in text.splitlines() if ln.startswith(("mean reward, first", "positions per step:"))]
    rows = [
        {"step": k + 1, "reward_mean": 0.5, "positions_logical": 7, "positions_computed": 3}
        for k in range(40)
    ]
    printed = run_summary(rows)

    def shape(line: str) -> str:
        return re.sub(r"\d+(\.\d+)?", "N", line)

    assert [shape(x) for x in shown] == [shape(x) for x in printed], (shown, printed)


def test_multi_process_examples_use_the_launcher() -> None:
    """Issue 35 item 6: the README's multi-process lines go through megatron_branch.launch (one clean line and exit
    status 2 on a user error), never plain torchrun."""
    launched = [c for c in readme_commands() if "--nproc_per_node" in c]
    assert len(launched) >= 3
    assert all(c.startswith(".venv/bin/python -m megatron_branch.launch --standalone ") for c in launched), (
        launched
    )


def test_rollout_format_names_every_optional_field() -> None:
    from megatron_branch.data.rollouts import TOKEN_FIELDS

    text = (ROOT / "README.md").read_text()
    para = text[text.index("`rollouts.jsonl` holds one rollout a line") :].split("\n\n")[0]
    for name in (*TOKEN_FIELDS, "advantage", "pair", "chosen", "routed_experts"):
        assert f"`{name}`" in para, name


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path: Path) -> None:
    blocks = readme_blocks("python")
    assert blocks
    for code in blocks:
        p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert p.returncode == 0, p.stderr[-3000:]


def tiny_asset_families() -> list[str]:
    """The --family choices of examples/make_tiny_assets.py, as its own --help says them."""
    usage = subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_assets.py"), "--help"],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    found = re.search(r"--family \{([^}]*)\}", usage.stdout)
    assert found, f"make_tiny_assets.py --help shows no --family {{choices}}: {usage.stdout[:300]}"
    return found.group(1).split(",")


def test_tiny_asset_families_are_every_registered_family() -> None:
    assert set(tiny_asset_families()) == set(asset_families())
    assert {"llama", "qwen2", "qwen3_5", "qwen3_moe"} <= set(asset_families())


@pytest.mark.slow
@pytest.mark.parametrize("family", asset_families())
def test_readme_lines_run_on_every_family(family: str, tmp_path: Path, capsys) -> None:
    """Every one-process README line that reads the tiny HF assets (each `grad` line, the MoE one on mixtures of
    experts; `convert` both ways; `verify-conversion`) on the family's tiny assets."""
    from megatron_branch.checkpoint.hf_io import load_hf_config
    from megatron_branch.models import ModelArch

    make_tiny_assets(tmp_path, family)
    capsys.readouterr()
    moe = ModelArch.from_hf_config(load_hf_config(str(tmp_path / "hf"))).is_moe
    ran, previous = [], ""
    for cmd in readme_commands():
        if cmd.split()[1] not in ASSET_COMMANDS:
            continue
        argv = bind(cmd, previous, tmp_path)
        previous = cmd if " ... " not in cmd else previous
        if skipped(cmd) or ("--routing-replay" in cmd and not moe):
            continue
        rc = main(argv)
        assert rc == 0, (family, argv, capsys.readouterr().err[-2000:])
        ran.append(" ".join(argv[:2]) if argv[0] == "convert" else argv[0])
    assert ran.count("grad") >= 3 + moe, ran
    assert {"convert hf-to-mcore", "convert mcore-to-hf", "verify-conversion"} <= set(ran), ran


def test_demo_block_is_rewritten_from_a_runs_output(tmp_path: Path) -> None:
    """tools/demo_block.py puts a run's printed lines into the README's and docs/training.md's demo blocks."""
    sys.path.insert(0, str(ROOT / "tools"))
    import demo_block

    log = tmp_path / "demo.log"
    log.write_text("supervised warm-up: ...\nwarm-up done after 7 steps; RL starts\nnoise\n"
                   "mean reward, first 10 steps: 0.123    last 10 steps: 0.456    (40 steps)\n"
                   "positions per step: logical 1000, computed 100\nmetrics:    runs/demo/metrics.jsonl\n")  # fmt: skip
    docs = []
    for src in demo_block.DOCS:
        docs.append(tmp_path / src.name)
        docs[-1].write_text(src.read_text())
    assert demo_block.main([str(log), "--docs", *map(str, docs)]) == 0
    for doc in docs:
        text = doc.read_text()
        assert ("```\nwarm-up done after 7 steps; RL starts\nmean reward, first 10 steps: 0.123    last 10 steps: "
                "0.456    (40 steps)\npositions per step: logical 1000, computed 100\n```") in text  # fmt: skip
    assert demo_block.main([str(log), "--check", "--docs", *map(str, docs)]) == 0  # now current
    # the shipped docs hold one run's lines: the README's block, fed back, leaves both files as they are
    readme = (ROOT / "README.md").read_text()
    shown = readme[readme.index("warm-up done after") :].split("```")[0]
    log.write_text(shown)
    assert demo_block.main([str(log), "--check"]) == 0, "README.md and docs/training.md show different runs"


def test_make_demo_checks_its_figures_against_the_readme_within_the_tolerance(tmp_path: Path) -> None:
    """`make demo` ends with `tools/demo_block.py runs/demo.log --within`: the figures it printed must be the README
    block's within demo_block.TOLERANCE (rewards 0.05 absolute, positions 3%, warm-up 10 steps, RL steps exact)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import demo_block

    make = (ROOT / "Makefile").read_text()
    recipe = make[make.index("\ndemo:") :].split("\n\n")[0]
    assert "pipefail" in recipe and "| tee runs/demo.log" in recipe, recipe
    assert recipe.rstrip().endswith("tools/demo_block.py runs/demo.log --within"), recipe
    readme = (ROOT / "README.md").read_text()
    shown = readme[readme.index("warm-up done after") :].split("```")[0]
    shown_figures = demo_block.figures(shown.splitlines())
    assert set(shown_figures) == {
        "warm-up", "reward first", "reward last", "steps", "positions logical", "positions computed"
    }  # fmt: skip

    def run_with(**changes: float) -> int:
        f = {**shown_figures, **changes}
        log = tmp_path / "demo.log"
        log.write_text(
            f"noise\nwarm-up done after {f['warm-up']:.0f} steps; RL starts\n  step 3 ...\n"
            f"mean reward, first 10 steps: {f['reward first']:.3f}    last 10 steps: {f['reward last']:.3f}    "
            f"({f['steps']:.0f} steps)\npositions per step: logical {f['positions logical']:.0f}, computed "
            f"{f['positions computed']:.0f}\n"
        )
        return demo_block.main([str(log), "--within"])

    assert run_with() == 0
    assert run_with(**{"reward last": shown_figures["reward last"] - 0.04}) == 0  # another machine's figure
    assert run_with(**{"positions computed": shown_figures["positions computed"] * 1.02}) == 0
    assert run_with(**{"reward last": shown_figures["reward last"] - 0.1}) == 1  # a demo that learns less
    assert run_with(**{"positions logical": shown_figures["positions logical"] * 1.1}) == 1
    assert run_with(**{"warm-up": shown_figures["warm-up"] + 20}) == 1
    assert run_with(steps=shown_figures["steps"] + 1) == 1
