"""The linear-attention (gated delta net) layer of a hybrid model: megatron-core's GatedDeltaNet in a layer spec.

Shape legend (Megatron, sequence first): s tokens of this rank's sequence (s/tp under sequence parallel), b batch,
h hidden; inside the GDN (megatron's ssm/gated_delta_net.py) heads are split over TP:
    in_proj   [s, b, h] -> [s, b, (2 qk + 2 v + 2 nv) / tp]   rows per rank: [q_r, k_r, v_r, z_r, beta_r, alpha_r]
    conv1d    causal depthwise over [q_r, k_r, v_r] channels, kernel K, then silu
    rule      torch_chunk_gated_delta_rule (float32 inside) over nv/tp value heads, state [dk, dv] per head
    out_norm  w * rms-normalised output per value head, times silu(z)           (compat/norm.py GatedOutputNorm)
    out_proj  [s, b, v / tp] -> [s, b, h]   (RowParallelLinear: all-reduce, or reduce-scatter under SP)

megatron builds this variant only from TransformerEngine specs (experimental_attention_variant_module_specs.py:
`column_parallel_layer_norm_linear()` fuses the input norm into in_proj). The local equivalent used here: the
layer's own `input_layernorm` (TorchNorm, zero-centred for Qwen3.5) and in_proj as a plain ColumnParallelLinear;
`sharded_state_dict_keys_map` names that norm `self_attention.in_proj.layer_norm_weight` in dist checkpoints, as
the TE layer spec names it, so one checkpoint serves both specs (checkpoint/param_map.py).

Phase 2 of branch replay (a segment starting from its parent's recurrent state and conv inputs) will subclass
GatedDeltaNet in this slot; with no branch context attached it must stay megatron's forward.
"""

from __future__ import annotations

import copy

from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_branch.compat.norm import GatedOutputNorm

TE_KEYS_MAP = {
    "input_layernorm.": "self_attention.in_proj.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
"""Dist-checkpoint names of a GDN layer's norms under megatron's TE hybrid spec (fused into in_proj / fc1)."""


def gdn_layer_spec(attention_layer_spec: ModuleSpec) -> ModuleSpec:
    """`attention_layer_spec` (the model's full-attention layer: same norms, MLP and layer class) with megatron's
    GatedDeltaNet in the self_attention slot."""
    spec = copy.deepcopy(attention_layer_spec)
    spec.submodules.self_attention = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedOutputNorm, out_proj=RowParallelLinear
        ),
    )
    spec.submodules.sharded_state_dict_keys_map = dict(TE_KEYS_MAP)
    return spec


def mark_gdn_partition_dims(model: object) -> None:
    """megatron's GatedDeltaNet marks conv1d.weight, dt_bias and A_log `tensor_model_parallel` without a
    `partition_dim` (its sharded_state_dict knows they split along dim 0); sharding code (checkpoint/tp.py) reads
    the attribute, so it is set here, as megatron's linear layers set it."""
    for module in model.modules():  # type: ignore[attr-defined]
        if isinstance(module, GatedDeltaNet):
            for p in (module.conv1d.weight, module.dt_bias, module.A_log, module.conv1d.bias):
                if p is not None and getattr(p, "tensor_model_parallel", False):
                    p.partition_dim = 0
                    p.partition_stride = 1
