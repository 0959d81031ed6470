"""Signals sent to a real `megatron-branch train` process: Ctrl-C (SIGINT) prints one line naming the last complete
checkpoint and how to resume, exit 130; SIGTERM with trainer.save_on_signal saves at the next step boundary and
exits 0, and the run resumes from that checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_lifecycle import cfg, overrides


def _start(tmp_path: Path, out: Path, *extra: str) -> subprocess.Popen:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    cmd = [sys.executable, "-m", "megatron_branch", "train", str(empty),
           *overrides(out, "trainer.total_training_steps=100000", "checkpoint.hf_export=false", *extra)]  # fmt: skip
    # SIGINT back to its default in the child: a test run started in the background (`make test &`) inherits SIGINT
    # ignored (POSIX shells ignore it for background jobs), and Python then never raises KeyboardInterrupt
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def _wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        f = out / "metrics.jsonl"
        if f.is_file() and len(f.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps within {timeout} s")


@pytest.mark.slow
def test_sigint_names_the_last_checkpoint_and_sigterm_saves_at_a_step_boundary(tmp_path: Path) -> None:
    from megatron_branch.checkpoint.store import CheckpointStore
    from megatron_branch.train.loop import Trainer

    a, b = tmp_path / "int", tmp_path / "term"
    p_int = _start(tmp_path, a, "trainer.save_freq=1")
    p_term = _start(tmp_path, b, "trainer.save_on_signal=true")  # never saves on its own
    _wait_for_steps(p_int, a, 2)  # step_1 is complete once step 2 is logged
    p_int.send_signal(signal.SIGINT)
    _wait_for_steps(p_term, b, 1)
    p_term.send_signal(signal.SIGTERM)
    out_int, err_int = p_int.communicate(timeout=600)  # a loaded 2-core machine is slow
    out_term, err_term = p_term.communicate(timeout=600)

    assert p_int.returncode == 130, err_int
    lines = [ln for ln in err_int.splitlines() if ln.startswith("interrupted")]
    assert len(lines) == 1, err_int
    last = CheckpointStore(a / "checkpoints").newest_verified(print)
    assert last is not None and last.name >= "step_00000001"
    assert lines[0].endswith(
        f"the last complete checkpoint is {last}; resume: the same command with --resume auto"
    )
    CheckpointStore(a / "checkpoints").verify(last)  # complete and undamaged

    assert p_term.returncode == 0, err_term
    steps = [json.loads(x)["step"] for x in (b / "metrics.jsonl").read_text().splitlines()]
    (line,) = [ln for ln in err_term.splitlines() if ln.startswith("SIGTERM")]
    ckpt = b / "checkpoints" / f"step_{steps[-1]:08d}"
    assert (
        line
        == f"SIGTERM: stopped after step {steps[-1]} with checkpoint {ckpt}; resume: the same command with --resume auto"
    )
    assert json.loads(out_term.splitlines()[-1])["stopped_by"] == "SIGTERM"
    resumed = Trainer(cfg(b, "trainer.total_training_steps=100000", "trainer.resume_mode=auto"))
    assert resumed.step == steps[-1]


def test_ctrl_c_during_a_checkpoint_write_waits_for_the_write() -> None:
    """lifecycle.DeferredInterrupt (around every train checkpoint save): a SIGINT inside the block is held until
    the block ends, then raised as KeyboardInterrupt; a second SIGINT interrupts at once; outside it, SIGINT is
    back to what it was. (A SIGINT inside torch's zip writer once came out as a RuntimeError and a half-written
    checkpoint: the block is what keeps the write whole.)"""
    import os

    from megatron_branch.train.lifecycle import DeferredInterrupt

    done = []
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler has run by now: the block goes on
            done.append("written")
    assert done == ["written"]
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)  # the second: now
            time.sleep(0.05)
            done.append("not reached")
    assert done == ["written"]
    with DeferredInterrupt():  # no signal: nothing raised
        done.append("quiet")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # planted: without the block the interrupt lands inside the write
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        done.append("not reached")
    assert done == ["written", "quiet"]
