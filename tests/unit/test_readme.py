"""The README's command blocks run as written on the tiny assets (examples/make_tiny_assets.py): every command line
of every ```bash block is either run here (placeholders such as MODEL_DIR bound to the tiny assets, `[optional]`
parts dropped, `...` standing for the line above's arguments) or listed in SKIPPED with where it is tested."""

from __future__ import annotations

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
    ".venv/bin/torchrun ": "launches under torchrun: tests/distributed (one torchrun launch per world size)",
    ".venv/bin/python benchmarks/": "benchmarks are timed runs, not tests",
    "--plugin my_objectives.py": "a user's plugin file: tests/unit/test_objective_plugin.py",
    "--routing-replay": "needs a mixture-of-experts HF folder (the tiny assets are dense): tests/unit/test_moe_commands.py",
}


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
