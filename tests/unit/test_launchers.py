"""Every launcher under examples/launch/ in dry-run mode (MB_DRY_RUN=1 prints its commands): the printed
`megatron-branch grad` command parses, its world size is tp * cp * dp, its layout is valid for the model and the
data, the preflight's planner command parses and plans the same layout, and each script's stated planner verdict
(header) is what the planner says today.

The training launchers (`target_*_train.sh`): the planner's search for the target (the header's command, its JSON)
and the launcher's `megatron-branch train` options (its config file with the launcher's overrides, validated as
`train` validates them) agree on every choice (layout, SP, recompute, optimizer, offload fraction, branch
micro-batch, dtype, the shape); the header states the plan's per-rank memory; and the same script scaled down
(SCALE=tiny, 2 ranks) trains, with those options reaching the run (its engine.json: what megatron was given).

The two-node launcher (`target_*_2node.sh`, a 70B-class policy on 2 x 8 GPUs): the same agreement with the planner's
search, torchrun's node flags from the environment (a missing one is named), and the same script scaled down as two
"nodes" on this machine (two torchrun agents, NODE_RANK 0 and 1, joined at 127.0.0.1) trains.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_branch.cli import build_parser, main
from megatron_branch.data import PrefixTree, read_rollouts_jsonl
from megatron_branch.models import ModelArch
from megatron_branch.parallel.cp_layout import check_cp_fits
from megatron_branch.plan import MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "examples" / "launch"
SCRIPTS = sorted(p.name for p in LAUNCH.glob("*.sh") if p.name != "common.sh")
TRAIN_SCRIPTS = [s for s in SCRIPTS if s.endswith("_train.sh")]
NODE_SCRIPTS = [s for s in SCRIPTS if s.endswith("_2node.sh")]


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
    rc = main(argv)
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == (0 if d["fits"] else 1)  # 1: nothing fits
    return d


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
    assert {"target_32b_train.sh", "target_27b_train.sh"} <= set(TRAIN_SCRIPTS)
    assert NODE_SCRIPTS == ["target_72b_2node.sh"]


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


@pytest.mark.parametrize(
    "script", [s for s in SCRIPTS if s.startswith("target_") and s not in TRAIN_SCRIPTS + NODE_SCRIPTS]
)
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


# ---- the training launchers -----------------------------------------------------------------------------------------
def stated_plan(script: str) -> tuple[list[str], str]:
    """(the header's planner command, the header's text)."""
    text = (LAUNCH / script).read_text()
    m = re.search(r"#\s+(megatron-branch plan .*?)\n#\s+(--gpus .*?)\n", text)
    assert m, "the script must state its planner command"
    return shlex.split(m.group(1) + " " + m.group(2)), text


def train_command(cmds: list[list[str]]) -> tuple[int, str, list[str]]:
    """(nproc, config file, overrides) of the launcher's `megatron_branch train` command."""
    (cmd,) = [c for c in cmds if Path(c[0]).name == "torchrun"]
    i = cmd.index("-m")
    assert cmd[i + 1 : i + 3] == ["megatron_branch", "train"], cmd
    return int(cmd[cmd.index("--nproc_per_node") + 1]), cmd[i + 3], cmd[i + 4 :]


