"""The MoE shims (compat/moe.py): applied where needed, idempotent, loud when megatron renames what they patch,
and each one needed: with it undone, megatron's MoE fails (or loses float64) on this machine.

The variable-size TP gather shim (gloo) is exercised under TP x EP by tests/distributed/test_moe_parallel.py; here
its exchange is checked against the plain one on a world of one and its failure mode without it is recorded.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_branch.compat import moe as moe_shims
from megatron_branch.compat.cpu import CompatError, needs_cpu_shims
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

pytestmark = pytest.mark.skipif(not needs_cpu_shims(), reason="the CPU shims apply only without CUDA")
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
UTILS = "megatron.core.transformer.moe.moe_utils"


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def tiny_moe(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.testing import tiny_hf_config

    return build_model(ModelArch.from_hf_config(tiny_hf_config("qwen3_moe")), dtype=dtype)


def forward_backward(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 37, (1, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1)[None, None]
    out = model(ids, torch.arange(9)[None], mask)
    out.sum().backward()
    return out


def test_shims_apply_once() -> None:
    moe_shims.apply_moe_shims()
    assert set(moe_shims.applied_moe_shims()) >= {
        "moe_dispatcher_streams",
        "moe_split_sizes",
        "moe_utils_factories",
        "moe_float64_softmax",
        "moe_uneven_tp_collectives",
    }
    assert moe_shims.apply_moe_shims() == []


@pytest.mark.parametrize(
    "module,attr",
    [
        (DISPATCHER, "torch"),
        (DISPATCHER, "maybe_move_tensor_to_cpu"),
        (DISPATCHER, "MoEAlltoAllTokenDispatcher"),
        (UTILS, "RouterGatingLinearFunction"),
        (UTILS, "topk_routing_with_score_function"),
        (UTILS, "compute_routing_scores_for_aux_loss"),
        (UTILS, "track_moe_metrics"),
        ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"),
        ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim"),
    ],
)
def test_patched_names_exist_in_pinned_megatron(module: str, attr: str) -> None:
    assert hasattr(importlib.import_module(module), attr), f"{module}.{attr} moved: update compat/moe.py"


def test_renamed_target_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = importlib.import_module(DISPATCHER)
    monkeypatch.delattr(mod, "maybe_move_tensor_to_cpu")
    with pytest.raises(CompatError, match="maybe_move_tensor_to_cpu"):
        moe_shims._shim_split_sizes()


def test_without_the_stream_shim_the_dispatcher_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    moe_shims.apply_moe_shims()
    mod = importlib.import_module(DISPATCHER)
    monkeypatch.setattr(mod, "torch", mod.torch._real)  # megatron's own view of torch
    monkeypatch.setattr(mod.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None)
    with pytest.raises(RuntimeError, match="CUDA"):
        tiny_moe()


def test_without_the_gemm_shim_the_router_raises_name_error(monkeypatch: pytest.MonkeyPatch) -> None:
    moe_shims.apply_moe_shims()
    mod = importlib.import_module(UTILS)
    model = tiny_moe()
    if moe_shims.needs_te_shim():
        monkeypatch.delattr(mod, "te_general_gemm")
        with pytest.raises(NameError, match="te_general_gemm"):
            forward_backward(model)


def test_without_the_split_size_shim_host_tensors_reach_the_all_to_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU the split sizes come back as numpy arrays (what gloo's all_to_all_single takes as a list); on CPU
    megatron would hand it the tensor itself, which gloo refuses under EP (tests/distributed/...)."""
    moe_shims.apply_moe_shims()
    mod = importlib.import_module(DISPATCHER)
    t = torch.tensor([3, 1])
    assert type(mod.maybe_move_tensor_to_cpu(t, as_numpy=True)).__name__ == "ndarray"
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    assert isinstance(maybe_move_tensor_to_cpu(t, as_numpy=True), torch.Tensor)  # megatron's own: a tensor


def test_without_the_factory_shim_metrics_tracking_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    moe_shims.apply_moe_shims()
    mod = importlib.import_module(UTILS)
    mod.clear_aux_losses_tracker()
    kw = dict(loss_scale=1.0, iteration=0, force_initialize=True, track_names=["shim_probe"], num_layers=2)
    mod.track_moe_metrics(**kw)  # the tracker buffer lands on the CPU
    mod.get_moe_layer_wise_logging_tracker().pop("shim_probe")
    view = mod.torch
    while isinstance(view, moe_shims._Float64SoftmaxView):
        view = view._real
    monkeypatch.setattr(mod, "torch", view._real)  # neither view
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda"):
        mod.track_moe_metrics(**{**kw, "track_names": ["shim_probe2"]})
    mod.get_moe_layer_wise_logging_tracker().pop("shim_probe2", None)


def test_without_the_softmax_shim_float64_routing_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    moe_shims.apply_moe_shims()
    mod = importlib.import_module(UTILS)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    probs, _ = mod.topk_routing_with_score_function(x, 2, use_pre_softmax=True)
    want = torch.softmax(x, dim=-1)
    assert (probs[probs > 0] - want[probs > 0]).abs().max() < 1e-15
    real = mod.torch
    view = real
    while not isinstance(view, moe_shims._Float64SoftmaxView):
        view = view._real
    monkeypatch.setattr(mod, "torch", view._real)
    probs32, _ = mod.topk_routing_with_score_function(x, 2, use_pre_softmax=True)
    assert (probs32[probs32 > 0] - want[probs32 > 0]).abs().max() > 1e-12  # rounded through float32


def test_uneven_gather_shim_matches_the_equal_split_exchange() -> None:
    """A world of one: the shimmed variable-size gather / reduce-scatter return the input (megatron's rule);
    the split arithmetic is exercised by the TP x EP distributed tests."""
    moe_shims.apply_moe_shims()
    from megatron.core.parallel_state import get_tensor_model_parallel_group
    from megatron.core.tensor_parallel import mappings

    x = torch.randn(5, 3)
    g = get_tensor_model_parallel_group()
    assert torch.equal(mappings._gather_along_first_dim(x, g, [5]), x)
    assert torch.equal(mappings._reduce_scatter_along_first_dim(x, g, [5]), x)
    assert getattr(mappings._gather_along_first_dim, "_megatron_branch_shim", False)
