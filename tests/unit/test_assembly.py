"""The run assembly (assembly/): ScheduleOptions and ParallelGroups are built in one place, HF weights load into a
stage through one loader, rules.check(spec) is the one check sequence, and grad's flags are the dataclasses' fields
(one default, one set of choices, one help per setting)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest
import torch

from megatron_branch import rules, spelling
from megatron_branch.assembly import MoEConfig, RunSpec, ScheduleConfig, build_engine, load_hf_weights
from megatron_branch.attention.dispatch import BACKENDS
from megatron_branch.commands.grad import add_grad_command
from megatron_branch.commands.grad_flags import GRAD_DEFAULTS, OBJECTIVE_ALIASES, SCHEDULE
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses.config import ObjectiveConfig
from megatron_branch.parallel.layout import ParallelLayout

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_branch"
ASSEMBLY = {"assembly/engine.py"}
"""Where ScheduleOptions( is constructed."""
GROUPS_HOME = {"parallel/groups.py"}
"""Where ParallelGroups is constructed (its own classmethods: from_parallel_state, single)."""


def _constructions(pattern: str) -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        code = "\n".join(ln.split("#")[0] for ln in path.read_text().splitlines())
        if re.search(pattern, code):
            found.add(str(path.relative_to(PACKAGE)))
    return found


def test_options_and_groups_are_built_only_by_the_assembly() -> None:
    assert _constructions(r"\bScheduleOptions\(") == ASSEMBLY
    assert _constructions(r"\bParallelGroups\(") <= GROUPS_HOME  # (groups.py builds them with cls(...))


def test_hf_weights_load_through_one_loader() -> None:
    """Only the assembly's load_hf_weights maps HF tensors into a model (iter_hf_to_mcore + a stage load)."""
    users = _constructions(r"\biter_hf_to_mcore\(") - {"checkpoint/param_map.py"}
    assert users <= {"assembly/engine.py", "checkpoint/hf_to_mcore.py", "checkpoint/verify.py"}, users
    assert "integration/verl_cpu.py" not in users and "commands/grad.py" not in users


def _grad_parser() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser().add_subparsers()
    add_grad_command(sub)
    return sub.choices["grad"]


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in reversed(parser._actions)}  # the first flag of a dest (not its alias switch)


@pytest.mark.parametrize(
    ("cls", "dests", "prefix"),
    [
        (ObjectiveConfig, {}, ""),
        (ScheduleConfig, SCHEDULE["dests"], ""),
        (ParallelLayout, {}, ""),
        (MoEConfig, {}, "moe_"),
    ],
    ids=["objective", "schedule", "layout", "moe"],
)
def test_grad_flags_are_the_dataclass_fields(cls: type, dests: dict[str, str], prefix: str) -> None:
    """Every field of the config train uses has a grad flag with the field's default (grad's contract default
    objective aside) and the field's Literal choices."""
    actions = _actions(_grad_parser())
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if cls is ParallelLayout and f.name == "dp":  # the rest of the world under torchrun, never a flag
            continue
        a = actions[dests.get(f.name, prefix + f.name)]
        assert a.default == GRAD_DEFAULTS.get(f.name, f.default), f.name
        base = hints[f.name]
        args = [t for t in typing.get_args(base) if t is not type(None)]
        lit = next((t for t in [base, *args] if typing.get_origin(t) is typing.Literal), None)
        if lit is not None and not (cls is ScheduleConfig and f.name == "name"):
            assert list(a.choices) == list(typing.get_args(lit)), f.name


def test_grad_defaults_and_choices_agree_with_train() -> None:
    """The KL estimator's default is verl's (low_var_kl), the backends are the executor registry's, the dtypes the
    precision table's, the schedules rules' grad list; the older spellings still parse."""
    p = _grad_parser()
    a = _actions(p)
    assert a["kl_loss_type"].default == ObjectiveConfig().kl_loss_type == "low_var_kl"
    assert "low_var_kl" in a["kl_loss_type"].help
    assert set(a["backend"].choices) == set(BACKENDS)
    assert typing.get_args(typing.get_type_hints(ScheduleConfig)["backend"])[0].__args__ == BACKENDS
    assert list(a["schedule"].choices) == [*rules.GRAD_SCHEDULES, "auto"]  # auto: plan/auto.py picks one
    assert a["dtype"].default == RunSpec().dtype and list(a["dtype"].choices) == [
        "float32",
        "float64",
        "bfloat16",
        "float16",
    ]
    base = ["--hf", "h", "--rollouts", "r", "--out", "o"]
    for field, old in OBJECTIVE_ALIASES.items():
        value = {"kl_loss_type": "k2", "loss_agg_mode": "seq-mean-token-sum"}.get(field, "0.5")
        got = p.parse_args([*base, old[0], value])
        assert str(getattr(got, field)) == value, field
    assert p.parse_args([*base, "--routing-replay"]).moe_router_replay == "R3"
    assert p.parse_args([*base, "--enable-gradient-checkpointing"]).recompute_layers is True


