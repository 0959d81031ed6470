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

Branch replay (a segment starting from its parent's recurrent state and conv inputs) is `BranchGatedDeltaNet`, the
GatedDeltaNet of this slot: with no branch context attached it IS megatron's forward (the naive schedule's
reference); with one, the chunk's tree decides where each segment starts (models/gdn_tree.py).

Context parallelism (the context's `exchange`): in_proj runs on this rank's zigzag rows; the head exchange
(parallel/head_exchange.py) trades them for every row of the chunk of one block of the heads (models/gdn_heads.py:
its q/k/v channels, beta and alpha; the output gate z stays home), the conv and rule run over the whole tree for
that block exactly as on one rank (its slice of conv1d, A_log and dt_bias), and the exchange trades the core
output back for the gated norm and out_proj. Each rank hands down (and replay caches) the state of ITS heads.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.ssm import gated_delta_net as _mgdn
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_branch.attention.context import TakesBranchContext
from megatron_branch.attention.prefix_state import CACHED
from megatron_branch.compat.norm import GatedOutputNorm
from megatron_branch.models.gdn_heads import HeadBlocks
from megatron_branch.models.gdn_tree import (
    GDN_STATE,
    Conv,
    GDNDims,
    Rows,
    State,
    delta_rule_segments,
    hand_down_states,
    tree_depths,
)

TE_KEYS_MAP = {
    "input_layernorm.": "self_attention.in_proj.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
"""Dist-checkpoint names of a GDN layer's norms under megatron's TE hybrid spec (fused into in_proj / fc1)."""


class BranchGatedDeltaNet(GatedDeltaNet, TakesBranchContext):
    """megatron's GatedDeltaNet (same constructor, parameters and state dict), branch-aware when a context is
    attached: every segment of the chunk's tree runs from its parent's state at the fork (in the chunk, or handed
    down by replay's prefix cache) and hands its own state down when the context captures."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the head exchange's index tensors: constant per CP size and device, built once (`head_blocks`)
        self._head_blocks: dict[tuple[int, torch.device], HeadBlocks] = {}

    def head_blocks(self, cp: int, device: torch.device) -> HeadBlocks:
        """This layer's CP head blocks (models/gdn_heads.py), built on first use per (CP size, device)."""
        key = (cp, torch.device(device))
        if key not in self._head_blocks:
            self._head_blocks[key] = HeadBlocks.of(self._dims(), cp, key[1])
        return self._head_blocks[key]

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        if self.context is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        return self._tree_forward(hidden_states)

    def _dims(self) -> GDNDims:
        tp = self.tp_size
        return GDNDims(
            qk=self.qk_dim // tp,
            v=self.v_dim // tp,
            heads_k=self.num_key_heads // tp,
            heads_v=self.num_value_heads // tp,
            dk=self.key_head_dim,
            dv=self.value_head_dim,
            kernel=self.conv_kernel_dim,
        )

    def _tree_forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states [s(/tp under SP), 1, h] -> (out [s(/tp), 1, h], bias): megatron's forward (in_proj, conv,
        L2 norm, g and beta, delta rule, gated norm, out_proj), the conv and rule run per segment of the tree.
        Under context parallelism the conv and rule run over the whole chunk for a block of the heads: the head
        exchange moves their inputs there and the output back (models/gdn_heads.py, parallel/head_exchange.py)."""
        ctx = self.context
        assert ctx is not None
        if ctx.tree is None:
            raise AssertionError("a gated delta net layer needs the chunk's tree")
        dims = self._dims()
        qkvzba, _ = self.in_proj(hidden_states)  # [s, 1, (2qk + 2v + 2H)/tp]; sequence gathered under SP
        s, b, _ = qkvzba.shape
        assert b == 1, "a chunk is one packed sequence"
        x = qkvzba[:, 0]
        gate = x[:, 2 * dims.qk + dims.v : 2 * dims.qk + 2 * dims.v]  # [s, v]: the output gate stays home
        ex = ctx.exchange
        if ex is None:  # every row here: all of this TP rank's heads
            qkv, _, beta, alpha = torch.split(
                x, [2 * dims.qk + dims.v, dims.v, dims.heads_v, dims.heads_v], -1
            )
            conv = (self.conv1d.weight, self.conv1d.bias)
            core = self._tree_core(qkv, beta, alpha, dims, self.A_log, self.dt_bias, conv)  # [s, H, dv]
        else:  # CP: every row of the chunk, this rank's block of the heads, and back
            blocks = self.head_blocks(ex.size, x.device)
            sub, mine = blocks.dims, ex.rank
            qkv, beta, alpha = torch.split(
                ex.to_tree(x[:, blocks.index]), [2 * sub.qk + sub.v, sub.heads_v, sub.heads_v], -1
            )  # x[:, index] [s_loc, W, c] -> [s_tree, c]
            heads, channels = blocks.value_heads[mine], blocks.conv[mine]
            bias = self.conv1d.bias
            conv = (self.conv1d.weight[channels], None if bias is None else bias[channels])
            core = self._tree_core(qkv, beta, alpha, sub, self.A_log[heads], self.dt_bias[heads], conv)
            core = ex.to_ranks(core.reshape(core.shape[0], -1)).reshape(s, dims.heads_v, dims.dv)
        norm_out = self._apply_gated_norm(core, gate.reshape(s, -1, dims.dv))  # [s*H, dv]
        return self.out_proj(norm_out.reshape(s, 1, -1))

    def _tree_core(
        self,
        qkv: torch.Tensor,
        beta: torch.Tensor,
        alpha: torch.Tensor,
        dims: GDNDims,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        conv: Conv,
    ) -> torch.Tensor:
        """The conv and delta rule over the chunk's tree for the heads `dims` describes: qkv [s, cd] (pre-conv),
        beta / alpha [s, H] (pre-activation) -> core [s, H, dv]; hands each segment's state down when capturing."""
        ctx = self.context
        assert ctx is not None and ctx.tree is not None
        s = qkv.shape[0]
        g = -A_log.exp() * F.softplus(alpha.float() + dt_bias)  # [s, H] in fp32, as megatron
        beta = beta.sigmoid()  # [s, H]
        rule = (
            _mgdn.torch_chunk_gated_delta_rule
            if self.config.deterministic_mode
            else _mgdn.chunk_gated_delta_rule
        )
        core = qkv.new_zeros(s, dims.heads_v, dims.dv)  # rows in no segment (padding) stay 0
        states: dict[int, State] = {}
        cached = {}  # segment -> its rank among the segments whose parent is cached
        for i, seg in enumerate(ctx.tree.segments):
            if seg.parent == CACHED:
                cached[i] = len(cached)
        for depth in tree_depths(ctx.tree):
            segs = [ctx.tree.segments[i] for i in depth]
            rows = Rows.of([(seg.start, seg.end) for seg in segs], qkv.device)
            start = [
                self._start(seg.parent, cached.get(i, 0), states, qkv, dims) for i, seg in zip(depth, segs)
            ]
            out, (S, tail) = delta_rule_segments(
                qkv,
                g,
                beta,
                rows,
                (torch.cat([st[0] for st in start]), torch.cat([st[1] for st in start])),
                dims=dims,
                conv=conv,
                roots=all(seg.parent is None for seg in segs),
                act=self.act_fn,
                l2norm=_mgdn.l2norm if self.use_qk_l2norm else None,
                rule=rule,
            )  # [n, L, H, dv]
            core = core.index_put((rows.index[rows.valid],), out[rows.valid])
            for j, i in enumerate(depth):
                states[i] = (S[j : j + 1], tail[j : j + 1])
        if ctx.capture:
            hand_down_states(ctx, self.layer_number, GDN_STATE, states)
        return core

    def _start(
        self, parent: int | None, cached: int, states: dict[int, State], qkv: torch.Tensor, dims: GDNDims
    ) -> State:
        """(S [1, H, dk, dv] float32, tail [1, cd, K-1]) a segment starts from: zeros for a root, its parent's
        final state in this chunk, or the state its cached parent handed down: one row that every segment with a
        cached parent shares (replay: siblings), or one row per such segment (decode: row `cached`, the
        segment's rank among them)."""
        if parent is None:
            S = qkv.new_zeros(1, dims.heads_v, dims.dk, dims.dv, dtype=torch.float32)
            return S, qkv.new_zeros(1, 2 * dims.qk + dims.v, dims.kernel - 1)
        if parent == CACHED:
            assert self.context is not None
            ((S, tail),) = self.context.handed_down(self.layer_number)  # the DIRECT parent's state
            if S.shape[0] > 1:  # one row per segment with a cached parent, in chunk order (a decode step)
                S, tail = S[cached : cached + 1], tail[cached : cached + 1]
            return S, tail
        return states[parent]


def gdn_layer_spec(attention_layer_spec: ModuleSpec) -> ModuleSpec:
    """`attention_layer_spec` (the model's full-attention layer: same norms, MLP and layer class) with megatron's
    GatedDeltaNet in the self_attention slot."""
    spec = copy.deepcopy(attention_layer_spec)
    spec.submodules.self_attention = ModuleSpec(
        module=BranchGatedDeltaNet,
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
