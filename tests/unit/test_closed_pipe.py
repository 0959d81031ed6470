"""Issue 35 item 3: a closed pipe (`megatron-branch plan ... | head -1`) ends the command quietly, exit status 141
(128 + SIGPIPE, as `yes | head` reports), never with a BrokenPipeError traceback: for a command's output and for
argparse's help alike. The reader here closes its end before the command writes anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branch.cli import CLOSED_PIPE

ROOT = Path(__file__).resolve().parents[2]
PLAN = ["plan", "--model", "qwen2.5-7b", "--prompt-length", "4096", "--responses", "4", "--response-length", "64",
        "--gpus", "1", "--gpu", "h100", "--json"]  # fmt: skip


def _run_into_closed_pipe(argv: list[str]) -> tuple[int, str]:
    r, w = os.pipe()
    os.close(r)  # nobody will read: every write to w fails with EPIPE
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_branch", *argv], stdout=w, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=300)  # fmt: skip
    finally:
        os.close(w)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("argv", [PLAN, ["--help"], ["plan", "--help"]], ids=["plan", "help", "plan-help"])
def test_closed_pipe_is_quiet(argv: list[str]) -> None:
    rc, err = _run_into_closed_pipe(argv)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert err == "" and rc in (0, CLOSED_PIPE), (rc, err)
    if argv == PLAN:
        assert rc == CLOSED_PIPE
