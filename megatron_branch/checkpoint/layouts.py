"""The row layouts behind the parameter map: HF tensor shapes, the named transforms, and the fused sections that
tensor parallelism splits separately (param_map.py says which tensor uses which; tp.py shards by the sections).

Shape legend: h hidden, d head_dim, n query heads, g kv heads (query groups), p = n / g, f ffn, v vocabulary;
gated delta net: qk = key heads x key head dim, vd = value heads x value head dim, nv value heads, K conv kernel.

    transform            HF tensors                         megatron tensor (full, TP-independent)
    identity             t                                  t
    vocab_pad            [v, h]                             [padded v, h], zero rows appended
    fused_gate_up        gate [f, h], up [f, h]             [gate; up]
    qkv_interleave       q [n d, .], k [g d, .], v [g d, .] per group: [p q heads | k | v]
    qkv_gate_interleave  q [n 2d, h] = per head [query; gate], k, v
                                                            per group: [p q heads | p gate heads | k | v]
    gdn_in_proj          qkv [2qk + vd, h], z [vd, h], b [nv, h], a [nv, h]
                                                            [q; k; v; z; beta; alpha]
    gdn_in_proj_grouped  qkvz [2qk + 2vd, h] = per key head [q (dk); k (dk); v (r dv); z (r dv)],
                         ba [2nv, h] = per key head [b (r); a (r)], r = nv / nk value heads per key head (Qwen3-Next)
                                                            [q; k; v; z; beta; alpha]
    glu_interleaved_t    gate_up [h, 2e] (x @ W), columns gate, up interleaved (gpt-oss's experts)
                                                            [gate; up] [2e, h] (transposed, de-interleaved)
    glu_interleaved      gate_up_proj_bias [2e], interleaved alike       [gate; up]
    transpose            down_proj [e, h] (x @ W)           [h, e]
Each is a re-arrangement of rows: exact both ways, for weights and for gradients alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_branch.models.arch import ModelArch
from megatron_branch.models.families.param_rules import TRANSFORM_NAMES


# --- HF shapes --------------------------------------------------------------------------------------------------------
def hf_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The shape `arch` implies for the canonical HF tensor `name` (most specific suffix first)."""
    h, d, f, v = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.vocab_size
    assert d is not None
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    qk, vd, nv = arch.linear_qk_dim, arch.linear_v_dim, arch.linear_num_value_heads
    table: Sequence[tuple[str, tuple[int, ...]]] = (
        ("embed_tokens.weight", (v, h)),
        ("backbone.embeddings.weight", (v, h)),
        ("norm_f.weight", (h,)),
        ("lm_head.weight", (v, h)),
        ("linear_attn.in_proj_qkv.weight", (2 * qk + vd, h)),
        ("linear_attn.in_proj_z.weight", (vd, h)),
        ("linear_attn.in_proj_b.weight", (nv, h)),
        ("linear_attn.in_proj_a.weight", (nv, h)),
        ("linear_attn.in_proj_qkvz.weight", (2 * qk + 2 * vd, h)),
        ("linear_attn.in_proj_ba.weight", (2 * nv, h)),
        ("linear_attn.conv1d.weight", (2 * qk + vd, 1, arch.linear_conv_kernel_dim)),
        ("linear_attn.A_log", (nv,)),
        ("linear_attn.dt_bias", (nv,)),
        ("linear_attn.norm.weight", (arch.linear_value_head_dim,)),
        ("linear_attn.out_proj.weight", (h, vd)),
        ("q_norm.weight", (d,)),
        ("k_norm.weight", (d,)),
        ("layernorm.weight", (h,)),
        ("norm.weight", (h,)),
        ("q_proj.weight", (2 * q if arch.attention_output_gate else q, h)),
        ("k_proj.weight", (kv, h)),
        ("v_proj.weight", (kv, h)),
        ("q_proj.bias", (q,)),
        ("k_proj.bias", (kv,)),
        ("v_proj.bias", (kv,)),
        ("o_proj.weight", (h, q)),
        ("o_proj.bias", (h,)),
        ("self_attn.sinks", (arch.num_attention_heads,)),
        ("gate_proj.weight", (f, h)),
        ("up_proj.weight", (f, h)),
        ("down_proj.weight", (h, f)),
    )
    moe = None if ".self_attn." in name else (_moe_shape(name, arch) or _mamba_shape(name, arch))
    if moe is not None:
        return moe
    if arch.multi_latent and ".self_attn." in name:
        return _mla_shape(name, arch)
    shape = next((s for suffix, s in table if name.endswith(suffix)), None)
    assert shape is not None, f"no shape rule for {name}"
    return shape


