"""Build a megatron-core GPTModel for every family of models/arch.py with the branch-aware core attention.

Full-attention layers are megatron's local GPT layer (q/k norms in their slots for Qwen3 and Qwen3.5, the output
gate and partial RoPE from the config); linear-attention layers of a hybrid are megatron's GatedDeltaNet
(models/gdn.py), the layer kind read per layer from `ModelArch.layer_types`.

Model code only: no process groups are created here. Tensor/sequence parallel sizes come from megatron's
`parallel_state`, initialised by the caller (megatron_branch.parallel.groups), as in any Megatron run.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.compat.cpu import apply_cpu_shims
from megatron_branch.compat.gdn import apply_gdn_shims
from megatron_branch.compat.norm import TorchNorm
from megatron_branch.models.arch import ModelArch
from megatron_branch.models.layer_checkpoint import BranchTransformerLayer
from megatron_branch.models.rotary import enable_position_rope


def branch_layer_spec(
    *, use_apex_or_te_norm: bool = False, qk_norm: bool = False, multi_latent: bool = False
) -> ModuleSpec:
    """megatron-core's local GPT layer spec with our core attention plugged into the attention slot (`qk_norm`:
    with norms in the q/k slots, megatron's qk_layernorm; `multi_latent`: megatron's MLASelfAttention, models/mla.py).

    This is also how a user patches an existing Megatron run: take their spec and set
    `spec.submodules.self_attention.submodules.core_attention = BranchCoreAttention` (see patches/), and, for
    per-layer activation checkpointing inside chunks (ScheduleOptions.recompute_layers), `spec.module =
    BranchTransformerLayer` (models/layer_checkpoint.py).
    """
    if multi_latent:
        from megatron_branch.models.mla import mla_layer_spec

        assert not use_apex_or_te_norm, "the MLA spec here has TorchNorm in every norm slot"

        spec = mla_layer_spec(TorchNorm)
    else:
        spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm))
    assert spec.module is TransformerLayer, spec.module
    # megatron's layer, checkpointed while an attached context asks (ScheduleOptions.recompute_layers)
    spec.module = BranchTransformerLayer
    spec.submodules.self_attention.submodules.core_attention = BranchCoreAttention
    if not use_apex_or_te_norm and not multi_latent:
        spec.submodules.input_layernorm = TorchNorm
        spec.submodules.pre_mlp_layernorm = TorchNorm
        if qk_norm:
            spec.submodules.self_attention.submodules.q_layernorm = TorchNorm
            spec.submodules.self_attention.submodules.k_layernorm = TorchNorm
    return spec


def layer_specs(arch: ModelArch) -> list[ModuleSpec]:
    """One spec per layer: its token mixer (full attention, or megatron's GatedDeltaNet in a hybrid's linear
    layers), then its MLP slot (the dense SwiGLU, or megatron's MoELayer in a MoE layer: models/moe.py)."""
    attention = branch_layer_spec(qk_norm=arch.qk_norm, multi_latent=arch.multi_latent)
    if arch.hybrid_override_pattern is not None:  # a Mamba hybrid: one block per layer (models/mamba.py)
        from megatron_branch.models.mamba import hybrid_layer_specs
        from megatron_branch.models.mamba_arch import layer_kind

        kinds = hybrid_layer_specs(arch, attention)
        return [kinds[layer_kind(arch, i)] for i in range(arch.num_layers)]  # type: ignore[index]
    mixers = {False: attention}
    if arch.is_hybrid:
        from megatron_branch.models.gdn import gdn_layer_spec

        mixers[True] = gdn_layer_spec(attention)
    specs = {(lin, False): spec for lin, spec in mixers.items()}
    if arch.is_moe:
        from megatron_branch.models.moe import moe_layer_spec

        specs.update({(lin, True): moe_layer_spec(spec) for lin, spec in mixers.items()})
    return [specs[arch.is_linear(i), arch.is_moe_layer(i)] for i in range(arch.num_layers)]


def stage_layer_specs(arch: ModelArch, pp: int, pp_rank: int) -> list[ModuleSpec]:
    """The specs of the layers pipeline stage `pp_rank` of `pp` builds: megatron builds every spec of a block spec
    it is given, so the stage's slice is cut here (as megatron's get_gpt_decoder_block_spec does); megatron
    numbers them from the stage's offset (transformer_layer.get_transformer_layer_offset)."""
    specs = layer_specs(arch)
    per = arch.num_layers // pp
    return specs[pp_rank * per : (pp_rank + 1) * per]


class BranchGPTModel(GPTModel):
    """GPTModel whose RoPE follows explicit position ids ([b, s] with identical rows).

    forward(input_ids [b, s], position_ids [b, s], attention_mask) -> logits [b, s, v/tp] (vocab-parallel).
    """

    is_critic = False
    """A value model (models/critic.py): the schedules read `values(hidden)` instead of logprobs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.position_embedding_type in ("rope", "yarn"):  # Nemotron-H's attention has none
            enable_position_rope(self)
        self._hidden_only = False

    @contextmanager
    def hidden_states_only(self) -> Iterator[None]:
        """Within this context forward returns the final hidden states [s(/tp under SP), b, h] instead of logits,
        so that the output projection can be fused with the logprob (losses/fused_logprobs.py)."""
        self._hidden_only = True
        try:
            yield
        finally:
            self._hidden_only = False

    def _postprocess(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._hidden_only:
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


def build_model(
    arch: ModelArch,
    *,
    dtype: torch.dtype = torch.float32,
    tp: int = 1,
    sequence_parallel: bool = False,
    vocab_divisible_by: int = 1,
    init_weights: bool = True,
    model_cls: type[BranchGPTModel] | None = None,
    pp: int = 1,
    pp_rank: int = 0,
    ep: int = 1,
    etp: int | None = None,
    **config_overrides: Any,
) -> BranchGPTModel:
    """A megatron-core GPT model for `arch` on this rank (tensor-parallel shards if tp > 1).

    `tp` must equal the tensor-parallel size megatron's parallel_state was initialised with.
    `init_weights=False` leaves the weights uninitialised (`torch.empty`) for a caller that overwrites every
    parameter (checkpoint loading); the parameters carry the same tensor-parallel attributes either way.
    `model_cls`: a BranchGPTModel subclass to build (the critic, models/critic.py).
    `pp`, `pp_rank`: this rank's pipeline stage (megatron's parallel_state must have been initialised with `pp`
    stages): layers [pp_rank * L / pp, (pp_rank + 1) * L / pp) with their global layer numbers, the embedding on
    stage 0, the final norm and the output layer on the last stage (a tied output weight: a copy of the
    embedding, kept equal by megatron's embedding-group reduction, parallel/grads.py). `pp=1` builds the whole
    model whatever parallel_state holds (the sampler's gathered copy, train/models.py).
    `ep`: the expert-parallel size megatron's parallel_state was initialised with (MoE models; 1 otherwise);
    `etp` its expert tensor-parallel size (None = tp; 1: every expert whole on each TP rank, models/expert_tp.py).
    """
    apply_cpu_shims()
    if pp > 1:
        from megatron_branch.compat.pipeline import apply_pipeline_shims

        apply_pipeline_shims()
        assert arch.num_layers % pp == 0 and 0 <= pp_rank < pp, (arch.num_layers, pp, pp_rank)  # rules/
        config_overrides = {"pipeline_model_parallel_size": pp, "pipeline_dtype": dtype, **config_overrides}
    if arch.is_hybrid:
        apply_gdn_shims()
    if arch.multi_latent:
        from megatron_branch.compat.mla import apply_mla_shims

        apply_mla_shims()
    if "M" in (arch.hybrid_override_pattern or ""):
        from megatron_branch.compat.mamba import apply_mamba_shims

        apply_mamba_shims()
    if arch.is_moe:
        from megatron_branch.compat.moe import apply_moe_shims

        apply_moe_shims()
        config_overrides = {"expert_model_parallel_size": ep, **config_overrides}
        if etp is not None:
            config_overrides = {"expert_tensor_parallel_size": etp, **config_overrides}
    if not init_weights:
        config_overrides = {**config_overrides, "perform_initialization": False}
    config = arch.to_transformer_config(
        dtype=dtype, tp=tp, sequence_parallel=sequence_parallel, **config_overrides
    )
    model = (model_cls or BranchGPTModel)(
        config=config,
        # A block spec so that the final norm is ours too (megatron's default refuses sequence parallel).
        transformer_layer_spec=TransformerBlockSubmodules(
            layer_specs=stage_layer_specs(arch, pp, pp_rank), layer_norm=TorchNorm
        ),
        vocab_size=arch.padded_vocab_size(tp, vocab_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="yarn" if arch.yarn_factor is not None else arch.position_embedding,
        rotary_percent=arch.rotary_percent,
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
    )
    if not init_weights:
        _set_tp_attributes_without_init(model)
    if arch.is_hybrid:
        from megatron_branch.models.gdn import mark_gdn_partition_dims

        mark_gdn_partition_dims(model)
    if arch.is_moe and tp > 1:
        from megatron_branch.models.expert_tp import mark_whole_experts

        mark_whole_experts(model)
    model.arch = arch  # type: ignore[attr-defined]
    return model


def _set_tp_attributes_without_init(model: torch.nn.Module) -> None:
    """Mark the sharded weights as megatron's init would have.

    With `use_cpu_initialization` megatron sets `tensor_model_parallel` / `partition_dim` / `partition_stride`
    on the weights of VocabParallelEmbedding, ColumnParallelLinear and RowParallelLinear only inside its random
    init (`_initialize_affine_weight_cpu`), so `perform_initialization=False` leaves them unmarked, and sharding
    code (our tp.py, megatron's resharding) would take them as replicated. Biases are marked either way. The
    values are those of 0.16.1's init path (SwiGLU's linear_fc1 uses stride 2, see megatron's mlp.py);
    tests/unit/test_models.py checks them against a model built with init.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    gated = getattr(model.config, "gated_linear_unit", False)
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            dim, stride = 0, 1
        elif isinstance(module, ColumnParallelLinear):
            dim, stride = 0, 2 if gated and name.endswith("linear_fc1") else 1
        elif isinstance(module, RowParallelLinear):
            dim, stride = 1, 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None:  # a tied output layer has none: it uses the embedding's
            set_tensor_model_parallel_attributes(weight, True, dim, stride)
