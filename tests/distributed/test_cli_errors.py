"""User errors under torchrun (world 2), through the CLI on every rank: every rank returns status 2, rank 0 prints
ONE line, the other ranks print nothing, no traceback, the output folder unchanged, and no rank hangs.

What torchrun itself adds afterwards is tested by tests/unit/test_torchrun_errors.py (one real launch).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_branch.checkpoint import convert_hf_to_mcore
from megatron_branch.cli import main
from megatron_branch.data import Rollout, write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.parallel import agree
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model


def tree(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def assets() -> Path:
    box = [tempfile.mkdtemp(prefix="cli-errors-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    d = Path(box[0])
    if dist.get_rank() == 0:
        tiny_hf_model(tiny_hf_config("qwen2"), seed=0).save_pretrained(d / "hf")  # 512 positions
        long = Rollout(prompt=[1] * 500, response=[2] * 20, advantage=1.0)
        write_rollouts_jsonl(d / "long.jsonl", [*random_tree_rollouts(groups=1, branches=2, seed=1), long])
        write_rollouts_jsonl(d / "r.jsonl", random_tree_rollouts(groups=2, branches=2, seed=2))
        (d / "mask.jsonl").write_text(
            '{"prompt": [1], "response": [2, 3], "advantage": 1}\n'
            '{"prompt": [1], "response": [2, 4], "advantage": 1, "loss_mask": [1, 0.5]}\n'
        )
        (d / "out").mkdir()
        (d / "out" / "g.safetensors").write_bytes(b"old")
    dist.barrier()
    convert_hf_to_mcore(d / "hf", d / "mc", progress=False)  # every rank (tp 1, dp 2)
    if dist.get_rank() == 0:
        shutil.copytree(d / "mc", d / "mc_del")
        (d / "mc_del" / "__0_0.distcp").unlink()
    dist.barrier()
    yield d
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)


CASES = {
    "long-rollout": (
        ["grad", "--rollouts", "{d}/long.jsonl", "--out", "{d}/out/new.safetensors"],
        "long.jsonl:3",
    ),
    "existing-output": (
        ["grad", "--rollouts", "{d}/r.jsonl", "--out", "{d}/out/g.safetensors"],
        "--overwrite",
    ),
    "bad-loss-mask": (
        ["grad", "--rollouts", "{d}/mask.jsonl", "--out", "{d}/out/new.safetensors"],
        "mask.jsonl:2: field 'loss_mask' value 1 is 0.5",
    ),
    "idle-sp": (
        ["grad", "--rollouts", "{d}/r.jsonl", "--out", "{d}/out/n.safetensors", "--sequence-parallel"],
        "--sequence-parallel does nothing at --tp 1",
    ),
    "deleted-shard": (
        ["convert", "mcore-to-hf", "--mcore", "{d}/mc_del", "--out", "{d}/out/hf"],
        "__0_0.distcp is missing",
    ),
    "existing-ckpt": (["convert", "hf-to-mcore", "--out", "{d}/mc"], "pass --overwrite"),
    "train-dp": (  # issue 35: was printed by rank 0 and again by "[rank 1]"
        [
            "train",
            str(Path(__file__).resolve().parents[2] / "examples/configs/demo.yaml"),
            "parallel.dp=4",
            "trainer.default_local_dir={d}/out/run",
        ],
        "parallel.dp=4 does not match the world: 2 ranks",
    ),  # fmt: skip
}


@pytest.mark.world(2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_user_error_printed_once_all_ranks_exit_2(case: str, assets: Path, capsys) -> None:
    template, expect = CASES[case]
    argv = [a.format(d=assets) for a in template]
    if argv[0] == "grad" or argv[1] == "hf-to-mcore":
        argv += ["--hf", str(assets / "hf")]
    before = tree(assets / "out") if dist.get_rank() == 0 else None
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    ranks_rc: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks_rc, rc)
    assert ranks_rc == [2, 2]
    assert "Traceback" not in err
    if dist.get_rank() == 0:
        assert len(lines) == 1 and lines[0].startswith("megatron-branch: error: "), err
        assert expect in lines[0], lines[0]
        assert tree(assets / "out") == before
    else:
        assert lines == [], err


@pytest.mark.world(2)
def test_rank0_write_failure_reaches_every_rank() -> None:
    def write() -> None:
        raise OSError(28, "No space left on device", "/somewhere/g.safetensors")

    with pytest.raises(UserError, match="No space left on device") as e:
        agree.write_on_rank0(write if dist.get_rank() == 0 else lambda: None)
    assert e.value.all_ranks  # printed by rank 0 only
