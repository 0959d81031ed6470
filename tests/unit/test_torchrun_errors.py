"""A user error under a real torchrun launch (world 2), as the user sees it: our line once, every rank status 2.

Plain torchrun then adds its own ChildFailedError report and exits 1 (it does so for any failed worker; nothing
inside the workers can change it); `python -m megatron_branch.launch` exits 2 and adds nothing. See
docs/errors.md. The per-command cases under torchrun are in tests/distributed/test_cli_errors.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "LOCAL_"))
    }
    env.pop("WORLD_SIZE", None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.mark.parametrize("launcher", ["torch.distributed.run", "megatron_branch.launch"])
def test_user_error_under_torchrun(launcher: str, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    cmd = [
        sys.executable,
        "-m",
        launcher,
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "megatron_branch",
        "grad",
        "--hf",
        str(tmp_path / "no-such-model"),
        "--rollouts",
        str(tmp_path / "r.jsonl"),
        "--out",
        str(tmp_path / "out" / "g.safetensors"),
    ]
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if "megatron-branch" in ln and "error:" in ln]
    assert ours == [
        f"megatron-branch: error: Hugging Face model folder {str(tmp_path / 'no-such-model')!r} does not exist"
    ]
    assert list((tmp_path / "out").iterdir()) == []
    if launcher == "megatron_branch.launch":
        assert p.returncode == 2, p.stderr
        assert [ln for ln in p.stderr.splitlines() if ln.strip()] == ours  # nothing else at all
    else:  # torchrun's own report: status 1, a table naming each rank's exit status 2, no worker traceback
        assert p.returncode == 1, p.stderr
        assert "ChildFailedError" in p.stderr and p.stderr.count("Traceback") == 1
        assert "exitcode  : 2" in p.stderr.split("Root Cause")[1]
