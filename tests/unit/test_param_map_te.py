"""The parameter map under megatron's TransformerEngine layer spec (TE fuses each norm into the next projection).

TE is not installed on CPU, so the spec is built by megatron's own `get_gpt_layer_with_transformer_engine_spec`
with its TE spec provider replaced by named stand-ins: that checks, from megatron's code, WHERE the norms go;
the names are then the stand-ins' module paths plus TE's `layer_norm_weight` / `weight` / `bias`. The TE model
itself (real TE modules, state_dict names, a conversion round trip on GPU) is tests/gpu/test_gpu_te_spec.py.
"""

from __future__ import annotations

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