def _moe_shape(name: str, arch: ModelArch) -> tuple[int, ...] | None:
    """Shapes of a MoE layer's HF tensors (router, routed expert j, shared expert and its gate), else None."""
    h, e = arch.hidden_size, arch.moe_ffn_hidden_size
    oss = {
        "gate_up_proj": (h, 2 * e),
        "gate_up_proj_bias": (2 * e,),
        "down_proj": (e, h),
        "down_proj_bias": (h,),
    }
    if ".experts." in name and name.rsplit(".", 1)[1] in oss:  # gpt-oss's per-expert rows (fused_experts.py)
        return oss[name.rsplit(".", 1)[1]]
    if name.endswith("mlp.router.weight"):  # gpt-oss's router (with a bias)
        return (arch.num_experts, h)
    if name.endswith("mlp.router.bias"):
        return (arch.num_experts,)
    if ".experts." in name:  # routed expert j: gate/up (Mixtral w1/w3) [e, h], down (w2) [h, e]
        return (h, e) if name.endswith(("down_proj.weight", ".w2.weight")) else (e, h)
    if ".shared_expert." in name or ".shared_experts." in name:
        sh = arch.shared_expert_ffn_hidden_size
        return (h, sh) if name.endswith("down_proj.weight") else (sh, h)
    if name.endswith("shared_expert_gate.weight"):
        return (1, h)
    if name.endswith("mlp.gate.e_score_correction_bias"):
        return (arch.num_experts,)
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
        return (arch.num_experts, h)
    return None


def _mla_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """Shapes of an MLA layer's HF tensors (DeepseekV3Attention; models/mla.py has the legend)."""
    h, n, d, r = arch.hidden_size, arch.num_attention_heads, arch.head_dim, arch.qk_rope_head_dim
    assert d is not None
    cq, ckv, dv = arch.q_lora_rank or 0, arch.kv_lora_rank, arch.v_head_dim
    table = {
        "q_proj.weight": (n * (d + r), h),
        "q_a_proj.weight": (cq, h),
        "q_a_layernorm.weight": (cq,),
        "q_b_proj.weight": (n * (d + r), cq),
        "kv_a_proj_with_mqa.weight": (ckv + r, h),
        "kv_a_layernorm.weight": (ckv,),
        "kv_b_proj.weight": (n * (d + dv), ckv),
        "o_proj.weight": (h, n * dv),
    }
    return table[name.rsplit(".self_attn.", 1)[1]]


def _mamba_shape(name: str, arch: ModelArch) -> tuple[int, ...] | None:
    """Shapes of a Nemotron-H Mamba mixer's HF tensors (models/mamba_arch.py widths), else None."""
    if ".mixer." not in name or arch.hybrid_override_pattern is None:
        return None
    from megatron_branch.models.mamba_arch import conv_sections, d_inner, in_proj_sections

    cd, di, nh = sum(conv_sections(arch)), d_inner(arch), arch.mamba_num_heads
    table = {
        "in_proj.weight": (sum(in_proj_sections(arch)), arch.hidden_size),
        "conv1d.weight": (cd, 1, arch.mamba_conv_kernel),
        "conv1d.bias": (cd,),
        "dt_bias": (nh,),
        "A_log": (nh,),
        "D": (nh,),
        "mixer.norm.weight": (di,),
        "out_proj.weight": (arch.hidden_size, di),
    }
    return next((shape for suffix, shape in table.items() if name.endswith(suffix)), None)


