"""The CPU stand-ins of verl's MegatronEngine on a host (integration/verl_cpu.py uses them): the attention kernel
in the slot TransformerEngine's occupies, the layer specs that put it there, and verl's value head.

`CpuVarlenAttention`: verl packs every micro-batch to THD (`preprocess_thd_engine`) and hands megatron
`packed_seq_params`, which on a GPU TransformerEngine's attention consumes; megatron's local `DotProductAttention`
refuses them. This is causal attention inside each packed sequence of `cu_seqlens_q_padded`; under context
parallelism (verl's zigzag THD split) it gathers every CP rank's K/V (what TE's all-gather CP does) and attends by
the rows' global positions. `CpuValueHead`: the bridge's one-output head (the fallback `LinearForLastLayer` of
verl/models/mcore/bridge.py, which needs Megatron-Bridge to import), drawn from a fixed seed.

Nothing here is used on a GPU.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_branch.attention.core_attention import CoreAttentionSlot

# --- the attention kernel (verl_cpu.py's item 2) --------------------------------------------------------------


class CpuVarlenAttention(CoreAttentionSlot):
    """Causal attention inside each packed sequence (THD), the CPU stand-in for TEDotProductAttention.

    q [t, 1, n, h], k/v [t, 1, g, h] -> [t, 1, n*h]; sequence i owns rows cu_seqlens_q_padded[i:i+2] (verl pads
    each sequence to the TP alignment; a pad row sees its sequence, and nothing reads it). Without
    `packed_seq_params` (one sequence, BSHD with b = 1) it is plain causal attention.

    Under CP (C ranks, the CP group of megatron's `pg_collection`) the rows are verl's zigzag split
    (verl/models/mcore/util.py preprocess_thd_engine): sequence i of padded length L holds, on rank r, local rows
    [cu[i] / C, cu[i+1] / C) = global positions [r*h, (r+1)*h) then [L-(r+1)*h, L-r*h), h = L / 2C. K/V of
    every rank are all-gathered (autograd: the backward sums the gradients back to their owner) and each query
    attends to the keys at global positions <= its own.
    """

    def __init__(self, *args: Any, pg_collection: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, pg_collection=pg_collection, **kwargs)
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if cp is not None and torch.distributed.get_world_size(cp) > 1 else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        thd = query.dim() == 3  # megatron drops the batch dim for THD input: [t, n, h]
        if thd:
            query, key, value = query[:, None], key[:, None], value[:, None]
        assert attention_bias is None and query.shape[1] == 1, (
            f"THD / batch-1 input expected, got {query.shape}"
        )
        t, _, n, h = query.shape
        rep = n // key.shape[2]
        q = query[:, 0].transpose(0, 1)  # [n, t, h]
        k = key[:, 0].repeat_interleave(rep, dim=1).transpose(0, 1)
        v = value[:, 0].repeat_interleave(rep, dim=1).transpose(0, 1)
        if packed_seq_params is None:
            bounds = [0, t]
        else:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            bounds = [int(x) for x in cu.tolist()]
        if self.cp_group is not None:
            assert packed_seq_params is not None, "CP on the CPU harness: verl's THD input only"
            out = self._zigzag(q, k, v, bounds)
        else:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            for a, b in zip(bounds[:-1], bounds[1:]):
                if b > a:
                    out[:, a:b] = torch.nn.functional.scaled_dot_product_attention(
                        q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=self.softmax_scale
                    )
        out = out.transpose(0, 1).reshape(t, 1, n * v.shape[-1])  # MLA: the value width differs from h
        return out[:, 0] if thd else out

    def _zigzag(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """q/k/v [n, t_loc, h] of this CP rank; `bounds` the GLOBAL padded cu_seqlens -> out [n, t_loc, h]."""
        group = self.cp_group
        C, r = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        ks, vs = _GatherOverCp.apply(k, group), _GatherOverCp.apply(v, group)
        out = torch.empty_like(q)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            L, lo = b - a, a // C
            half = L // (2 * C)
            pos = [torch.cat([torch.arange(j * half, (j + 1) * half), torch.arange(L - (j + 1) * half, L - j * half)])
                   for j in range(C)]  # fmt: skip
            kpos = torch.cat(pos)  # global position of every gathered key row of this sequence
            kf = torch.cat([ks[j][:, lo : lo + 2 * half] for j in range(C)], dim=1)
            vf = torch.cat([vs[j][:, lo : lo + 2 * half] for j in range(C)], dim=1)
            visible = kpos[None, :] <= pos[r][:, None]  # [2h, L]: causal by global position
            out[:, lo : lo + 2 * half] = torch.nn.functional.scaled_dot_product_attention(
                q[:, lo : lo + 2 * half], kf, vf, attn_mask=visible.to(q.device), scale=self.softmax_scale
            )
        return out


class _GatherOverCp(torch.autograd.Function):
    """x [..] of every rank of `group` -> [C, ..]; the backward sums each rank's gradient back to its owner. (torch's
    `distributed.nn.all_gather` backward on gloo scatters with group ranks as global ranks: wrong on a subgroup.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[torch.distributed.get_rank(ctx.group)], None


# --- the layer specs and the value head -----------------------------------------------------------------------


def cpu_layer_spec(*, qk_norm: bool = False, multi_latent: bool = False) -> Any:
    """megatron-core's local GPT layer spec with torch RMSNorm and the THD-capable CPU attention (`qk_norm`: norms
    in the q/k slots, megatron's qk_layernorm, as Qwen3's; `multi_latent`: megatron's MLASelfAttention, the spec
    of models/mla.py)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_branch.compat.norm import TorchNorm

    if multi_latent:
        from megatron_branch.models.mla import mla_layer_spec

        spec = mla_layer_spec(TorchNorm)
        spec.submodules.self_attention.submodules.core_attention = CpuVarlenAttention
        return spec
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm))
    spec.submodules.self_attention.submodules.core_attention = CpuVarlenAttention
    spec.submodules.input_layernorm = TorchNorm
    spec.submodules.pre_mlp_layernorm = TorchNorm
    if qk_norm:
        spec.submodules.self_attention.submodules.q_layernorm = TorchNorm
        spec.submodules.self_attention.submodules.k_layernorm = TorchNorm
    return spec


def cpu_layer_specs(arch: Any) -> list[Any]:
    """One spec per layer; a MoE layer has megatron's MoELayer (all-to-all dispatcher, SequentialMLP experts) with
    megatron's own TopKRouter, as verl's bridge builds it (the switch swaps in BranchRouter: verl_moe.py); a
    hybrid's linear-attention layer has megatron's own GatedDeltaNet, as the bridge builds it for Qwen3.5 / Qwen3.6
    / Qwen3-Next (the switch makes it BranchGatedDeltaNet: verl_model.py), its input norm the layer's own norm and
    in_proj a plain ColumnParallelLinear (TE fuses them on a GPU; models/gdn.py says why here)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_branch.models.moe import moe_layer_spec

    dense = cpu_layer_spec(qk_norm=arch.qk_norm, multi_latent=arch.multi_latent)
    mixers = {False: dense}
    if arch.is_hybrid:
        from megatron_branch.models.gdn import gdn_layer_spec

        mixers[True] = gdn_layer_spec(dense)
        mixers[True].submodules.self_attention.module = GatedDeltaNet  # megatron's class, unpatched
    specs = {(lin, False): spec for lin, spec in mixers.items()}
    if arch.is_moe:
        for lin, spec in mixers.items():
            moe = moe_layer_spec(spec)
            moe.submodules.mlp.submodules.router = TopKRouter
            specs[lin, True] = moe
    return [specs[arch.is_linear(i), arch.is_moe_layer(i)] for i in range(arch.num_layers)]


class CpuValueHead(torch.nn.Linear):
    """verl's value head (verl/models/mcore/bridge.py `LinearForLastLayer`, Megatron-Bridge's): hidden -> 1 value,
    no bias, replicated over TP, float32 out, the sequence gathered under SP; megatron's output-layer call form."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, seed: int = 0) -> None:
        super().__init__(hidden_size, 1, bias=False)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            self.weight.copy_(torch.randn(self.weight.shape, generator=g) * 0.02)

    def forward(self, input_: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> Any:
        from megatron.core import tensor_parallel

        logits = super().forward(input_).float()
        if self.sequence_parallel:
            logits = tensor_parallel.gather_from_sequence_parallel_region(
                logits, tensor_parallel_output_grad=False
            )
        return logits, None
