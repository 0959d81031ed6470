"""Every CPU shim: applied without CUDA, idempotent, and loud when megatron-core renames what it patches."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_branch.compat import cpu


def test_shims_apply_and_are_idempotent() -> None:
    cpu.apply_cpu_shims()
    assert set(cpu.applied_shims()) == set(cpu._SHIMS)
    assert cpu.apply_cpu_shims() == []  # second call: nothing to do


@pytest.mark.parametrize(
    "module,attr",
    [
        ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
        ("megatron.core.tensor_parallel.random", "initialize_rng_tracker"),
        ("megatron.core.transformer.utils", "get_default_causal_mask"),
        ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
        ("megatron.core.transformer.utils", "get_sliding_window_causal_mask"),
        ("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask"),
        ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
        ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
        ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
        ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
        ("megatron.core.utils", "GlobalMemoryBuffer"),
    ],
)
def test_patched_names_exist_in_pinned_megatron(module: str, attr: str) -> None:
    assert hasattr(importlib.import_module(module), attr), f"{module}.{attr} moved: update compat/cpu.py"


def test_renamed_target_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = importlib.import_module("megatron.core.transformer.utils")
    monkeypatch.delattr(mod, "get_default_causal_mask")
    with pytest.raises(cpu.CompatError, match="get_default_causal_mask"):
        cpu._shim_default_mask()


def test_current_device_is_cpu_and_buffers_allocate() -> None:
    cpu.apply_cpu_shims()
    from megatron.core.utils import GlobalMemoryBuffer

    buf = GlobalMemoryBuffer().get_tensor((3, 4), torch.float32, "x")
    assert buf.device.type == "cpu" and buf.shape == (3, 4)


def test_rng_tracker_forks_cpu_state_and_restores() -> None:
    tracker = cpu.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("model-parallel-rng"):
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # default stream untouched
    gen = torch.Generator().manual_seed(123)
    assert torch.equal(a, torch.rand(3, generator=gen))  # the forked stream is the seeded one
    with tracker.fork("model-parallel-rng"):
        b = torch.rand(3)
    assert torch.equal(b, torch.rand(3, generator=gen))  # and it advances across forks
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 123)


def test_megatron_default_causal_mask_on_cpu() -> None:
    cpu.apply_cpu_shims()
    from megatron.core.transformer import utils

    m = utils.get_default_causal_mask(4)
    assert m.device.type == "cpu" and m.dtype == torch.bool and m[0, 1] and not m[1, 0]


def test_megatron_window_mask_on_cpu() -> None:
    """megatron's (left 2, right 0) window on CPU: row 3 sees keys 1..3 only (True = masked)."""
    cpu.apply_cpu_shims()
    from megatron.core.fusions import fused_softmax

    m = fused_softmax.get_sliding_window_causal_mask(5, 5, (2, 0))
    assert m.device.type == "cpu" and m[3].tolist() == [True, False, False, False, True]


def test_rope_cp_slice_matches_zigzag() -> None:
    cpu.apply_cpu_shims()
    from megatron.core.models.common.embeddings import rope_utils

    class G:
        def __init__(self, r: int) -> None:
            self.r = r

        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return self.r

    emb = torch.arange(8.0)[:, None, None, None]
    assert rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, G(0)).flatten().tolist() == [0, 1, 6, 7]
    assert rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, G(1)).flatten().tolist() == [2, 3, 4, 5]


def test_schedule_factories_map_cuda_to_cpu() -> None:
    cpu.apply_cpu_shims()
    from megatron.core.pipeline_parallel import schedules

    t = schedules.torch.zeros([], dtype=torch.int, device="cuda")
    assert t.device.type == "cpu"
    assert schedules.torch.float32 is torch.float32


def test_norm_builder_marks_sequence_parallel() -> None:
    from megatron_branch.compat.norm import TorchNorm
    from megatron_branch.models import ModelArch

    arch = ModelArch(
        family="llama",
        vocab_size=16,
        hidden_size=8,
        num_layers=1,
        num_attention_heads=2,
        num_query_groups=2,
        ffn_hidden_size=16,
    )
    cfg = arch.to_transformer_config(tp=2, sequence_parallel=True)
    norm = TorchNorm(config=cfg, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True


@pytest.mark.parametrize(
    "module,attr",
    [
        # megatron names that checkpoint/dist_ckpt.py builds on (its synchronous writer and the every-rank check)
        ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistSaveShardedStrategy"),
        ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlanner"),
        ("megatron.core.dist_checkpointing.strategies.torch", "_replace_state_dict_keys_with_sharded_keys"),
        ("megatron.core.dist_checkpointing.strategies.torch", "mcore_to_pyt_state_dict"),
        ("megatron.core.dist_checkpointing.state_dict_utils", "load_preprocess"),
        ("megatron.core.dist_checkpointing.utils", "extract_sharded_base"),
        ("megatron.core.dist_checkpointing.validation", "determine_global_metadata"),
        ("megatron.core.dist_checkpointing.validation", "validate_sharding_integrity"),
        ("megatron.core.tensor_parallel.layers", "set_tensor_model_parallel_attributes"),
    ],
)
def test_checkpoint_names_exist_in_pinned_megatron(module: str, attr: str) -> None:
    from megatron_branch.checkpoint import dist_ckpt

    assert dist_ckpt._megatron(module, attr)[0] is getattr(importlib.import_module(module), attr)


def test_checkpoint_renamed_target_fails_loudly() -> None:
    from megatron_branch.checkpoint import dist_ckpt

    with pytest.raises(cpu.CompatError, match="no_such_name"):
        dist_ckpt._megatron("megatron.core.dist_checkpointing.validation", "no_such_name")


# ---- pipeline parallelism (compat/pipeline.py) ------------------------------------------------------------------
@pytest.mark.parametrize(
    "module,attr",
    [
        ("megatron.core.models.common.language_module.language_module", "LanguageModule"),
        ("megatron.core.pipeline_parallel.p2p_communication", "P2PCommunicator"),
        ("megatron.core.pipeline_parallel.p2p_communication", "torch"),
    ],
)
def test_pipeline_names_exist_in_pinned_megatron(module: str, attr: str) -> None:
    assert hasattr(importlib.import_module(module), attr), f"{module}.{attr} moved: update compat/pipeline.py"


def test_pipeline_shims_apply_once_and_are_needed_without_cuda() -> None:
    """The two CUDA calls the shims remove really fail on this machine, and the shimmed paths do not."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import p2p_communication

    from megatron_branch.compat import pipeline

    pipeline.apply_pipeline_shims()
    assert pipeline.apply_pipeline_shims() == []  # idempotent
    assert getattr(LanguageModule.setup_embeddings_and_output_layer, "_megatron_branch_cpu", False)
    if torch.cuda.is_available():
        return
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(2).cuda()  # what the tied embedding's set-up calls
    with pipeline._tensor_cuda_is_identity():
        t = torch.zeros(2)
        assert t.cuda() is t
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.synchronize()  # what batched p2p calls after every exchange
    p2p_communication.torch.cuda.synchronize()  # the p2p module's view: a no-op
    assert p2p_communication.torch.distributed is torch.distributed  # everything else is torch's own
