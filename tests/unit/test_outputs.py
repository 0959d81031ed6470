"""The one output rule (megatron_branch/outputs.py) and the CLI's error printing, without any model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from megatron_branch import outputs
from megatron_branch.cli import report_user_error
from megatron_branch.errors import UserError
from megatron_branch.launch import _DropUserErrorNotes
from megatron_branch.parallel import agree
from megatron_branch.parallel.agree import check_on_every_rank


def tree(d: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `d` with (size, mtime_ns, mode): equal before and after means untouched."""
    return {
        str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_mode)
        for p in sorted(d.rglob("*"))
    }


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def test_file_checks(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist .missing folders are not created"):
        outputs.check_output_file(tmp_path / "no" / "such" / "g.safetensors", overwrite=True)
    assert not (tmp_path / "no").exists()
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="is a folder; give a file name"):
        outputs.check_output_file(tmp_path / "d", overwrite=True)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="already exists; pass --overwrite"):
        outputs.check_output_file(tmp_path / "f", overwrite=False)
    assert outputs.check_output_file(tmp_path / "f", overwrite=True) == tmp_path / "f"
    with pytest.raises(UserError, match="is a file, not a folder"):
        outputs.check_output_file(tmp_path / "f" / "g", overwrite=False)


def test_dir_checks(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        outputs.check_output_dir(tmp_path / "plain", overwrite=True, marker="m.json")
    (tmp_path / "empty").mkdir()
    outputs.check_output_dir(tmp_path / "empty", overwrite=False, marker="m.json")  # empty counts as absent
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="not empty; pass --overwrite"):
        outputs.check_output_dir(tmp_path / "home", overwrite=False, marker="m.json")
    with pytest.raises(UserError, match="has no m.json.*even with --overwrite"):
        outputs.check_output_dir(tmp_path / "home", overwrite=True, marker="m.json")
    with pytest.raises(UserError, match="missing folders are not created"):
        outputs.check_output_dir(tmp_path / "a" / "b", overwrite=False, marker="m.json")
    assert not (tmp_path / "a").exists()


def test_atomic_file_failure_leaves_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "g.safetensors"
    target.write_text("old")
    before = tree(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), outputs.atomic_file(target, overwrite=True) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert tree(tmp_path) == before  # no temp left, the old file unchanged


def test_atomic_file_replaces_only_with_overwrite_and_uses_umask(tmp_path: Path, umask_027: None) -> None:
    target = tmp_path / "out.jsonl"
    outputs.write_text(target, "one\n", overwrite=False)
    assert target.read_text() == "one\n"
    assert target.stat().st_mode & 0o777 == 0o640
    with pytest.raises(UserError, match="already exists"):
        outputs.write_text(target, "two\n", overwrite=False)
    with outputs.atomic_file(target, overwrite=True) as tmp:
        tmp.write_text("two\n")
        os.chmod(tmp, 0o600)  # what safetensors does
    assert target.read_text() == "two\n"
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_atomic_dir(tmp_path: Path, umask_027: None) -> None:
    target = tmp_path / "ckpt"
    with outputs.atomic_dir(target, overwrite=False, marker="m.json") as tmp:
        (tmp / "m.json").write_text("{}")
        (tmp / "sub").mkdir(mode=0o700)
        (tmp / "sub" / "w").write_text("1")
        os.chmod(tmp / "sub" / "w", 0o600)
    assert target.stat().st_mode & 0o777 == 0o750
    assert (target / "sub").stat().st_mode & 0o777 == 0o750
    assert (target / "sub" / "w").stat().st_mode & 0o777 == 0o640
    before = tree(tmp_path)
    with pytest.raises(UserError, match="not empty; pass --overwrite"):
        with outputs.atomic_dir(target, overwrite=False, marker="m.json"):
            pass
    with pytest.raises(RuntimeError), outputs.atomic_dir(target, overwrite=True, marker="m.json") as tmp:
        (tmp / "m.json").write_text("{}")
        raise RuntimeError("failed half way")
    assert tree(tmp_path) == before
    with outputs.atomic_dir(target, overwrite=True, marker="m.json") as tmp:
        (tmp / "m.json").write_text('{"new": 1}')
    assert sorted(p.name for p in target.iterdir()) == ["m.json"]  # the old contents are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or old folder left


def test_write_on_rank0_turns_oserror_into_user_error(tmp_path: Path) -> None:
    def write() -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    with pytest.raises(UserError, match="cannot write: Permission denied") as e:
        agree.write_on_rank0(write)
    assert e.value.all_ranks


@pytest.mark.parametrize(
    ("rank", "all_ranks", "printed"),
    [
        (None, False, "megatron-branch: error: bad thing"),
        ("0", True, "megatron-branch: error: bad thing"),
        ("1", True, ""),  # rank 0 prints an error every rank raised
        ("1", False, "megatron-branch[rank 1]: error: bad thing"),  # seen by one rank only: never lost
    ],
)
def test_error_printed_once(
    rank: str | None, all_ranks: bool, printed: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    e = UserError("bad\nthing")
    e.all_ranks = all_ranks
    report_user_error(e)
    assert capsys.readouterr().err.strip() == printed


def test_check_on_every_rank_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert check_on_every_rank(lambda: 3) == 3
    with pytest.raises(UserError, match="nope"):
        check_on_every_rank(lambda: (_ for _ in ()).throw(UserError("nope")))


def test_launcher_drops_only_user_error_notes() -> None:
    f = _DropUserErrorNotes()

    def rec(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("torch", logging.ERROR, __file__, 1, msg, args, None)

    assert not f.filter(rec("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 1, "x"))
    assert f.filter(rec("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 1, 0, 1, "x"))
    assert f.filter(rec("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", -11, 0, 1, "x"))
    assert not f.filter(rec("Sending process %s closing signal %s", 12, "SIGTERM"))


@pytest.mark.parametrize("rank", ["0", "1"])
def test_convert_says_wrote_once_under_torchrun(
    rank: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 35 item 10: under TP2 every rank converts its part; "wrote ..." is printed by rank 0 only."""
    import argparse

    import megatron_branch.checkpoint.hf_to_mcore as h2m
    from megatron_branch.checkpoint.cli import run

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(h2m, "convert_hf_to_mcore", lambda hf, out, **kw: Path(out))
    args = argparse.Namespace(convert_direction="hf-to-mcore", hf="hf", out=str(tmp_path / "m"), tp=2, pp=1,
                              ep=1, etp=None, dtype="bf16", overwrite=False)  # fmt: skip
    assert run(args) == 0
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'm'}\n" if rank == "0" else "")
