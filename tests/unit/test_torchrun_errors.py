"""A user error under torchrun (world 2), as the user sees it: our line once, and what each launcher adds.

`python -m megatron_branch.launch` (the launcher docs/errors.md tells users to run) exits 2 and adds nothing; plain
torchrun adds its own ChildFailedError report and exits 1 (it does so for any failed worker; nothing inside the
workers can change it). The per-command cases under torchrun, every rank's status 2 included, are in
tests/distributed/test_cli_errors.py (in the distributed suite's one launch).

ONE test here starts torchrun, `megatron_branch.launch` on a real command, because only a real launch shows what
its promise rests on: the log lines torch's elastic agent really writes (the filter matches their text), the
ChildFailedError it really raises, the workers' real exit statuses, and rank 0 printing once. Kept cheap: world 2
(the least that shows "once"), the earliest user error (a missing HF folder: no model, no rollouts read), a short
monitor interval. Plain torchrun's side is checked without a launch: torch's own `main` and ours are called with
torch's `run` replaced by one raising the ChildFailedError those workers cause (exit status 2 on every rank).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megatron_branch import launch

# each test launches torchrun: the whole file is slow
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
GRAD = ["-m", "megatron_branch", "grad", "--hf", "HF", "--rollouts", "r.jsonl", "--out", "out/g.safetensors"]


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_", "RANK", "LOCAL_"))
    }
    env.pop("WORLD_SIZE", None)
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def test_user_error_under_megatron_branch_launch(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    hf = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "megatron_branch.launch", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.02", *GRAD]  # fmt: skip
    cmd[cmd.index("HF")] = str(hf)
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    ours = [ln for ln in (p.stdout + p.stderr).splitlines() if "megatron-branch" in ln and "error:" in ln]
    # every assertion shows the launch's whole output: a failure here must say what torchrun printed
    out = f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert ours == [f"megatron-branch: error: Hugging Face model folder {str(hf)!r} does not exist"], out
    assert p.returncode == 2, out
    assert [ln for ln in p.stderr.splitlines() if ln.strip()] == ours, out  # nothing else at all
    assert list((tmp_path / "out").iterdir()) == []


def _failed(*exitcodes: int) -> ChildFailedError:
    """What torch's elastic agent raises when ranks 0, 1, ... exited with these statuses, rank 0 first."""
    failures = {}
    for rank, code in enumerate(exitcodes):
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        f.timestamp = rank  # the first observed failure is rank 0's
        failures[rank] = f
    return ChildFailedError(name="megatron_branch", failures=failures)


def _raise(err: ChildFailedError):
    def run(args) -> None:
        assert args.nproc_per_node == "2" and args.training_script == "megatron_branch"
        raise err

    return run


ARGV = ["--standalone", "--nproc_per_node=2", *GRAD]


def test_plain_torchrun_reports_childfailederror(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's own entry point re-raises; uncaught, Python prints that traceback and exits with status 1
    monkeypatch.setattr(torchrun, "run", _raise(_failed(2, 2)))
    with pytest.raises(ChildFailedError) as e:
        torchrun.main(ARGV)
    report = str(e.value)
    assert "Root Cause" in report and report.split("Root Cause")[1].count("exitcode  : 2") == 1
    assert report.count("exitcode  : 2") == 2  # the table names every rank's status


@pytest.mark.parametrize(
    "exitcodes, status",
    [((2, 2), 2), ((2, 1), 2), ((1, 2), None), ((-9, 2), None)],
    ids=["user-error", "user-error-first", "crash-first", "signal-first"],
)
def test_launch_keeps_user_error_status(
    exitcodes: tuple[int, ...], status: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Status 2 when the first worker to fail exited 2; any other first failure: torchrun's report, unchanged."""
    err = _failed(*exitcodes)
    monkeypatch.setattr(torchrun, "run", _raise(err))
    if status is None:
        with pytest.raises(ChildFailedError) as e:
            launch.main(ARGV)
        assert e.value is err
    else:
        assert launch.main(ARGV) == status


def test_launch_drops_only_user_error_notes() -> None:
    def rec(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("torch.distributed.elastic", logging.ERROR, __file__, 1, msg, args, None)

    keep = launch._DropUserErrorNotes().filter
    failed = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"  # torch 2.13's text
    assert not keep(rec(failed, 2, 0, 1000, sys.executable))
    assert keep(rec(failed, 1, 0, 1000, sys.executable))
    assert keep(rec(failed, -9, 0, 1000, sys.executable))
    assert not keep(rec("Sending process %s closing signal %s", 1001, "SIGTERM"))
    assert keep(rec("some other note %s", 2))
