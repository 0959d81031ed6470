"""The model-family registry (models/families/): every registered family's tables agree with its tiny model, the
old tables are views of the registry, registration errors are one line, a family registered from a test file
works in `grad`, `convert` and `verify-conversion`, no package module imports megatron_branch.testing, and
examples/make_tiny_assets.py --family makes a model `grad` runs on, for every family."""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_branch.checkpoint.fused_experts import split_views
from megatron_branch.checkpoint.param_map import hf_shapes
from megatron_branch.cli import main
from megatron_branch.data import write_rollouts_jsonl
from megatron_branch.errors import UserError
from megatron_branch.models import ModelArch
from megatron_branch.models.families import (
    FamilySpec,
    export_classes,
    families,
    get_family,
    model_types,
    moe_families,
    param_maps,
    register_family,
    supported_architectures,
    unregister_family,
)
from megatron_branch.models.families.hf_fields import common_fields, default_rope
from megatron_branch.models.families.param_rules import DECODER_RULES
from megatron_branch.models.families.registry import TRAIN_DEFAULT_FIELDS
from megatron_branch.testing import (
    exact_hf_norms,
    hf_policy_gradient,
    hf_state,
    random_tree_rollouts,
    tiny_hf_config,
    tiny_hf_model,
)

ROOT = Path(__file__).resolve().parents[2]
EVERY_FAMILY = (  # the families the package ships; the per-family tests below run over every registered one
    "llama", "qwen2", "qwen3", "qwen3_5", "qwen3_moe", "mixtral", "qwen2_moe", "qwen3_5_moe", "qwen3_next",
    "glm4_moe", "deepseek_v3", "nemotron_h", "gpt_oss",
)  # fmt: skip


def test_every_existing_family_is_registered_once_with_its_own_file() -> None:
    assert sorted(families()) == sorted(EVERY_FAMILY)
    for name in families():
        assert (ROOT / "megatron_branch" / "models" / "families" / f"{name}.py").is_file(), name


@pytest.mark.parametrize("name", families())
def test_a_familys_tables_agree_with_its_tiny_model(name: str) -> None:
    spec = get_family(name)
    cfg = tiny_hf_config(name)
    # the derived views name this family for its HF classes and model types
    assert all(supported_architectures()[a] == name for a in spec.architectures)
    assert all(model_types()[t] == name for t in spec.model_types)
    assert cfg.architectures[0] in spec.architectures and cfg.model_type in spec.model_types
    assert export_classes()[name] == spec.export_class and param_maps()[name] is spec.param_rules
    arch = ModelArch.from_hf_config(cfg)
    assert arch.family == name
    back = arch.to_hf_config()
    assert back.architectures == [spec.export_class] and ModelArch.from_hf_config(back) == arch
    # what the spec says it is made of is what its model has
    assert spec.moe == arch.is_moe == (name in moe_families())
    assert ("gdn" in spec.layer_kinds) == (arch.num_linear_layers > 0 or arch.layer_types is not None)
    assert ("shared_expert" in spec.layer_kinds) == (arch.shared_expert_ffn_hidden_size > 0)
    assert ("gated_attention" in spec.layer_kinds) == arch.attention_output_gate
    assert ("mamba" in spec.layer_kinds) == ("M" in (arch.hybrid_override_pattern or ""))
    # a config-defined arch of this family gets the family's defaults, which its HF models agree with
    fields = {f.name for f in dataclasses.fields(ModelArch)}
    assert set(TRAIN_DEFAULT_FIELDS) <= fields
    for field in TRAIN_DEFAULT_FIELDS:
        assert spec.train_default(field) == getattr(arch, field), (name, field)
    # the parameter map covers exactly the tiny model's tensors, with their shapes (gpt-oss's fused experts as
    # the map reads them: per expert, checkpoint/fused_experts.py)
    state = hf_state(tiny_hf_model(cfg, seed=0))
    names, get = split_views(state, state.__getitem__, arch.num_experts)
    assert hf_shapes(arch) == {n: tuple(get(n).shape) for n in names}


def test_unknown_duplicate_and_unregistered_families_are_one_line() -> None:
    with pytest.raises(UserError) as e:
        get_family("gpt2")
    assert str(e.value).startswith("unknown model family 'gpt2'; registered: ") and "qwen3_next" in str(
        e.value
    )
    with pytest.raises(ValueError, match="^model family 'llama' is already registered$"):
        register_family(get_family("llama"))
    clash = dataclasses.replace(get_family("llama"), name="llama_again")
    with pytest.raises(
        ValueError,
        match="^HF class 'LlamaForCausalLM' of family 'llama_again' is already claimed by family 'llama'$",
    ):
        register_family(clash)
    with pytest.raises(
        UserError, match=f"^unknown model family 'nope'; registered: {', '.join(families())}$"
    ):
        unregister_family("nope")
    with pytest.raises(ValueError, match=f"^family must be one of {', '.join(families())}, not 'gpt2'$"):
        ModelArch(family="gpt2", vocab_size=8, hidden_size=8, num_layers=1, num_attention_heads=2,
                  num_query_groups=1, ffn_hidden_size=8)  # fmt: skip
    assert "llama_again" not in families()


