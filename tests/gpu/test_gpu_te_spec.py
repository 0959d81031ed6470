"""The TransformerEngine layer spec, patched: names match the parameter map, HF weights load through it, and the
patched TE model gives the local-spec model's logprob gradients (skipped without CUDA or TransformerEngine).

Not run by this project so far (no GPU was lent). The CPU half is tests/unit/test_param_map_te.py.
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


@pytest.mark.gpu
def test_converted_checkpoint_loads_into_a_te_spec_model(tmp_path) -> None:  # noqa: ANN001
    """`convert hf-to-mcore` writes the keys of megatron's TE spec (docs/checkpoints.md): megatron's own
    dist_checkpointing loads the checkpoint into a real TE-spec GPTModel, strictly, and its logits are HF's."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_branch.checkpoint import convert_hf_to_mcore
    from megatron_branch.models import ModelArch
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.testing import tiny_hf_config, tiny_hf_model

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf_model(tiny_hf_config("qwen2", tie=False, ffn=48), seed=0).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mc", progress=False)
    arch = ModelArch.from_hf_config(hf.config)
    initialize_parallel(ParallelConfig(tp=1))
    theta = arch.rope_theta
    model = (
        GPTModel(
            config=arch.to_transformer_config(dtype=torch.float32),
            transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
            vocab_size=arch.padded_vocab_size(1),
            max_sequence_length=arch.max_position_embeddings,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(theta) if float(theta).is_integer() else theta,
        )
        .cuda()
        .eval()
    )
    state = dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "mc"))
    model.load_state_dict(state)  # strict: every TE parameter, fused norms included, came from the checkpoint
    ids = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].float()
        got = model(ids.cuda(), torch.arange(12)[None].cuda(), None)[0, :, : arch.vocab_size].float().cpu()
    assert (ref - got).abs().max() <= 1e-3
