"""The training config: YAML + dotted overrides, one-line errors for every kind of mistake, resolved output."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_branch.errors import UserError
from megatron_branch.train.config import TrainConfig
from megatron_branch.train.config_io import load_config, to_dict, write_resolved

BASE = {
    "model": {
        "arch": {"hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 64}
    },
    "data": {"task": "kv_retrieval"},
}


def _write(tmp_path: Path, body: dict | str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
    return p


def test_overrides_and_types(tmp_path: Path) -> None:
    cfg = load_config(
        _write(tmp_path, BASE),
        ["rollout.n=8", "optim.lr=1e-5", "actor.clip_ratio_c=3", "rollout.stop=[a, b]"],
    )
    assert cfg.rollout.n == 8 and isinstance(cfg.rollout.n, int)
    assert (
        cfg.optim.lr == 1e-5 and cfg.actor.clip_ratio_c == 3.0 and isinstance(cfg.actor.clip_ratio_c, float)
    )
    assert cfg.rollout.stop == ["a", "b"]
    assert cfg.model.arch is not None and cfg.model.arch.hidden_size == 32
    # verl's names are where verl has them
    for key in (
        "clip_ratio_low",
        "clip_ratio_high",
        "kl_loss_coef",
        "loss_agg_mode",
        "ppo_epochs",
        "ppo_mini_batch_size",
    ):
        assert hasattr(cfg.actor, key)
    assert hasattr(cfg.trainer, "total_training_steps") and hasattr(cfg.trainer, "resume_mode")


def test_yaml_float_written_1e_minus_5(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "optim:\n  lr: 1e-5\n" + yaml.safe_dump(BASE)))
    assert cfg.optim.lr == 1e-5


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, BASE), ["rollout.n=3"])
    out = tmp_path / "resolved.yaml"
    write_resolved(cfg, out)
    again = load_config(out)
    assert to_dict(again) == to_dict(cfg)


OFFLOAD = ("use_distributed_optimizer", "use_precision_aware_optimizer", "optimizer_cpu_offload")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.nn=8"], r"unknown config key rollout\.nn \(did you mean rollout\.n\?\)"),
        (["actor.clip_ratio_lo=0.1"], r"did you mean actor\.clip_ratio_low"),
        (["rolout.n=2"], r"unknown config key rolout \(did you mean rollout\?\)"),
        (["rollout.n=two"], r"rollout\.n must be an integer, got 'two'"),
        (["rollout.n=2.5"], r"rollout\.n must be an integer"),
        (["logging.tensorboard=3"], r"logging\.tensorboard must be true or false"),
        (["schedule.name=replai"], r"schedule\.name must be one of .*did you mean 'replay'"),
        (["rollout.n=1"], r"rollout\.n=1 with algorithm\.name=grpo"),
        (["parallel.tp=3"], r"parallel\.tp: tensor parallel size 3 does not divide num_attention_heads=4"),
        (
            ["data.max_prompt_length=1020", "rollout.response_length=16"],
            r"exceeds the model's context of 1024",
        ),
        (["actor.clip_ratio_c=0.5"], r"clip_ratio_c must be > 1"),
        (["data.train_batch_size=4", "actor.ppo_mini_batch_size=3"], r"must divide data\.train_batch_size"),
        (["algorithm.name=dpo"], r"needs data\.pairs_file"),
        (["trainer.save_freq=0"], r"save_freq"),
        (["rollout=3"], r"rollout must be a mapping"),
        (["rollout.n"], r"must look like section\.key=value"),
        (["schedule.name=naive", "parallel.cp=2"], r"schedule\.name=naive has no context parallelism"),
        (
            ["schedule.name=naive", "schedule.enable_gradient_checkpointing=true"],
            r"enable_gradient_checkpointing applies to schedule\.name replay or packed",
        ),
        (
            ["optim.optimizer_cpu_offload=true"],
            r"optim: optimizer_cpu_offload needs use_distributed_optimizer",
        ),
        (["optim.optimizer_offload_fraction=2"], r"optim: optimizer_offload_fraction must be in \[0, 1\]"),
        (["optim.exp_avg_dtype=bf16"], r"optim: exp_avg_dtype=bf16 needs use_precision_aware_optimizer"),
        (
            [f"optim.{k}=true" for k in OFFLOAD] + ["optim.main_grads_dtype=bf16"],
            r"optim: main_grads_dtype=bf16 needs bf16 parameters .* the parameters are float32",
        ),
        (
            [f"optim.{k}=true" for k in OFFLOAD] + ["optim.exp_avg_sq_dtype=bf16"],
            r"optim: exp_avg_sq_dtype=bf16 with optimizer_cpu_offload: .* keeps Adam's moments in fp32",
        ),
    ],
)
def test_one_line_errors(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(UserError, match=message) as e:
        load_config(_write(tmp_path, BASE), overrides)
    assert "\n" not in str(e.value)


SAMPLING_RULES = [
    (
        ["rollout.response_length=4", "rollout.branch_at=[2, 5]"],
        dict(max_new_tokens=4, branch_at=(2, 5)),
        "{branch_at} must be strictly increasing token counts in (0, {max_new_tokens}=4), got [2, 5]",
    ),
    (
        ["rollout.n=6", "rollout.branch_at=[1, 2]"],
        dict(n=6, max_new_tokens=16, branch_at=(1, 2)),
        "{n}=6 must be divisible by {branch_factor} ** len({branch_at}) = 4",
    ),
    (
        ["rollout.share_prefix=false", "rollout.branch_at=[2]"],
        dict(max_new_tokens=4, branch_at=(2,), share_prefix=False),
        "{share_prefix}=false samples every rollout on its own (its own prefill); {branch_at} forks rollouts",
    ),
    (["rollout.n=0"], dict(n=0, max_new_tokens=4), "{n} must be a positive int, got 0"),
    (["rollout.temperature=-1"], dict(max_new_tokens=4, temperature=-1.0), "{temperature} must be >= 0"),
    (["rollout.top_p=0"], dict(max_new_tokens=4, top_p=0.0), "{top_p} must be in (0, 1], got 0.0"),
]
"""The sampler's rules, checked once (SamplingParams; rules.check_sampling): the config builds SamplingParams
and re-spells its error in config keys; a library caller reads SamplingParams' own field names."""


