"""The GatedDeltaNet shims (compat/gdn.py): applied where needed, idempotent, required (a GDN does not build or run
without them), loud when megatron-core renames what they patch, and the path they select is megatron's torch one."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_branch.compat import gdn
from megatron_branch.compat.cpu import CompatError
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import tiny_hf_config

GDN = "megatron.core.ssm.gated_delta_net"


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def _arch() -> ModelArch:
    return ModelArch.from_hf_config(
        tiny_hf_config("qwen3_5", num_layers=2, layer_types=["linear_attention"] * 2)
    )


def _forward_backward(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 37, (1, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1)[None, None]
    out = model(ids, torch.arange(9)[None], mask)
    out.float().square().mean().backward()
    return out


def test_shims_apply_once_and_are_needed_here() -> None:
    assert gdn.gdn_uses_torch_path()  # no CUDA on this machine
    gdn.apply_gdn_shims()
    assert set(gdn.applied_gdn_shims()) == {"gdn_fla_fallback", "gdn_uncompiled_gated_norm"}
    assert gdn.apply_gdn_shims() == []  # idempotent
    mod = importlib.import_module(GDN)
    assert mod.HAVE_FLA and mod.l2norm is gdn.l2norm
    assert not hasattr(
        mod.GatedDeltaNet._apply_gated_norm, "_torchdynamo_orig_callable"
    )  # eager, not compiled


@pytest.mark.parametrize(
    "attr", ["HAVE_FLA", "l2norm", "torch_chunk_gated_delta_rule", "GatedDeltaNet", "GatedDeltaNetSubmodules"]
)
def test_patched_names_exist_in_pinned_megatron(attr: str) -> None:
    gdn.apply_gdn_shims()
    assert hasattr(importlib.import_module(GDN), attr), f"{GDN}.{attr} moved: update compat/gdn.py"


def test_renamed_targets_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = importlib.import_module(GDN)
    monkeypatch.delattr(mod, "torch_chunk_gated_delta_rule")
    with pytest.raises(CompatError, match="torch_chunk_gated_delta_rule"):
        gdn._shim_fla_fallback()
    monkeypatch.undo()
    monkeypatch.delattr(mod.GatedDeltaNet, "_apply_gated_norm")
    with pytest.raises(CompatError, match="_apply_gated_norm"):
        gdn._shim_uncompiled_gated_norm()


def test_without_the_fla_shim_the_layer_does_not_build(monkeypatch: pytest.MonkeyPatch) -> None:
    gdn.apply_gdn_shims()
    monkeypatch.setattr(importlib.import_module(GDN), "HAVE_FLA", False)  # what megatron finds on CPU
    with pytest.raises(ImportError, match="FLA is not installed"):
        build_model(_arch())


def test_without_the_l2norm_shim_the_layer_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    gdn.apply_gdn_shims()
    model = build_model(_arch())
    monkeypatch.delattr(importlib.import_module(GDN), "l2norm")  # megatron binds it only from fla
    with pytest.raises(NameError, match="l2norm"):
        _forward_backward(model)


def test_megatrons_torch_path_runs_in_float32_for_every_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """deterministic_mode selects torch_chunk_gated_delta_rule (the function the shims keep), which computes in
    float32 and returns the input dtype: the float64 bound of tests/unit/test_hybrid_models.py."""
    mod = importlib.import_module(GDN)
    real, seen = mod.torch_chunk_gated_delta_rule, []

    def spy(q: torch.Tensor, *args: object, **kw: object) -> tuple[torch.Tensor, object]:
        out = real(q, *args, **kw)
        seen.append((q.dtype, out[0].dtype))
        return out

    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", spy)
    for dtype in (torch.float32, torch.float64):
        seen.clear()
        model = build_model(_arch(), dtype=dtype)
        assert model.config.deterministic_mode
        assert _forward_backward(model).dtype == dtype
        assert seen == [(dtype, dtype)] * 2 and all(p.grad is not None for p in model.parameters())


def test_l2norm_is_fla_and_hf_formula() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm as hf_l2norm

    x = torch.randn(3, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(gdn.l2norm(x), hf_l2norm(x, dim=-1, eps=1e-6), rtol=0, atol=0)
    torch.testing.assert_close(gdn.l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
