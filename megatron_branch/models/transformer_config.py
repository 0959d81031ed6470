"""megatron-core's TransformerConfig for a ModelArch: the one place the architecture description (models/arch.py)
is mapped to megatron's config (ModelArch.to_transformer_config delegates here).

Kept apart from models/arch.py because it is a different concept (megatron's knobs, not the model's description)
and the only part that imports megatron-core.
"""

from __future__ import annotations

from typing import Any

import torch


def transformer_config_of(
    arch: Any,  # a models/arch.ModelArch (not imported: arch.py calls this, one direction)
    *,
    dtype: torch.dtype = torch.float32,
    tp: int = 1,
    sequence_parallel: bool = False,
    **overrides: Any,
) -> Any:
    """megatron-core TransformerConfig for this arch. Dropout is 0: branch replay recomputes nothing that
    draws random numbers, so exactness needs no RNG replay (see docs/design.md)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    arch.check_tensor_parallel(tp, etp=overrides.get("expert_tensor_parallel_size"))
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=False,
        qk_layernorm=arch.qk_norm,
        layernorm_zero_centered_gamma=arch.zero_centered_norm,
        attention_output_gate=arch.attention_output_gate,
    )
    if arch.sliding_window is not None:
        # megatron's (left, right) window: keys p - left .. p + right; HF's sliding_window W sees p - W + 1 .. p
        # (transformers' sliding_window_overlay: kv_idx > q_idx - W); the list marks megatron's 1-based layer
        # number - 1 (transformer/utils.py is_layer_window_attention)
        kwargs.update(
            window_size=(arch.sliding_window - 1, 0),
            window_attn_skip_freq=[int(arch.window_of(i) is not None) for i in range(arch.num_layers)],
        )
    if arch.attention_sinks:
        kwargs.update(softmax_type="learnable")
    if arch.linear_bias:
        kwargs.update(add_bias_linear=True)
    if arch.swiglu_limit is not None:
        from megatron.core.transformer.mlp import (
            quick_gelu,
        )  # the one megatron's MLP and experts compare against

        kwargs.update(
            activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=arch.swiglu_limit
        )
    if arch.is_hybrid:
        from megatron_branch.compat.gdn import gdn_uses_torch_path

        kwargs.update(
            experimental_attention_variant="gated_delta_net",
            # megatron's pattern: 1 = linear attention, 0 = full attention; a list makes the dist checkpoint
            # name every layer by its index (transformer_block.py: non-homogeneous layers)
            linear_attention_freq=[int(arch.is_linear(i)) for i in range(arch.num_layers)],
            linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
            linear_key_head_dim=arch.linear_key_head_dim,
            linear_value_head_dim=arch.linear_value_head_dim,
            linear_num_key_heads=arch.linear_num_key_heads,
            linear_num_value_heads=arch.linear_num_value_heads,
            # torch's conv1d and megatron's torch_chunk_gated_delta_rule where fla's kernels cannot run
            deterministic_mode=gdn_uses_torch_path(),
        )
    if arch.hybrid_override_pattern is not None:
        from megatron_branch.models.mamba_arch import mamba_config_kwargs

        kwargs.update(mamba_config_kwargs(arch))
    if arch.is_moe:
        from megatron_branch.models.moe import moe_config_kwargs

        kwargs.update(moe_config_kwargs(arch))
    if arch.multi_latent:
        from megatron_branch.models.mla import mla_config

        return mla_config(arch, {**kwargs, **overrides})
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    if arch.yarn_factor is not None:
        # the fields megatron's GPTModel (position_embedding_type "yarn") and attention's concentration factor read
        # off the config (MLATransformerConfig declares them; the plain config is given them here). mscale 1 over
        # mscale_all_dim 0: HF's attention_factor 0.1 ln(factor) + 1 when the config sets neither (gpt-oss)
        for name, value in yarn_fields(arch).items():
            setattr(config, name, value)
    return config


def yarn_fields(arch: Any) -> dict[str, Any]:
    """megatron's yarn_* config fields of a YaRN arch."""
    return dict(
        yarn_rotary_scaling_factor=arch.yarn_factor,
        yarn_original_max_position_embeddings=arch.yarn_original_max_position_embeddings,
        yarn_beta_fast=arch.yarn_beta_fast,
        yarn_beta_slow=arch.yarn_beta_slow,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=0.0,
        yarn_correction_range_round_to_int=arch.yarn_truncate,
    )