def test_no_package_module_imports_the_test_helpers() -> None:
    """megatron_branch.testing is for tests and examples; production code must not depend on it."""
    offenders = []
    for path in sorted((ROOT / "megatron_branch").rglob("*.py")):
        if path.name == "testing.py" and path.parent.name == "megatron_branch":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            if "megatron_branch.testing" in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


# --- a family registered from this file -------------------------------------------------------------------------
CLONE = "llama_clone"


@pytest.fixture(scope="module")
def clone_family() -> Iterator[FamilySpec]:
    """A Llama under a new name, model_type and HF class: registered with transformers (its own extension
    mechanism: AutoConfig / AutoModelForCausalLM.register) and with the engine (one FamilySpec), nothing else."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    class LlamaCloneConfig(transformers.LlamaConfig):
        model_type = CLONE

    class LlamaCloneForCausalLM(transformers.LlamaForCausalLM):
        config_class = LlamaCloneConfig

    AutoConfig.register(CLONE, LlamaCloneConfig, exist_ok=True)
    AutoModelForCausalLM.register(LlamaCloneConfig, LlamaCloneForCausalLM, exist_ok=True)

    def tiny(common: dict, **_: object) -> LlamaCloneConfig:
        return LlamaCloneConfig(architectures=["LlamaCloneForCausalLM"], **common)

    spec = register_family(
        FamilySpec(
            name=CLONE,
            architectures=("LlamaCloneForCausalLM",),
            model_types=(CLONE,),
            export_class="LlamaCloneForCausalLM",
            read_hf=lambda d, where: common_fields(CLONE, d, where),
            hf_config=lambda arch, common: LlamaCloneConfig(rope_parameters=default_rope(arch), **common),
            param_rules=DECODER_RULES,
            tiny_hf_config=tiny,
            layer_kinds=("attention", "mlp"),
        )
    )
    yield spec
    unregister_family(CLONE)


def test_a_family_registered_from_a_test_works_in_grad_convert_and_verify(
    clone_family: FamilySpec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = tiny_hf_model(tiny_hf_config(CLONE), seed=5)
    assert type(hf).__name__ == "LlamaCloneForCausalLM"
    hf.save_pretrained(tmp_path / "hf")
    rollouts = random_tree_rollouts(groups=2, prompt_len=5, branches=3, levels=2, seed=3)
    write_rollouts_jsonl(tmp_path / "r.jsonl", rollouts)

    # grad: exactly HF's per-rollout gradient (float64)
    rc = main(["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "r.jsonl"),
               "--out", str(tmp_path / "g.safetensors"), "--dtype", "float64"])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    _, want = hf_policy_gradient(exact_hf_norms(hf.to(torch.float64)), rollouts)
    got = load_file(tmp_path / "g.safetensors")
    assert got.keys() == want.keys()
    worst = max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())
    assert worst <= 1e-9, worst

    # convert both ways: the family's class comes back, every tensor bit-exact; verify-conversion passes
    assert main(["convert", "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mc")]) == 0
    assert (
        main(["convert", "mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "back")])
        == 0
    )
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [
        "LlamaCloneForCausalLM"
    ]
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    capsys.readouterr()
    assert main(["verify-conversion", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "mc")]) == 0

    # planted bug: without its spec the same folder is refused in one line, naming the class
    unregister_family(CLONE)
    try:
        capsys.readouterr()
        assert main(["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "r.jsonl"),
                     "--out", str(tmp_path / "g2.safetensors")]) == 2  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert "unsupported architecture 'LlamaCloneForCausalLM'" in err and len(err.splitlines()) == 1, err
    finally:
        register_family(clone_family)


# --- make_tiny_assets for every family ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", families())
def test_make_tiny_assets_then_grad(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_tiny_assets", ROOT / "examples" / "make_tiny_assets.py"
    )
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--out", str(tmp_path), "--family", name, "--groups", "1", "--prompt-len", "6"])
    assert (
        json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"][0]
        in get_family(name).architectures
    )
    first = json.loads((tmp_path / "rollouts.jsonl").read_text().splitlines()[0])
    assert ("routed_experts" in first) == get_family(name).moe
    extra = ["--routing-replay"] if get_family(name).moe else []
    capsys.readouterr()
    rc = main(["grad", "--hf", str(tmp_path / "hf"), "--rollouts", str(tmp_path / "rollouts.jsonl"),
               "--out", str(tmp_path / "g.safetensors"), *extra])  # fmt: skip
    out, err = capsys.readouterr()
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    # the records agree on shared prefixes (the HF model routed them): replay still computes each prefix once
    assert summary["positions_computed"] < summary["positions_logical"]
    assert load_file(tmp_path / "g.safetensors")
