"""The README's command lines as tests run them (one home: tests/unit/test_readme.py runs the one-process lines,
tests/distributed/test_readme_launch.py the launcher lines at world 2): the lines of its ```bash blocks, their
placeholders bound to the tiny assets of examples/make_tiny_assets.py, which is run in-process (no second Python
start-up per family)."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAUNCH = ".venv/bin/python -m megatron_branch.launch --standalone --nproc_per_node "
"""How every multi-process README line starts (issue 35 item 6)."""

HYBRID_FAMILY = "qwen3_5"
"""The tiny assets HYBRID_DIR stands for (a Qwen3.5 hybrid: one gated-delta-net and one full-attention layer)."""

TINY_YAML = (
    "model: {arch: {hidden_size: 16, num_layers: 2, num_attention_heads: 2, num_query_groups: 2,\n"
    "               ffn_hidden_size: 32, max_position_embeddings: 64}}\n"
    "data: {task: kv_retrieval, task_args: {num_pairs: 2, value_len: 2, value_chars: abcd}, num_prompts: 8,\n"
    "       train_batch_size: 2}\n"
    "rollout: {n: 2, response_length: 3}\n"
    "trainer: {total_training_steps: 1, default_local_dir: RUN_DIR}\n"
    "logging: {progress_bar: false, tensorboard: false, plot: false}\n"
)
"""What CONFIG.yaml stands for: a tiny config-defined policy, one step."""


def readme_text() -> str:
    return (ROOT / "README.md").read_text()


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", readme_text(), flags=re.S)


def readme_commands() -> list[str]:
    """The command lines of the README's bash blocks (continuations joined, comments cut)."""
    out = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def make_tiny_assets(out: Path, family: str) -> Path:
    """examples/make_tiny_assets.py --out OUT --family FAMILY, run in this process; plus CONFIG.yaml (tiny.yaml)."""
    spec = importlib.util.spec_from_file_location(
        "make_tiny_assets", ROOT / "examples" / "make_tiny_assets.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out", str(out), "--family", family])
    (out / "tiny.yaml").write_text(TINY_YAML.replace("RUN_DIR", str(out / "run")))
    return out


def asset_families() -> tuple[str, ...]:
    """The --family choices of make_tiny_assets.py (it offers every registered family)."""
    from megatron_branch.models.families import families

    return families()


def launched_args(cmd: str) -> tuple[int, str]:
    """A launcher line -> (its --nproc_per_node, the megatron_branch command after `-m megatron_branch`)."""
    assert cmd.startswith(LAUNCH), cmd
    nproc, _, rest = cmd[len(LAUNCH) :].partition(" ")
    assert rest.startswith("-m megatron_branch "), cmd
    return int(nproc), ".venv/bin/megatron-branch " + rest[len("-m megatron_branch ") :]


def bind(cmd: str, previous: str, assets: Path, hybrid: Path | None = None) -> list[str]:
    """The README line with its placeholders bound to the tiny assets (`[optional]` parts dropped, `a|b` -> a, `...`
    = the arguments of the line above); the CLI's argv (without the program)."""
    if " ... " in cmd:  # "grad ... --objective dpo": the arguments of the line above
        head, _, rest = cmd.partition(" ... ")
        cmd = previous.split(" --schedule")[0] + " " + rest
    cmd = re.sub(r"\[([^\]]*)\]", "", cmd)  # optional parts: the plain form is what must run
    cmd = re.sub(r"(\S+)\|\S+", r"\1", cmd)  # sigmoid|ipo: the first choice
    if "--objective dpo" in cmd:
        cmd = cmd.replace("rollouts.jsonl", "pairs.jsonl")
    work = hybrid if "HYBRID_DIR" in cmd and hybrid is not None else assets
    subs = {
        "MODEL_DIR": work / "hf", "HF_DIR": work / "hf", "HYBRID_DIR": work / "hf",
        "rollouts.jsonl": work / "rollouts.jsonl", "pairs.jsonl": work / "pairs.jsonl",
        "grads.safetensors": work / "grads.safetensors", "MCORE_DIR": work / "mcore", "HF_OUT": work / "hf_out",
        "CONFIG.yaml": work / "tiny.yaml",
    }  # fmt: skip
    args = [str(subs.get(a, a)) for a in shlex.split(cmd)]
    assert args[0] == ".venv/bin/megatron-branch", cmd
    if args[1] == "train" and args[2].startswith("examples/configs/"):
        # a shipped config writes under runs/ (made by `make demo`, the README's first command): here a temp folder
        args.append(f"trainer.default_local_dir={work / Path(args[2]).stem}")
    return [*args[1:], *(["--overwrite"] if args[1] in ("grad", "convert") else [])]
