"""The parameter map under megatron's TransformerEngine layer spec (TE fuses each norm into the next projection).

TE is not installed on CPU, so the spec is built by megatron's own `get_gpt_layer_with_transformer_engine_spec`
with its TE spec provider replaced by named stand-ins: that checks, from megatron's code, WHERE the norms go;
the names are then the stand-ins' module paths plus TE's `layer_norm_weight` / `weight` / `bias`. The TE model
itself (real TE modules, state_dict names, a conversion round trip on GPU) is tests/gpu/test_gpu_te_spec.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp

from megatron_branch.checkpoint.param_map import (
    detect_spec,
    hf_shapes,
    hf_to_mcore_state,
    mcore_names,
    mcore_to_hf_state,
    sharded_keys,
)
from megatron_branch.models import ModelArch

ARCH = ModelArch(
    family="qwen2",
    vocab_size=37,
    hidden_size=16,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=24,
    qkv_bias=True,
)


class TELayerNormColumnParallelLinear:  # stand-ins named like TE's modules
    pass


class TEColumnParallelLinear:
    pass


class TERowParallelLinear:
    pass


class TEDotProductAttention:
    pass


class TENorm:
    pass


class FakeTESpecProvider:
    """The BackendSpecProvider interface megatron's TE spec builder calls, returning stand-ins."""

    def __init__(self, *_: object, **__: object) -> None:
        pass

    def column_parallel_layer_norm_linear(self) -> type:
        return TELayerNormColumnParallelLinear

    def column_parallel_linear(self) -> type:
        return TEColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return TERowParallelLinear

    def core_attention(self) -> type:
        return TEDotProductAttention

    def layer_norm(self, *_: object, **__: object) -> type:
        return TENorm

    def linear(self) -> type:
        return TEColumnParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def activation_func(self) -> None:
        return None

    def grouped_mlp_modules(self, *_: object, **__: object) -> tuple:
        raise AssertionError("dense model: no MoE")


def te_spec(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", FakeTESpecProvider, raising=False)
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)


def test_megatrons_te_spec_fuses_the_norms_where_the_map_says(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = te_spec(monkeypatch).submodules
    assert spec.input_layernorm is IdentityOp and spec.pre_mlp_layernorm is IdentityOp
    assert spec.self_attention.submodules.linear_qkv is TELayerNormColumnParallelLinear
    assert spec.mlp.submodules.linear_fc1 is TELayerNormColumnParallelLinear
    # so the norm weights live in those two modules, under TE's parameter name
    te = set(mcore_names(ARCH, "te"))
    for i in range(ARCH.num_layers):
        assert f"decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight" in te
        assert f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight" in te
        assert not any(".input_layernorm." in n or ".pre_mlp_layernorm." in n for n in te)


def test_te_names_are_the_local_names_with_fused_norms() -> None:
    local, te = mcore_names(ARCH), mcore_names(ARCH, "te")
    assert len(local) == len(te) == len(set(te))
    renamed = {a: b for a, b in zip(local, te) if a != b}
    assert len(renamed) == 2 * ARCH.num_layers
    for a, b in renamed.items():
        assert (a.endswith("input_layernorm.weight") and b.endswith("linear_qkv.layer_norm_weight")) or (
            a.endswith("pre_mlp_layernorm.weight") and b.endswith("linear_fc1.layer_norm_weight")
        )
    assert detect_spec(te) == "te" and detect_spec(local) == "local"


def test_hf_round_trip_through_te_names_is_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=gen) for n, s in hf_shapes(ARCH).items()}
    te = hf_to_mcore_state(hf, ARCH, padded_vocab=40, spec="te")
    local = hf_to_mcore_state(hf, ARCH, padded_vocab=40)
    assert set(te) == set(mcore_names(ARCH, "te"))
    for a, b in zip(mcore_names(ARCH), mcore_names(ARCH, "te")):
        assert torch.equal(local[a], te[b])
    te["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(
        1
    )  # TE carries these; ignored
    back = mcore_to_hf_state(te, ARCH)  # spec detected from the names
    assert back.keys() == hf.keys()
    for n in hf:
        assert torch.equal(back[n], hf[n]), n


