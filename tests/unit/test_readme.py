"""The README's blocks run as written on the tiny assets (examples/make_tiny_assets.py): every command line of every
```bash block is either run here (placeholders such as MODEL_DIR bound to the tiny assets, `[optional]` parts
dropped, `...` standing for the line above's arguments) or listed in SKIPPED with where it is tested; every
```python block runs as written; the `grad` lines run on the tiny assets of every family make_tiny_assets.py offers
(its --family choices); the rollout format names every optional field the reader takes."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branch.cli import main

ROOT = Path(__file__).resolve().parents[2]

SKIPPED = {
    "make ": "the make targets are what CI runs (`.ci/run` -> make test)",
    ".venv/bin/python -m megatron_branch.launch ": "launches several processes: tests/distributed (one launch per "
    "world size) and tests/unit/test_torchrun_errors.py (the launcher itself)",
    ".venv/bin/python benchmarks/": "benchmarks are timed runs, not tests",
    "--plugin my_objectives.py": "a user's plugin file: tests/unit/test_objective_plugin.py",
    "--routing-replay": "needs a mixture-of-experts HF folder (the tiny assets are dense): tests/unit/test_moe_commands.py",
}


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def readme_commands() -> list[str]:
    """The command lines of the README's bash blocks (continuations joined, comments and [optional] parts cut)."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_every_readme_command_is_run_or_skipped_for_a_reason() -> None:
    cmds = readme_commands()
    assert len(cmds) >= 15
    for cmd in cmds:
        assert cmd.startswith(".venv/bin/") or cmd.startswith("make "), (
            f"README command not runnable as is: {cmd}"
        )


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("readme")
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_assets.py"), "--out", str(work)], check=True,
                   capture_output=True, cwd=ROOT)  # fmt: skip
    (work / "tiny.yaml").write_text(
        "model: {arch: {hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2,\n"
        "               ffn_hidden_size: 32, max_position_embeddings: 64}}\n"
        "data: {task: kv_retrieval, task_args: {num_pairs: 2, value_len: 2, value_chars: abcd}, num_prompts: 8,\n"
        "       train_batch_size: 2}\n"
        "rollout: {n: 2, response_length: 3}\n"
        f"trainer: {{total_training_steps: 1, default_local_dir: {work / 'run'}}}\n"
        "logging: {progress_bar: false, tensorboard: false, plot: false}\n"
    )
    return work


def bind(cmd: str, previous: str, work: Path) -> list[str]:
    """The README line with its placeholders bound to the tiny assets."""
    if " ... " in cmd:  # "grad ... --objective dpo": the arguments of the line above
        head, _, rest = cmd.partition(" ... ")
        cmd = previous.split(" --schedule")[0] + " " + rest
    cmd = re.sub(r"\[([^\]]*)\]", "", cmd)  # optional parts: the plain form is what must run
    cmd = re.sub(r"(\S+)\|\S+", r"\1", cmd)  # sigmoid|ipo: the first choice
    if "--objective dpo" in cmd:
        cmd = cmd.replace("rollouts.jsonl", "pairs.jsonl")
    subs = {
        "MODEL_DIR": work / "hf", "HF_DIR": work / "hf", "rollouts.jsonl": work / "rollouts.jsonl",
        "pairs.jsonl": work / "pairs.jsonl", "grads.safetensors": work / "grads.safetensors",
        "MCORE_DIR": work / "mcore", "HF_OUT": work / "hf_out", "CONFIG.yaml": work / "tiny.yaml",
    }  # fmt: skip
    args = [str(subs.get(a, a)) for a in shlex.split(cmd)]
    assert args[0] == ".venv/bin/megatron-branch", cmd
    if args[1] == "train" and args[2].startswith("examples/configs/"):
        # a shipped config writes under runs/ (made by `make demo`, the README's first command): here a temp folder
        args.append(f"trainer.default_local_dir={work / Path(args[2]).stem}")
    return [*args[1:], *(["--overwrite"] if args[1] in ("grad", "convert") else [])]


@pytest.mark.slow
def test_readme_commands_run_on_the_tiny_assets(assets: Path, capsys) -> None:
    ran, previous = [], ""
    for cmd in readme_commands():
        if any(cmd.startswith(k) or k in cmd for k in SKIPPED):
            continue
        argv = bind(cmd, previous, assets)
        previous = cmd if " ... " not in cmd else previous
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 0, (cmd, argv, err[-2000:])
        ran.append(argv[0] + (" " + argv[1] if argv[0] == "convert" else ""))
    assert {
        "train",
        "grad",
        "plan",
        "convert hf-to-mcore",
        "convert mcore-to-hf",
        "verify-conversion",
    } <= set(ran)


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


def test_tiny_asset_families_are_read() -> None:
    assert {"llama", "qwen2"} <= set(tiny_asset_families())


@pytest.mark.slow
@pytest.mark.parametrize("family", tiny_asset_families())
def test_readme_grad_lines_run_on_every_family(family: str, tmp_path: Path, capsys) -> None:
    """Each `grad` line of the README on the family's tiny assets (the MoE line on mixture-of-experts families)."""
    from megatron_branch.checkpoint.hf_io import load_hf_config
    from megatron_branch.models import ModelArch

    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_assets.py"), "--out", str(tmp_path),
                    "--family", family], check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    moe = ModelArch.from_hf_config(load_hf_config(str(tmp_path / "hf"))).is_moe
    ran, previous = 0, ""
    for cmd in readme_commands():
        if not cmd.startswith(".venv/bin/megatron-branch grad"):
            continue
        argv = bind(cmd, previous, tmp_path)
        previous = cmd if " ... " not in cmd else previous
        if "--plugin" in cmd or ("--routing-replay" in cmd and not moe):
            continue
        rc = main(argv)
        assert rc == 0, (family, argv, capsys.readouterr().err[-2000:])
        ran += 1
    assert ran >= 3 + moe


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