def mcore_rows(parts: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The megatron tensor's shape made from HF tensors of shapes `parts` (stacked along rows)."""
    return (sum(s[0] for s in parts), *parts[0][1:])


TRANSPOSED = ("glu_interleaved_t", "transpose")
"""Transforms whose megatron tensor is the HF tensor's transpose (mcore_rows of the transpose)."""


# --- transforms: (hf tensors) -> mcore tensor, and back ------------------------------------------------------------
def _qkv_to_mcore(ts: list[torch.Tensor], arch: ModelArch, padded_vocab: int) -> torch.Tensor:
    q, k, v = ts
    ng, hd = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    return torch.cat(
        [q.reshape(ng, per * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1
    ).reshape(-1, *rest)


def _qkv_to_hf(t: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    ng, hd = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = t.shape[1:]
    q, k, v = t.reshape(ng, (per + 2) * hd, *rest).split([per * hd, hd, hd], dim=1)
    return [q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()]


def _qkv_gate_to_mcore(ts: list[torch.Tensor], arch: ModelArch, padded_vocab: int) -> torch.Tensor:
    qg, k, v = ts
    ng, hd = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = qg.shape[1:]
    heads = qg.reshape(ng, per, 2, hd, *rest)  # HF: per head [query (d); gate (d)]
    q, gate = heads[:, :, 0].reshape(ng, per * hd, *rest), heads[:, :, 1].reshape(ng, per * hd, *rest)
    return torch.cat([q, gate, k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1).reshape(-1, *rest)


def _qkv_gate_to_hf(t: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    ng, hd = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = t.shape[1:]
    q, gate, k, v = t.reshape(ng, (2 * per + 2) * hd, *rest).split([per * hd, per * hd, hd, hd], dim=1)
    qg = torch.stack([q.reshape(ng, per, hd, *rest), gate.reshape(ng, per, hd, *rest)], dim=2)
    return [qg.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()]


def _vocab_pad(ts: list[torch.Tensor], arch: ModelArch, padded_vocab: int) -> torch.Tensor:
    (t,) = ts
    if padded_vocab == t.shape[0]:
        return t
    out = t.new_zeros(padded_vocab, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


def _gdn_in_proj_to_hf(t: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    qk, vd, nv = arch.linear_qk_dim, arch.linear_v_dim, arch.linear_num_value_heads
    return [c.clone() for c in t.split([2 * qk + vd, vd, nv, nv], dim=0)]


def _gdn_groups(arch: ModelArch) -> tuple[int, list[int], list[int]]:
    """Qwen3-Next's per-key-head row groups: (key heads, qkvz sections, ba sections) of one group."""
    nk, dk, dv = arch.linear_num_key_heads, arch.linear_key_head_dim, arch.linear_value_head_dim
    r = arch.linear_num_value_heads // nk
    return nk, [dk, dk, r * dv, r * dv], [r, r]


def _gdn_grouped_to_mcore(ts: list[torch.Tensor], arch: ModelArch, padded_vocab: int) -> torch.Tensor:
    qkvz, ba = ts
    nk, sec_qkvz, sec_ba = _gdn_groups(arch)
    rest = qkvz.shape[1:]
    parts = [
        *qkvz.reshape(nk, sum(sec_qkvz), *rest).split(sec_qkvz, dim=1),
        *ba.reshape(nk, sum(sec_ba), *rest).split(sec_ba, dim=1),
    ]  # q, k, v, z, b, a: each [nk, rows of one key head, ...]
    return torch.cat([p.reshape(-1, *rest) for p in parts])


def _gdn_grouped_to_hf(t: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    nk, sec_qkvz, sec_ba = _gdn_groups(arch)
    rest = t.shape[1:]
    parts = [p.reshape(nk, -1, *rest) for p in t.split([nk * n for n in (*sec_qkvz, *sec_ba)], dim=0)]
    qkvz, ba = torch.cat(parts[:4], dim=1), torch.cat(parts[4:], dim=1)
    return [qkvz.reshape(-1, *rest).clone(), ba.reshape(-1, *rest).clone()]


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows gate_0, up_0, gate_1, up_1, .. -> [gate; up] (megatron's fc1 halves; transformers' GptOssExperts
    `_apply_gate`: gate = gate_up[..., ::2], up = gate_up[..., 1::2])."""
    return torch.cat([t[0::2], t[1::2]])


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> rows gate_0, up_0, gate_1, up_1, .."""
    gate, up = t.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(t.shape)


TRANSFORMS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]]] = {
    "identity": (lambda ts, arch, pv: ts[0], lambda t, arch: [t]),
    "qkv_interleave": (_qkv_to_mcore, _qkv_to_hf),
    "qkv_bias_interleave": (_qkv_to_mcore, _qkv_to_hf),
    "qkv_gate_interleave": (_qkv_gate_to_mcore, _qkv_gate_to_hf),
    "fused_gate_up": (
        lambda ts, arch, pv: torch.cat(ts, dim=0),
        lambda t, arch: [c.clone() for c in t.chunk(2)],
    ),
    "gdn_in_proj": (lambda ts, arch, pv: torch.cat(ts, dim=0), _gdn_in_proj_to_hf),
    "gdn_in_proj_grouped": (_gdn_grouped_to_mcore, _gdn_grouped_to_hf),
    "vocab_pad": (_vocab_pad, lambda t, arch: [t[: arch.vocab_size]]),
    "glu_interleaved_t": (
        lambda ts, arch, pv: _deinterleave(ts[0].t()).contiguous(),
        lambda t, arch: [_interleave(t).t().contiguous()],
    ),
    "glu_interleaved": (lambda ts, arch, pv: _deinterleave(ts[0]), lambda t, arch: [_interleave(t)]),
    "transpose": (lambda ts, arch, pv: ts[0].t().contiguous(), lambda t, arch: [t.t().contiguous()]),
}
"""name -> (HF tensors -> megatron tensor, megatron tensor -> HF tensors)."""
assert tuple(TRANSFORMS) == TRANSFORM_NAMES, "the rules name the transforms this table implements"


# --- fused sections under tensor parallelism -----------------------------------------------------------------------
def tp_sections(name: str, config: Any) -> tuple[int, ...] | None:
    """Rows (dim 0) of the sections a full megatron tensor is made of when each TP rank holds its share of EVERY
    section, not one contiguous block: SwiGLU's fc1 [gate; up] (transformer/mlp.py), a GatedDeltaNet's in_proj
    [q; k; v; z; beta; alpha] and conv1d [q; k; v] channels (ssm/gated_delta_net.py). None: a contiguous split.
    `config` is the model's TransformerConfig (the widths megatron built the module with)."""
    if ".linear_fc1." in name and getattr(config, "gated_linear_unit", True):
        return (1, 1)  # two equal halves
    if getattr(config, "mamba_num_heads", None) and ".self_attention." in name:  # megatron's MambaMixer
        di, gn = (
            config.mamba_num_heads * config.mamba_head_dim,
            config.mamba_num_groups * config.mamba_state_dim,
        )
        if name.endswith("self_attention.in_proj.weight"):
            return (di, di, gn, gn, config.mamba_num_heads)
        if name.endswith(("self_attention.conv1d.weight", "self_attention.conv1d.bias")):
            return (di, gn, gn)
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return None
    qk = config.linear_key_head_dim * config.linear_num_key_heads
    vd = config.linear_value_head_dim * config.linear_num_value_heads
    nv = config.linear_num_value_heads
    if name.endswith("self_attention.in_proj.weight"):
        return (qk, qk, vd, vd, nv, nv)
    if name.endswith(("self_attention.conv1d.weight", "self_attention.conv1d.bias")):
        return (qk, qk, vd)
    return None