# --- dist checkpoints: one set of keys serves both specs --------------------------------------------------------------
def test_megatrons_specs_save_the_norms_under_the_same_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Derived from megatron's spec builders (not from the Rule table): the local spec re-keys its norms with
    # `sharded_state_dict_keys_map`; the TE spec has no norm modules to re-key, its norm weight is TE's
    # `layer_norm_weight` inside the fused projection. Applying each to its own module names gives one key set.
    local_map = gpt_layer_specs.get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map
    te = te_spec(monkeypatch).submodules
    assert not any("layernorm" in k for k in te.sharded_state_dict_keys_map)
    te_keys = {
        "self_attention.linear_qkv.layer_norm_weight",  # TELayerNormColumnParallelLinear in linear_qkv
        "mlp.linear_fc1.layer_norm_weight",  # ... and in linear_fc1 (checked above)
    }
    local_keys = set()
    for name in ("input_layernorm.weight", "pre_mlp_layernorm.weight"):
        old, new = next((o, n) for o, n in local_map.items() if name.startswith(o))
        local_keys.add(new + name[len(old) :])
    assert local_keys == te_keys
    expected = {"decoder.layers." + k for k in te_keys}
    assert expected <= set(sharded_keys(ARCH))  # the map's dist-checkpoint keys (from the Rule table's `te`)


def _tiny_hf_dir(tmp_path: Path) -> Path:
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    d = tmp_path / "hf"
    tiny_hf_model(tiny_hf_config("qwen2", tie=False, ffn=48), seed=0).save_pretrained(str(d))
    return d


def test_converted_checkpoint_has_the_te_spec_keys_and_round_trips(tmp_path: Path) -> None:
    from megatron.core import dist_checkpointing

    from megatron_branch.checkpoint import convert_hf_to_mcore, convert_mcore_to_hf
    from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config

    hf_dir = _tiny_hf_dir(tmp_path)
    arch = ModelArch.from_hf_config(load_hf_config(hf_dir))
    convert_hf_to_mcore(hf_dir, tmp_path / "mc", progress=False)
    keys = set(dist_checkpointing.load_tensors_metadata(str(tmp_path / "mc")))
    keys = {k for k in keys if not k.endswith("._extra_state")}  # megatron's (empty) per-module extra state
    assert keys == set(sharded_keys(arch))
    assert detect_spec(keys) == "te"  # what a TE-spec model asks for: the fused norm names
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "out")
    src, dst = HFTensorReader(hf_dir), HFTensorReader(tmp_path / "out")
    assert sorted(src.keys()) == sorted(dst.keys())
    for k in src.keys():
        assert torch.equal(src.get(k), dst.get(k)), k


def test_norms_under_local_module_names_are_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from megatron_branch.checkpoint import hf_to_mcore, load_full_state, load_mcore_checkpoint
    from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
    from megatron_branch.compat.cpu import CompatError
    from megatron_branch.errors import UserError
    from megatron_branch.models import build_model
    from megatron_branch.parallel.groups import ParallelConfig, init_distributed, initialize_parallel

    hf_dir = _tiny_hf_dir(tmp_path)
    arch = ModelArch.from_hf_config(load_hf_config(hf_dir))
    init_distributed()
    groups = initialize_parallel(ParallelConfig(tp=1))
    model = build_model(arch)
    reader = HFTensorReader(hf_dir)
    load_full_state(
        model, hf_to_mcore_state({k: reader.get(k) for k in reader.keys()}, arch, padded_vocab=37), groups.tp
    )
    # a spec without megatron's keys map: the norm saved under its module's own name
    unmapped = {
        n: dataclasses.replace(sh, key="decoder.layers." + n.split(".", 3)[3])
        if n.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight"))
        else sh
        for n, sh in model.sharded_state_dict().items()
    }
    monkeypatch.setattr(model, "sharded_state_dict", lambda: unmapped)
    kw = dict(arch=arch, dtype=torch.float32, tp=1)
    with pytest.raises(CompatError, match="input_layernorm") as e:
        hf_to_mcore.save_mcore_checkpoint(model, tmp_path / "mc", **kw)
    assert "\n" not in str(e.value) and not (tmp_path / "mc").exists()
    monkeypatch.setattr(hf_to_mcore, "check_sharded_keys", lambda *_: None)
    hf_to_mcore.save_mcore_checkpoint(model, tmp_path / "mc", **kw)
    with pytest.raises(
        UserError, match="lacks tensor 'decoder.layers.self_attention.linear_qkv.layer_norm_weight'"
    ) as e:
        load_mcore_checkpoint(tmp_path / "mc")
    assert "\n" not in str(e.value) and "input_layernorm.weight" in str(e.value)