@pytest.mark.parametrize("overrides, library, wording", SAMPLING_RULES)
def test_sampling_rules_checked_once_in_both_spellings(
    tmp_path: Path, overrides: list[str], library: dict, wording: str
) -> None:
    from megatron_branch.generation.types import SamplingParams

    fields = ("n", "max_new_tokens", "temperature", "top_p", "branch_at", "branch_factor", "share_prefix")
    config_names = dict(
        zip(fields, ["rollout." + f for f in fields]), max_new_tokens="rollout.response_length"
    )
    with pytest.raises(UserError) as e:
        load_config(_write(tmp_path, BASE), overrides)
    assert wording.format(**config_names) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:  # no "where": the library's message starts with the rule
        SamplingParams(**library)
    assert str(e.value).startswith(wording.format(**{f: f"SamplingParams.{f}" for f in fields}))


def test_rollout_top_k_is_verls_spelling(tmp_path: Path) -> None:
    """rollout.top_k: -1 is off (verl's), the sampler's 0; the config's own rule refuses 0 and below -1."""
    from megatron_branch.train.validate import sampling_params

    assert sampling_params(load_config(_write(tmp_path, BASE))).top_k == 0
    assert sampling_params(load_config(_write(tmp_path, BASE), ["rollout.top_k=5"])).top_k == 5
    for bad in ("0", "-2"):
        with pytest.raises(
            UserError, match=rf"rollout\.top_k must be a positive number of tokens or -1 \(off\), got {bad}"
        ):
            load_config(_write(tmp_path, BASE), [f"rollout.top_k={bad}"])


def test_cp_accepted_with_the_ring_schedules(tmp_path: Path) -> None:
    for name in ("replay", "packed"):
        assert (
            load_config(_write(tmp_path, BASE), [f"schedule.name={name}", "parallel.cp=2"]).parallel.cp == 2
        )


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"c\.yaml:2: invalid YAML"):
        load_config(_write(tmp_path, "a: 1\n b: [\n"))
    with pytest.raises(UserError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="mapping of sections"):
        load_config(_write(tmp_path, "- 1\n"))


def test_every_field_has_a_docstring() -> None:
    """docs/training.md is generated from these; a field without one would be undocumented."""
    import ast
    import inspect

    import megatron_branch.train.config as mod

    tree = ast.parse(inspect.getsource(mod))
    missing = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass" for d in node.decorator_list
        ):
            body = node.body
            for j, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[j + 1] if j + 1 < len(body) else None
                    if not (
                        isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                    ):
                        missing.append(f"{node.name}.{stmt.target.id}")
    assert not missing, missing
    assert TrainConfig.__doc__


def test_docs_list_every_key() -> None:
    """docs/training.md's reference names every config key (regenerate it when a field is added)."""
    import dataclasses
    import typing

    from megatron_branch.train.config import ArchConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    hints = typing.get_type_hints(TrainConfig)
    keys = [
        f"{f.name}.{g.name}"
        for f in dataclasses.fields(TrainConfig)
        for g in dataclasses.fields(hints[f.name])
    ]
    keys += [f"model.arch.{g.name}" for g in dataclasses.fields(ArchConfig)]
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, missing


def test_docs_reference_is_generated() -> None:
    """docs/training.md's config reference IS the generator's output: a changed docstring, default or type is
    caught (fix: `python -m megatron_branch.train.reference --write`)."""
    from megatron_branch.train import reference

    text = reference.DOCS.read_text()
    assert reference.with_reference(text) == text


def test_reference_reads_field_docstrings() -> None:
    """The generator finds a field's docstring, inherited ones included (ArchConfig's from ModelArch)."""
    from megatron_branch.train import reference
    from megatron_branch.train.config import ArchConfig

    docs = reference.field_docs(ArchConfig)
    assert docs["family"].startswith('"llama"')  # ArchConfig's own wins over ModelArch's
    assert docs["linear_conv_kernel_dim"].startswith("Linear-attention layers")  # inherited
    assert "| `parallel.tp` | int | `1` |" in reference.reference()
