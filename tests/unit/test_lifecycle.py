"""A run's life cycle: a finished run extended (exports rewritten for the new last step) or left alone ("nothing to
do"); training checkpoints verified (a flipped byte or a missing train_state.json named, the previous checkpoint
taken); any checkpoint exported with a tokenizer transformers loads; the input checks before any work (vocabulary,
no-op settings, overrides blamed on themselves, no folder left by a run that failed before its first step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import KV_TASK, QUIET, TINY_ARCH, params

from megatron_branch.cli import main
from megatron_branch.errors import SettingError, UserError
from megatron_branch.train.config_io import load_config
from megatron_branch.train.loop import Trainer
from megatron_branch.train.validate import SPELLING

BASE = [TINY_ARCH, *KV_TASK, *QUIET]


def overrides(out: Path, *extra: str) -> list[str]:
    return [*BASE, f"trainer.default_local_dir={out}", *extra]


def cfg(out: Path, *extra: str):
    return load_config(None, overrides(out, *extra))


def train(tmp_path: Path, out: Path, *extra: str) -> int:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    return main(["train", str(empty), *overrides(out, *extra)])


# ---- 1. resume and extend ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_finished_run_extends_and_reexports(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train(tmp_path, out, "trainer.total_training_steps=2") == 0
    assert json.loads((out / "exports.json").read_text()) == {"step": 2}
    before = (out / "hf" / "model.safetensors").read_bytes()
    capsys.readouterr()
    # the finished run, resumed with more steps: steps 3-4 run, the exports now hold step 4
    assert train(tmp_path, out, "trainer.total_training_steps=4", "--resume", "auto") == 0
    text = capsys.readouterr().out
    assert "resumed from" in text and "step_00000002" in text
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert json.loads((out / "exports.json").read_text()) == {"step": 4}
    assert (out / "checkpoints" / "step_00000004").is_dir()
    assert (out / "hf" / "model.safetensors").read_bytes() != before  # re-exported, not the step-2 weights
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp or old folders left
    # resumed again at the same length: one line, exit 0, nothing touched
    stamp = (out / "hf" / "model.safetensors").stat().st_mtime_ns
    assert train(tmp_path, out, "trainer.total_training_steps=4", "--resume", "auto") == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith(f"nothing to do: {out} is at step 4") for ln in lines), lines
    assert (out / "hf" / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_stale_exports_are_redone_on_resume(tmp_path: Path) -> None:
    """A crash between the final checkpoint and the exports: resuming the finished run exports, no step runs."""
    out = tmp_path / "run"
    tr = Trainer(cfg(out, "trainer.total_training_steps=1", "checkpoint.hf_export=false"))
    tr.train_step()
    tr.save()
    again = Trainer(cfg(out, "trainer.total_training_steps=1", "trainer.resume_mode=auto"))
    summary = again.run()
    assert summary["steps"] == 1 and summary["hf"] and not summary.get("nothing_to_do")
    assert json.loads((out / "exports.json").read_text()) == {"step": 1}


# ---- 2. verified checkpoints ------------------------------------------------------------------------------------
def _two_checkpoints(out: Path) -> Trainer:
    tr = Trainer(
        cfg(out, "trainer.total_training_steps=2", "checkpoint.hf_export=false", "trainer.save_freq=1")
    )
    tr.run()
    return tr


def test_flipped_byte_in_a_shard_is_refused_and_the_previous_checkpoint_taken(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    _two_checkpoints(out)
    newest = out / "checkpoints" / "step_00000002"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[100:500] = bytes(b ^ 0xFF for b in data[100:500])  # 400 bytes flipped, size unchanged
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    again = Trainer(
        cfg(out, "trainer.total_training_steps=3", "checkpoint.hf_export=false", "trainer.resume_mode=auto")
    )
    text = capsys.readouterr().out
    assert again.step == 1
    notice = [ln for ln in text.splitlines() if ln.startswith("checkpoint step_00000002 is not usable")]
    assert len(notice) == 1 and f"{shard.name} is damaged: its sha256 differs" in notice[0], text
    assert "resumed from" in text and "step_00000001" in text


@pytest.mark.slow
def test_missing_train_state_is_named_not_skipped_silently(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    tr = _two_checkpoints(out)
    (out / "checkpoints" / "step_00000002" / "train_state.json").unlink()
    with pytest.raises(UserError, match=r"step_00000002: checkpoint file train_state.json is missing"):
        tr.store.verify(out / "checkpoints" / "step_00000002")
    capsys.readouterr()
    again = Trainer(
        cfg(out, "trainer.total_training_steps=3", "checkpoint.hf_export=false", "trainer.resume_mode=auto")
    )
    assert again.step == 1
    assert "train_state.json is missing (megatron_branch.json lists it)" in capsys.readouterr().out
    for step in (1, 2):  # every checkpoint damaged: refused in one line, nothing loaded
        (out / "checkpoints" / f"step_{step:08d}" / "megatron_branch.json").unlink(missing_ok=True)
    with pytest.raises(UserError, match="no checkpoint under .* verifies") as e:
        Trainer(cfg(out, "trainer.total_training_steps=3", "trainer.resume_mode=auto"))
    assert "\n" not in str(e.value)


# ---- 4. export any checkpoint -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_intermediate_checkpoint_exports_with_a_tokenizer_transformers_loads(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    tr = Trainer(cfg(out, "trainer.total_training_steps=3", "checkpoint.hf_export=true"))
    tr.train_step()
    tr.save()
    at_step_1 = params(tr)["embedding.word_embeddings.weight"]
    tr.run()  # steps 2-3, the final exports
    hf = tmp_path / "hf1"
    step1 = str(out / "checkpoints" / "step_00000001")
    assert main(["convert", "mcore-to-hf", "--mcore", step1, "--out", str(hf)]) == 0
    tok = AutoTokenizer.from_pretrained(str(hf))
    text = "k1:ab k2:cd ? k1:"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == tr.dataset.tokenizer.encode(text) and tok.decode(ids) == text  # the run's ids, round trip
    assert tok.eos_token_id == tr.dataset.tokenizer.eos_id and tok.pad_token_id == tr.dataset.tokenizer.pad_id
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    assert model.config.vocab_size == tr.arch.vocab_size
    emb = model.get_input_embeddings().weight
    assert torch.equal(emb, at_step_1[: emb.shape[0]])  # the step-1 weights, exactly
    # the final export carries the tokenizer too
    assert AutoTokenizer.from_pretrained(str(out / "hf")).encode(text, add_special_tokens=False) == ids


# ---- 5. input checks ----------------------------------------------------------------------------------------------
def test_tokenizer_larger_than_the_model_is_refused_with_no_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"the tokenizer has \d+ tokens but the model's vocabulary is 5") as e:
        Trainer(cfg(out, "model.arch.vocab_size=5"))
    assert "\n" not in str(e.value)
    assert not out.exists() and not list(tmp_path.glob(".run*"))


@pytest.mark.slow
def test_tokenizer_smaller_than_the_model_trains(tmp_path: Path) -> None:
    """A model padded past the tokenizer (vocab 64, tokenizer ~12): sampled padding ids decode to nothing."""
    tr = Trainer(cfg(tmp_path / "run", "model.arch.vocab_size=64", "trainer.total_training_steps=2",
                     "checkpoint.hf_export=false", "rollout.response_length=8"))  # fmt: skip
    assert tr.dataset.tokenizer.vocab_size < 64
    tr.run()
    sampled = {t for r in tr.last_batch for t in r.response}
    assert max(sampled) < 64 and tr.dataset.tokenizer.decode([tr.dataset.tokenizer.vocab_size, 63]) == ""


@pytest.mark.parametrize(
    "extra, rule",
    [
        (["parallel.sequence_parallel=true"], "sequence_parallel"),
        (["schedule.name=packed", "schedule.recompute=true"], "recompute"),
        (["schedule.name=naive", "schedule.backend=merge"], "backend"),
        (["schedule.name=naive", "schedule.enable_gradient_checkpointing=true"], "recompute_layers"),
    ],
)
def test_train_refuses_no_op_settings_by_grads_rule(tmp_path: Path, extra: list[str], rule: str) -> None:
    """The refusal is rules/'s / the layout's own (grad's), spelled in config keys and blamed on the override."""
    from megatron_branch.parallel.layout import ParallelLayout
    from megatron_branch.rules import check_run

    kw = {"sequence_parallel": {}, "recompute": {"recompute": True}, "backend": {"backend": "merge"},
          "recompute_layers": {"recompute_layers": True}}[rule]  # fmt: skip
    with pytest.raises(SettingError) as want:
        if rule == "sequence_parallel":
            ParallelLayout(sequence_parallel=True).check_no_op()
        else:
            check_run(extra[0].split("=")[1], **kw)
    with pytest.raises(UserError) as got:
        cfg(tmp_path / "run", *extra)
    assert str(got.value) == f"override {extra[-1]!r}: {want.value.spelled(SPELLING)}"


def test_override_errors_are_blamed_on_the_override(tmp_path: Path) -> None:
    yaml = tmp_path / "c.yaml"
    yaml.write_text("rollout: {n: 4}\n")
    base = [o for o in overrides(tmp_path / "run") if not o.startswith("rollout.n=")]
    with pytest.raises(
        UserError, match=r"^override 'rollout.nn=3': unknown config key rollout.nn \(did you mean"
    ):
        load_config(yaml, [*base, "rollout.nn=3"])
    with pytest.raises(UserError, match=r"^override 'optim.lr=fast': optim.lr must be a number"):
        load_config(yaml, [*base, "optim.lr=fast"])
    yaml.write_text("rollout: {nn: 4}\n")  # the file's own mistake stays the file's
    with pytest.raises(UserError, match=rf"^{yaml}: unknown config key rollout.nn"):
        load_config(yaml, base)


def test_texts_of_issue_35_name_the_field_and_the_override(tmp_path: Path) -> None:
    """A bad family says which families there are (not "must be a mapping | null"), and a rule between fields
    that names a section's field ("model.arch: family ...") or its wildcard ("moe.*") blames the override."""
    yaml = tmp_path / "c.yaml"
    yaml.write_text("rollout: {n: 4}\n")
    base = [o for o in overrides(tmp_path / "run") if not o.startswith("rollout.n=")]
    with pytest.raises(UserError) as e:
        load_config(yaml, [*base, "model.arch.family=gpt2"])
    from megatron_branch.models.families import families

    assert str(e.value).startswith("override 'model.arch.family=gpt2': model.arch: family must be one of ")
    assert all(name in str(e.value) for name in families()) and str(e.value).endswith("not 'gpt2'")
    with pytest.raises(UserError) as e:
        load_config(yaml, [*base, "moe.aux_loss_coeff=0.1"])  # a dense model
    assert str(e.value).startswith("override 'moe.aux_loss_coeff=0.1': parallel.ep / moe.* need a mixture")
    yaml.write_text("rollout: {n: 4}\nmoe: {aux_loss_coeff: 0.1}\n")  # the file's own: still the file's
    with pytest.raises(UserError, match=rf"^{yaml}: parallel.ep / moe.\* need"):
        load_config(yaml, base)


def test_run_failing_in_its_first_step_leaves_no_folder(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "run"
    tr = Trainer(cfg(out, "trainer.total_training_steps=2", "checkpoint.hf_export=false"))
    assert out.is_dir()

    def boom() -> dict:
        raise RuntimeError("planted failure in step 1")

    monkeypatch.setattr(tr, "train_step", boom)
    with pytest.raises(RuntimeError, match="planted"):
        tr.run()
    assert not out.exists()  # a rerun of the same command is not refused
    Trainer(cfg(out, "trainer.total_training_steps=1", "checkpoint.hf_export=false"))


# ---- 3. resume across layouts (the exact resumes: tests/distributed/test_resume_layouts.py) ------------------
def test_what_megatron_cannot_reshard_is_refused_naming_both_layouts() -> None:
    from megatron_branch.train.lifecycle import check_resharding

    def layout(tp: int, dp: int, *, dist_opt: bool = False, rows: int = 18) -> dict:
        return {"tp": tp, "cp": 1, "dp": dp, "world": tp * dp, "use_distributed_optimizer": dist_opt,
                "padded_vocab_size": rows}  # fmt: skip

    assert check_resharding(layout(2, 1), layout(2, 1), where="c") is False  # same layout: RNG kept
    assert check_resharding(None, layout(1, 1), where="c") is False  # a checkpoint without a record
    assert check_resharding(layout(2, 1), layout(1, 1), where="c") is True  # resharded, RNG restarted
    with pytest.raises(UserError) as e:
        check_resharding(layout(2, 1), layout(1, 2, dist_opt=True), where="ckpt")
    assert str(e.value).startswith(
        "ckpt: saved at tp=2 cp=1 dp=1 with optim.use_distributed_optimizer=false, "
    )
    assert "this run is tp=1 cp=1 dp=2 with optim.use_distributed_optimizer=true" in str(e.value)
    with pytest.raises(UserError, match=r"saved at tp=2 cp=1 dp=1 with the vocabulary padded to 18 rows, this run "
                       r"is tp=1 cp=1 dp=1 which pads it to 17"):  # fmt: skip
        check_resharding(layout(2, 1), layout(1, 1, rows=17), where="ckpt")


# ---- issue 35 item 9: what a resumed or finished run says ----------------------------------------------------
def test_resume_auto_on_a_new_folder_says_it_starts_fresh(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train(tmp_path, out, "trainer.total_training_steps=1", "--resume", "auto") == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"no checkpoint found under {out / 'checkpoints'}, starting fresh" in lines, lines


def test_nothing_to_do_is_one_clean_line_and_names_the_export(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert train(tmp_path, out, "trainer.total_training_steps=1") == 0
    capsys.readouterr()
    again = ("trainer.total_training_steps=1", "logging.progress_bar=true", "--resume", "auto")
    assert train(tmp_path, out, *again) == 0
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert lines[0].startswith("resumed from") and len(lines) == 3, lines
    assert lines[1].startswith(f"nothing to do: {out} is at step 1"), lines
    assert "train:" not in cap.err and "step/s" not in cap.err, cap.err  # no tqdm bar across the line
    summary = json.loads(lines[-1])
    assert summary["nothing_to_do"] and summary["hf"] == str(out / "hf") and (out / "hf").is_dir()


def test_print_config_prints_the_resolved_config_and_exits(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert main(["train", str(empty), *overrides(out, "rollout.n=4"), "--print-config"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "printed.yaml").write_text(printed)
    again = load_config(tmp_path / "printed.yaml")
    assert again == cfg(out, "rollout.n=4") and again.rollout.n == 4
    assert "optim:" in printed and "trainer:" in printed  # every section, defaults included
    assert not out.exists()  # nothing run, nothing written
