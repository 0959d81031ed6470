"""Issue 35 item 1: every folder and file a run creates (run folder, training checkpoints, tokenizer, exports) has
the permissions the umask implies, whatever the writing library used (mkdtemp makes 0700 folders, mkstemp and
safetensors 0600 files): a teammate or an evaluation job can read a run written under umask 022."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_lifecycle import train


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_run_and_checkpoint_modes_follow_the_umask(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "run"
    assert train(tmp_path, out, "trainer.total_training_steps=1", "trainer.save_freq=1") == 0
    ckpt = out / "checkpoints" / "step_00000001"
    assert ckpt.is_dir() and (out / "tokenizer" / "tokenizer.model").is_file()
    wrong = {
        str(p.relative_to(out)): oct(p.stat().st_mode & 0o777)
        for p in [out, *out.rglob("*")]
        if p.stat().st_mode & 0o777 != (0o777 if p.is_dir() else 0o666) & ~umask
    }
    assert not wrong, wrong