def assert_config_is_the_plan(cfg: Any, plan: dict, world: int, hf: Path) -> None:
    """A launcher's train config (validated as `train` validates it: layout vs model, context, rules) makes every
    choice the planner's JSON made."""
    lay, opt, shape = plan["layout"], plan["optimizer"], plan["shape"]
    assert world == plan["gpu"]["count"] and cfg.parallel.data_parallel_size(world) == lay["dp"]
    assert (cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp) == (lay["tp"], lay["cp"], lay.get("pp", 1))
    assert cfg.parallel.sequence_parallel == (lay["tp"] > 1)  # the planner's activations assume SP under TP
    assert (cfg.schedule.recompute, cfg.schedule.enable_gradient_checkpointing) == {
        "none": (False, False), "selective": (True, False), "full": (True, True)
    }[lay["recompute"]]  # fmt: skip
    assert cfg.schedule.name == plan["schedule"]
    assert (cfg.schedule.branch_micro_batch, cfg.schedule.root_pieces) == (
        plan["branch_micro_batch"],
        plan["root_pieces"],
    )
    o = cfg.optim
    assert o.use_distributed_optimizer == opt["use_distributed_optimizer"]
    assert o.optimizer_cpu_offload == opt["optimizer_cpu_offload"]
    assert o.optimizer_offload_fraction == opt["optimizer_offload_fraction"] or not o.optimizer_cpu_offload
    # the planner's exact 12 B
    assert (o.main_grads_dtype, o.exp_avg_dtype, o.exp_avg_sq_dtype) == ("fp32", "fp32", "fp32")
    assert {"bf16": "bfloat16", "float32": "float32"}[plan["dtype"]] == cfg.model.dtype
    assert (cfg.rollout.n, cfg.rollout.response_length) == (shape["responses"], shape["response_length"])
    assert (
        cfg.data.max_prompt_length == shape["prompt_length"] and cfg.data.train_batch_size == shape["prompts"]
    )
    assert cfg.algorithm.name == "grpo" and cfg.model.hf_path == str(hf)


