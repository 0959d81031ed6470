"""What a run rewrites in place is replaced whole: a failure in the middle of a write (planted: the disk fills
half-way through) leaves the previous file or folder exactly as it was, and no temporary beside it.

Each test fails on the old in-place writes: `Path.write_text` on the target truncates it before the failure,
`rmtree` + save loses the previous tokenizer.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron_branch.data import Rollout, read_rollouts_jsonl, write_rollouts_jsonl
from megatron_branch.errors import UserError


def _plant_full_disk(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every `Path.write_text` from now on writes half of its text, then fails as a full disk does; returns the
    paths it tore (so a test can check the failure really happened inside the write)."""
    real = Path.write_text
    torn: list[Path] = []

    def write_half(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        real(self, data[: len(data) // 2], *args, **kwargs)
        torn.append(self)
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", write_half)
    return torn


def _only(folder: Path, *names: str) -> None:
    """`folder` holds exactly `names`: the failed write's temporary is gone."""
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


def test_metrics_rewrite_on_resume_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_branch.train.metrics import METRICS_FILE, RunLogger, read_metrics

    rows = [{"step": k, "reward_mean": k / 10} for k in (1, 2, 3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = (tmp_path / METRICS_FILE).read_bytes()
    torn = _plant_full_disk(monkeypatch)
    with pytest.raises(UserError, match="No space left on device") as e:
        RunLogger(tmp_path, total_steps=5, start_step=2, tensorboard=False, progress_bar=False)
    assert "\n" not in str(e.value) and torn
    assert (tmp_path / METRICS_FILE).read_bytes() == before
    _only(tmp_path, METRICS_FILE)
    monkeypatch.undo()
    logger = RunLogger(tmp_path, total_steps=5, start_step=2, tensorboard=False, progress_bar=False)
    logger.close()
    assert read_metrics(tmp_path / METRICS_FILE) == rows[:2]  # the resume's own cut still happens


def test_metrics_line_torn_by_a_crash_is_dropped_on_resume(tmp_path: Path) -> None:
    """`log` appends: a crash in the middle leaves a last line without its end. The resume drops it (it was not
    a whole step), instead of failing on it; a broken line elsewhere is one line naming the file and line."""
    from megatron_branch.train.metrics import METRICS_FILE, RunLogger, read_metrics

    rows = [{"step": k, "reward_mean": k / 10} for k in (1, 2)]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / METRICS_FILE).write_text(whole + json.dumps({"step": 3, "reward_mean": 0.3})[:9])
    assert read_metrics(tmp_path / METRICS_FILE) == rows
    RunLogger(tmp_path, total_steps=5, start_step=2, tensorboard=False, progress_bar=False).close()
    assert (tmp_path / METRICS_FILE).read_text() == whole
    (tmp_path / METRICS_FILE).write_text('{"step": 1\n' + whole)
    with pytest.raises(UserError, match=rf"{METRICS_FILE}:1: invalid JSON") as e:
        read_metrics(tmp_path / METRICS_FILE)
    assert "\n" not in str(e.value)


def test_resolved_config_rewrite_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_branch.train.config_io import load_config, to_dict, write_resolved

    base = ["model.arch.hidden_size=32", "model.arch.ffn_hidden_size=64", "data.task=kv_retrieval"]
    path = tmp_path / "config.yaml"
    write_resolved(load_config(None, [*base, "rollout.n=3"]), path)
    before = path.read_bytes()
    torn = _plant_full_disk(monkeypatch)
    with pytest.raises(UserError, match="No space left on device"):
        write_resolved(load_config(None, [*base, "rollout.n=6"]), path)
    assert torn and path.read_bytes() == before
    assert yaml.safe_load(before)["rollout"]["n"] == 3
    _only(tmp_path, "config.yaml")
    monkeypatch.undo()
    cfg = load_config(None, [*base, "rollout.n=6"])
    write_resolved(cfg, path)
    assert yaml.safe_load(path.read_text()) == to_dict(cfg)


def test_engine_record_rewrite_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_branch.train.record import ENGINE_FILE, write_engine_record

    write_engine_record(tmp_path, {"layout": {"tp": 1}})
    before = (tmp_path / ENGINE_FILE).read_bytes()
    torn = _plant_full_disk(monkeypatch)
    with pytest.raises(UserError, match="No space left on device"):
        write_engine_record(tmp_path, {"layout": {"tp": 2}})
    assert torn and (tmp_path / ENGINE_FILE).read_bytes() == before
    _only(tmp_path, ENGINE_FILE)


def test_rollouts_rewrite_keeps_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "r.jsonl"
    old = [Rollout(prompt=[1, 2, 3], response=[4, 5], advantage=1.0)]
    write_rollouts_jsonl(path, old)
    before = path.read_bytes()
    torn = _plant_full_disk(monkeypatch)
    new = [Rollout(prompt=[7, 8], response=[9], advantage=-1.0)] * 4
    with pytest.raises(UserError, match="No space left on device"):
        write_rollouts_jsonl(path, new)
    assert torn and path.read_bytes() == before
    _only(tmp_path, "r.jsonl")
    monkeypatch.undo()
    write_rollouts_jsonl(path, new)
    assert [r.prompt for r in read_rollouts_jsonl(path)] == [(7, 8)] * 4
    with pytest.raises(UserError, match="does not exist"):  # the outputs rule: a missing folder is refused
        write_rollouts_jsonl(tmp_path / "nope" / "r.jsonl", new)


class _Tokenizer:
    """A tokenizer whose `save_hf` writes `text` into both files of a transformers folder, and then fails (a
    conversion error half-way) when `fail` is set."""

    def __init__(self, text: str, *, fail: bool = False) -> None:
        self.text, self.fail = text, fail

    def save_hf(self, out_dir: str | Path) -> None:
        (Path(out_dir) / "tokenizer_config.json").write_text(self.text)
        if self.fail:
            raise RuntimeError("the converter gave up")
        (Path(out_dir) / "tokenizer.json").write_text(self.text)


def test_tokenizer_resave_keeps_the_folder(tmp_path: Path) -> None:
    from megatron_branch.train.run_dir import HF_TOKENIZER, save_tokenizer

    folder = tmp_path / HF_TOKENIZER
    save_tokenizer(_Tokenizer("v1"), folder)
    _only(folder, "tokenizer.json", "tokenizer_config.json")
    with pytest.raises(
        UserError, match=r"cannot save the tokenizer for transformers \(RuntimeError: the conv"
    ):
        save_tokenizer(_Tokenizer("v2", fail=True), folder)
    assert {p.name: p.read_text() for p in folder.iterdir()} == {
        "tokenizer.json": "v1",
        "tokenizer_config.json": "v1",
    }
    _only(tmp_path, HF_TOKENIZER)
    save_tokenizer(_Tokenizer("v2"), folder)  # a resume re-saves it
    assert (folder / "tokenizer.json").read_text() == "v2"
    _only(tmp_path, HF_TOKENIZER)