def test_check_is_the_one_sequence() -> None:
    """rules.check refuses each kind of setting the entry points used to check one by one (planted: a good spec
    passes)."""
    rules.check(RunSpec())
    bad = [
        RunSpec(schedule=ScheduleConfig(name="naive"), layout=ParallelLayout(cp=2)),  # check_run
        RunSpec(dtype="bfloat16", grad_sync="manual"),  # check_precision
        RunSpec(dtype="float16", training=True),
        RunSpec(layout=ParallelLayout(ep=2), grad_sync="manual"),
        RunSpec(schedule=ScheduleConfig(root_pieces=2)),  # check_pipeline
        RunSpec(layout=ParallelLayout(sequence_parallel=True)),  # the layout's no-op
    ]
    for spec in bad:
        with pytest.raises(SettingError):
            rules.check(spec)
    with pytest.raises(SettingError, match="--grad-sync manual does not reduce expert-parallel"):
        rules.check(bad[3])
    # whole experts on each TP rank: their grads need megatron's expert-DP sum, which only DDP does
    with pytest.raises(SettingError, match="--grad-sync manual does not reduce .* with --etp"):
        rules.check(RunSpec(layout=ParallelLayout(tp=2, etp=1, sequence_parallel=True), grad_sync="manual"))


def test_check_model_reads_the_arch() -> None:
    from megatron_branch.testing import tiny_arch

    arch = tiny_arch()
    rules.check(RunSpec(arch=arch))
    with pytest.raises(SettingError, match="does not divide"):
        rules.check(RunSpec(arch=arch, layout=ParallelLayout(pp=arch.num_layers + 1)))
    with pytest.raises(SettingError, match="mixture-of-experts"):
        rules.check(RunSpec(arch=arch, moe=MoEConfig(z_loss_coeff=0.1)))


def test_one_spelling_table() -> None:
    """grad, train and the library name a setting from one table's columns."""
    from megatron_branch.train.validate import SPELLING

    assert rules.API is spelling.API and rules.API.name("cp") == "cp_size"
    assert SPELLING.name("cp") == "parallel.cp" and SPELLING.name("recompute_layers").endswith(
        "checkpointing"
    )
    assert spelling.FLAGS.name("policy_loss") == "--objective" and spelling.FLAGS.name("cp") == "--cp"
    assert SPELLING.name("clip_ratio_c") == "actor.clip_ratio_c"


def test_build_engine_loads_hf_weights_into_the_stage(tmp_path: Path) -> None:
    """build_engine's model holds the HF weights (the one loader), its options the spec's schedule settings."""
    from megatron_branch.checkpoint.hf_io import load_hf_config
    from megatron_branch.checkpoint.param_map import mcore_to_hf_state
    from megatron_branch.checkpoint.tp import gather_full_state
    from megatron_branch.models import ModelArch
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    hf = tiny_hf_model(tiny_hf_config("llama", tie=False), seed=5)
    hf.save_pretrained(tmp_path)
    arch = ModelArch.from_hf_config(load_hf_config(str(tmp_path)))
    spec = RunSpec(
        hf_path=str(tmp_path), arch=arch, schedule=ScheduleConfig(branch_micro_batch=3, recompute=True)
    )
    rules.check(spec)
    engine = build_engine(spec)
    assert (
        engine.opts.branch_micro_batch == 3
        and engine.opts.recompute
        and engine.opts.vocab_size == arch.vocab_size
    )
    got = mcore_to_hf_state(gather_full_state(engine.model, None, None), arch)
    want = hf.state_dict()
    for name, t in got.items():
        assert torch.equal(t, want[name].to(t.dtype)), name
    with torch.no_grad():  # planted: a clobbered weight is restored by the loader
        next(engine.model.parameters()).zero_()
    load_hf_weights(engine.model, str(tmp_path), arch, engine.groups, torch.float32)
    again = mcore_to_hf_state(gather_full_state(engine.model, None, None), arch)
    assert all(torch.equal(again[n], got[n]) for n in got)
    with pytest.raises(UserError):  # the loader names what is wrong with a folder
        load_hf_weights(engine.model, str(tmp_path / "nope"), arch, engine.groups, torch.float32)


def test_grad_command_stays_thin() -> None:
    """Issue 29: the command is flags (generated), checks and one call into the assembly; its size is the symptom
    that the assembly leaked back into it (it was 504 lines)."""
    import megatron_branch.commands.grad as grad

    assert len(Path(grad.__file__).read_text().splitlines()) < 250