@pytest.mark.parametrize("script", TRAIN_SCRIPTS)
def test_train_launcher_runs_the_planners_choice(script: str, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from megatron_branch.train.config_io import load_config

    stated, text = stated_plan(script)
    plan = plan_json([*stated[1:], "--json"], capsys)
    assert plan["fits"] and not any(a in stated for a in ("--tp", "--cp", "--dp", "--recompute")), (
        stated
    )  # a search
    total = plan["memory_bytes_per_rank"]["total"] / 1e9
    assert f"{total:.1f} GB" in text and "-> fits" in text, (script, total)
    model = stated[stated.index("--model") + 1]
    # the launcher's own commands, with a config.json of the planner's model (the target's sizes and context)
    hf = tmp_path / "model"
    MODEL_PRESETS[model].to_hf_config().save_pretrained(hf)
    env = {**os.environ, "MB_DRY_RUN": "1", "MODEL": str(hf), "TRAIN_FILES": str(tmp_path / "p.jsonl"),
           "REWARD": "my_reward:score", "OUT": str(tmp_path / "run")}  # fmt: skip
    res = subprocess.run(["bash", str(LAUNCH / script)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line) for line in res.stdout.splitlines() if line.strip()]
    nproc, config, overrides = train_command(cmds)
    assert nproc == plan["gpu"]["count"]
    assert_config_is_the_plan(load_config(config, overrides), plan, nproc, hf)
    assert_preflight_is_the_plan(cmds, plan, capsys)


def assert_preflight_is_the_plan(
    cmds: list[list[str]], plan: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher's preflight asks the planner about exactly the searched plan's layout: the same plan."""
    (pre,) = [c for c in cmds if Path(c[0]).name == "megatron-branch" and c[1] == "plan"]
    fixed = plan_json(pre[1:], capsys)
    assert fixed["fits"] and fixed["memory_bytes_per_rank"] == plan["memory_bytes_per_rank"]
    assert (fixed["layout"], fixed["optimizer"]) == (plan["layout"], plan["optimizer"])
    assert (fixed["branch_micro_batch"], fixed["root_pieces"]) == (
        plan["branch_micro_batch"],
        plan["root_pieces"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", TRAIN_SCRIPTS)
def test_train_launcher_scaled_down_trains_with_the_plans_options(script: str, tmp_path: Path) -> None:
    """SCALE=tiny: the same script, the same options, a tiny model on 2 ranks (TP2 + SP); engine.json says what
    megatron was given."""
    import yaml

    out = tmp_path / "run"
    env = {**os.environ, "SCALE": "tiny", "NPROC": "2", "OUT": str(out), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", str(LAUNCH / script)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    rec = json.loads((out / "engine.json").read_text())
    full = yaml.safe_load((LAUNCH / ".." / "configs" / script.replace(".sh", ".yaml")).read_text())
    o = full["optim"]
    assert rec["param_dtypes"] == ["bfloat16"] == [cfg["model"]["dtype"]]
    assert rec["main_grad_dtypes"] == ["float32"] and rec["main_param_dtypes"] == ["float32"]
    distributed = o["use_distributed_optimizer"]  # the plan's choice (27B: the plain optimizer)
    assert rec["ddp"] == {"grad_reduce_in_fp32": True, "use_distributed_optimizer": distributed}
    mc = rec["optimizer_config"]
    assert mc["bf16"] and mc["params_dtype"] == "bfloat16" and mc["main_grads_dtype"] == "float32"
    if distributed:  # with part of its state on the host
        assert rec["optimizer"] == ["DistributedOptimizer"] and rec["inner_optimizer"] == [
            "HybridDeviceOptimizer"
        ]
        assert (
            mc["use_distributed_optimizer"]
            and mc["optimizer_cpu_offload"]
            and mc["use_precision_aware_optimizer"]
        )
        assert mc["optimizer_offload_fraction"] == o["optimizer_offload_fraction"]
        host, total = rec["offload"]["host_elements"], rec["offload"]["elements"]
        assert o["optimizer_offload_fraction"] * total <= host < total  # megatron offloads whole shards
    else:
        assert not mc["use_distributed_optimizer"] and not mc["optimizer_cpu_offload"]
    assert rec["layout"] == {"tp": 2, "cp": 1, "dp": 1, "pp": 1, "sequence_parallel": True}
    assert rec["schedule"] == {"name": "replay", "recompute": True, "recompute_layers": True,
                               "branch_micro_batch": full["schedule"]["branch_micro_batch"],
                               "root_pieces": 1}  # fmt: skip
    assert rec["layers_checkpoint_themselves"]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["positions_computed"] < s["positions_logical"] for s in steps)  # replay shared the prompt
    hf_cfg = json.loads((out / "hf" / "config.json").read_text())
    assert hf_cfg.get("torch_dtype", hf_cfg.get("dtype")) == "bfloat16"  # the bf16 export


# ---- the two-node launcher -------------------------------------------------------------------------------------------
NODE_ENV = {"NODE_RANK": "1", "MASTER_ADDR": "node0.example", "MASTER_PORT": "29500"}


def _node_run(script: str, tmp_path: Path, hf: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "MB_DRY_RUN": "1", "MODEL": str(hf), "TRAIN_FILES": str(tmp_path / "p.jsonl"),
            "REWARD": "my_reward:score", "OUT": str(tmp_path / "run"), **NODE_ENV, **env}  # fmt: skip
    full = {k: v for k, v in full.items() if v}  # an empty value: unset
    return subprocess.run(["bash", str(LAUNCH / script)], env=full, capture_output=True, text=True)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("script", NODE_SCRIPTS)
def test_two_node_launcher_runs_the_planners_choice(script: str, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The header's planner search (16 GPUs, 8 per node), the launcher's torchrun node flags (from the
    environment) and its train config (validated as `train` validates it) agree on every choice."""
    from megatron_branch.train.config_io import load_config

    stated, text = stated_plan(script)
    plan = plan_json([*stated[1:], "--json"], capsys)
    assert plan["fits"] and not any(a in stated for a in ("--tp", "--cp", "--pp", "--dp", "--root-pieces"))
    assert (plan["gpu"]["count"], plan["gpu"]["gpus_per_node"]) == (16, 8)
    total = plan["memory_bytes_per_rank"]["total"] / 1e9
    assert f"{total:.1f} GB" in text and "-> fits" in text, (script, total)
    lay = plan["layout"]
    assert f"TP{lay['tp']} x CP{lay['cp']} x PP{lay['pp']} x DP{lay['dp']}" in text
    hf = tmp_path / "model"
    MODEL_PRESETS[stated[stated.index("--model") + 1]].to_hf_config().save_pretrained(hf)
    res = _node_run(script, tmp_path, hf)
    assert res.returncode == 0, res.stderr
    cmds = [shlex.split(line) for line in res.stdout.splitlines() if line.strip()]
    (cmd,) = [c for c in cmds if Path(c[0]).name == "torchrun"]
    assert "--standalone" not in cmd
    assert [_flag(cmd, f) for f in ("--nnodes", "--node_rank", "--master_addr", "--master_port")] == [
        "2", *NODE_ENV.values()
    ]  # fmt: skip
    nproc, config, overrides = train_command(cmds)
    assert nproc == plan["gpu"]["gpus_per_node"]
    assert_config_is_the_plan(load_config(config, overrides), plan, 2 * nproc, hf)
    assert_preflight_is_the_plan(cmds, plan, capsys)


@pytest.mark.parametrize(
    "env, says",
    [
        ({"NODE_RANK": ""}, "set NODE_RANK to this node's rank"),
        ({"MASTER_ADDR": ""}, "set MASTER_ADDR to node 0's address"),
        ({"MASTER_PORT": ""}, "set MASTER_PORT to a free TCP port"),
        ({"NODE_RANK": "2"}, "NODE_RANK must be 0 or 1 (this launcher runs on 2 nodes), got '2'"),
        ({"MASTER_PORT": "port"}, "MASTER_PORT must be a TCP port number (1-65535), got 'port'"),
    ],
)
def test_two_node_launcher_names_a_missing_node_setting(
    env: dict[str, str], says: str, tmp_path: Path
) -> None:
    for script in NODE_SCRIPTS:
        res = _node_run(script, tmp_path, tmp_path / "model", **env)
        assert res.returncode != 0 and says in res.stderr and "torchrun" not in res.stdout, res.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("script", NODE_SCRIPTS)
def test_two_node_launcher_scaled_down_trains_as_two_nodes(script: str, tmp_path: Path) -> None:
    """SCALE=tiny: the same script started twice on this machine, NODE_RANK 0 and 1 (one process each), joined at
    127.0.0.1: the plan's axis across the nodes spans the two agents; the plan's options reach the run."""
    import yaml

    out, port = tmp_path / "run", str(_free_port())
    env = {**os.environ, "SCALE": "tiny", "OUT": str(out), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}  # fmt: skip
    nodes = [subprocess.Popen(["bash", str(LAUNCH / script)], env={**env, "NODE_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]  # fmt: skip
    logs = [n.communicate(timeout=900)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    full = yaml.safe_load((LAUNCH / ".." / "configs" / script.replace(".sh", ".yaml")).read_text())
    rec = json.loads((out / "engine.json").read_text())
    par = full["parallel"]
    assert rec["layout"] == {"tp": 1, "cp": par["cp"], "dp": 1, "pp": par["pp"], "sequence_parallel": False}
    assert rec["param_dtypes"] == ["bfloat16"] and rec["optimizer"] == ["DistributedOptimizer"]
    assert (
        rec["optimizer_config"]["optimizer_offload_fraction"] == full["optim"]["optimizer_offload_fraction"]
    )
    sched = full["schedule"]
    assert (rec["schedule"]["branch_micro_batch"], rec["schedule"]["root_pieces"]) == (
        sched["branch_micro_batch"],
        sched["root_pieces"],
    )
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["positions_computed"] < s["positions_logical"] for s in steps)  # replay shared the prompt


@pytest.mark.parametrize(
    ("plan_args", "rc", "first"),
    [
        (["--cp", "8", "--recompute", "none"], 1, "does not fit: needs"),  # the planner's exit status 1
        (["--cp", "3"], 2, "megatron-branch: error: "),  # bad input: the planner's own line, exit 2
    ],
)
def test_preflight_stops_with_the_planners_verdict(plan_args: list[str], rc: int, first: str) -> None:
    """Issue 35: plan exits 1 when nothing fits; under `set -e` the preflight still prints the verdict (the plan's
    first line) and stops, and a bad planner input stops it with the planner's line and status 2."""
    script = (f"source {LAUNCH / 'common.sh'}; preflight --model qwen2.5-32b --prompt-length 122880 --responses 16 "
              f"--response-length 8192 --gpus 8 --gpu h100 {' '.join(plan_args)}; echo launched")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MB": f"{sys.executable} -m megatron_branch"}
    env.pop("MB_DRY_RUN", None)
    res = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == rc and "launched" not in res.stdout, (res.returncode, res.stderr)
    assert res.stderr.splitlines()[0].startswith(first), res.stderr
