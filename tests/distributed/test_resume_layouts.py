"""`train --resume auto` at another layout: a TP2, a DP2 and a PP2 checkpoint resume in ONE process (TP1 = DP1 =
PP1) and train exactly the run that never left that layout (float64, 1e-9 per parameter). DPO: no sampling, so the restarted RNG
streams (train/state.py `restart_rng`) cannot change the steps; model, optimizer, scheduler, reference and data
position are what megatron's dist checkpointing reshards. What it cannot reshard (the optimizer kind) is refused in
one line naming both layouts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp, single_process_env
from train_helpers import QUIET, TINY_ARCH

from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer


def _overrides(tmp: Path, out: str, *extra: str) -> list[str]:
    return [
        TINY_ARCH,
        "model.dtype=float64",
        "model.arch.vocab_size=18",  # padded alike at TP1 and TP2 (else refused: lifecycle.check_resharding)
        "algorithm.name=dpo",
        f"data.pairs_file={tmp / 'pairs.jsonl'}",
        "data.train_batch_size=4",
        "optim.lr=0.01",
        *QUIET,
        "checkpoint.hf_export=false",
        f"trainer.default_local_dir={tmp / out}",
        *extra,
    ]


# Rank 0 runs this in a fresh interpreter with no torchrun environment (a world of one): the run that never left
# TP1/DP1, then both checkpoints resumed there, then a resume that must be refused.
_ONE_PROCESS = """
import json, sys, torch
from pathlib import Path
sys.path[:0] = ["tests/distributed", "tests"]
from test_resume_layouts import _overrides
from megatron_branch.errors import UserError
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.models import unwrap
tmp = Path(sys.argv[1])
def params(tr):
    return {k: v.clone() for k, v in unwrap(tr.policy).state_dict().items() if isinstance(v, torch.Tensor)}
def run(out, *extra):
    tr = Trainer(load_config(None, _overrides(tmp, out, "trainer.total_training_steps=4", *extra)))
    losses = []
    while tr.step < 4:
        losses.append(tr.train_step()["loss"])
    return params(tr), losses, tr
result = {"ref": run("ref")[:2]}
result["world"] = torch.distributed.get_world_size()
for name in ("tp2", "dp2", "pp2"):
    p, losses, tr = run(name, "trainer.resume_mode=auto")
    result[name] = (p, losses)
try:
    Trainer(load_config(None, _overrides(tmp, "tp2", "trainer.total_training_steps=6", "trainer.resume_mode=auto",
                                        "optim.use_distributed_optimizer=true")))
    result["refused"] = None
except UserError as e:
    result["refused"] = str(e)
torch.save(result, tmp / "one_process.pt")
"""


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max() / (b[k].abs().max() + 1e-30)) for k in a)


@pytest.mark.world(2)
def test_tp2_and_dp2_checkpoints_resume_in_one_process_exactly() -> None:
    tmp = shared_tmp("resume-layouts-")
    try:
        if dist.get_rank() == 0:
            rows = [{"prompt": f"k{i}:ab ? k{i}:", "chosen": "ab", "rejected": "ba"} for i in range(8)]
            (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dist.barrier()
        sizes = {"tp2": (2, 1, 1), "dp2": (1, 2, 1), "pp2": (1, 1, 2)}  # (tp, dp, pp)
        for name, layout in (("tp2", "parallel.tp=2"), ("dp2", "parallel.tp=1"), ("pp2", "parallel.pp=2")):
            tr = Trainer(load_config(None, _overrides(tmp, name, layout, "trainer.total_training_steps=2")))
            while tr.step < 2:
                tr.train_step()
            tr.save()
            assert (tr.groups.tp_size, tr.groups.dp_size, tr.groups.pp_size) == sizes[name]
        dist.barrier()
        out = ""
        if dist.get_rank() == 0:
            p = subprocess.run(
                [sys.executable, "-c", _ONE_PROCESS, str(tmp)],
                env=single_process_env(),
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert p.returncode == 0, p.stderr[-3000:]
            out = p.stdout
        if dist.get_rank() == 0:
            got = torch.load(tmp / "one_process.pt", weights_only=False)
            assert got["world"] == 1
            ref_params, ref_losses = got["ref"]
            for name, saved in (
                ("tp2", "tp=2 cp=1 dp=1"),
                ("dp2", "tp=1 cp=1 dp=2"),
                ("pp2", "tp=1 cp=1 dp=1 pp=2"),
            ):
                params, losses = got[name]
                assert len(losses) == 2  # steps 3 and 4 ran at the new layout
                for x, y in zip(losses, ref_losses[2:], strict=True):
                    assert abs(x - y) <= 1e-9 * max(1.0, abs(y)), (name, losses, ref_losses)
                assert _max_rel(params, ref_params) < 1e-9, name
                notice = [
                    ln
                    for ln in out.splitlines()
                    if f"{name}/checkpoints/step_00000002 (saved at {saved})" in ln
                ]
                assert len(notice) == 1 and "RNG streams restarted" in notice[0], out
            refused = got["refused"]
            assert refused is not None and "\n" not in refused
            assert "saved at tp=2 cp=1 dp=1 with optim.use_distributed_optimizer=false" in refused
            assert "this run is tp=1 cp=1 dp=1 with optim.use_distributed_optimizer=true" in refused
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
