"""The layers of a Mamba-2 hybrid (Nemotron-H): megatron-core's MambaMixer in a GPT layer, and the one-block layers
its hybrid_override_pattern is made of.

Shape legend (Megatron, sequence first): s tokens of this rank's sequence (s/tp under sequence parallel), b batch,
h hidden; inside the mixer (megatron's ssm/mamba_mixer.py) heads H and groups G are split over TP:
    in_proj   [s, b, h] -> [s, b, (2 d_inner + 2 G N + H) / tp]   rows per rank: [z_r, x_r, B_r, C_r, dt_r]
    conv1d    causal depthwise over [x_r, B_r, C_r] channels (cd), kernel K, then silu
    scan      the SSD chunk scan over H/tp heads of P channels, state [P, N] per head (float32 inside)
    norm      grouped RMS norm of y * silu(z) per group of d_inner / G channels, times w  (HF's NemotronHRMSNormGated)
    out_proj  [s, b, d_inner / tp] -> [s, b, h]   (RowParallelLinear: all-reduce, or reduce-scatter under SP)
A Nemotron-H layer is its norm and ONE block: megatron's TransformerLayer with the other slots IdentityOp (as
megatron's own MambaStack builds its attention and MLP layers: models/mamba/mamba_layer_specs.py), so every layer
runs through the same layer class, checkpointing and branch context as a GPT layer.

The mixer's forward is ours in every schedule (`BranchMambaMixer`): megatron's needs mamba_ssm's kernels for the
scan and norm and, without them, has no path; ours is the same math with the SSD scan and causal conv of
transformers' torch implementation (modeling_nemotron_h: `mamba2_chunk_scan`, the mixer's reference), and HF's
lower clamp of dt (time_step_min), which megatron's kernel call does not apply. With no branch context every batch
row is one root segment (the naive schedule's reference); with one, every segment of the chunk's tree starts from
its parent's SSM state and conv tail (`MAMBA_STATE`).

Context parallelism (the context's `exchange`): in_proj runs on this rank's zigzag rows; the head exchange
(parallel/head_exchange.py) trades [x | B | C | dt] of them for every row of the chunk of one block of the heads
(models/mamba_heads.py: megatron's MambaContextParallel split of heads, groups B / C, conv channels, D, dt_bias,
A_log), the conv and scan run over the whole tree for that block exactly as on one rank, and the exchange trades the
scan's output back; the gate z stays home for the grouped gated norm and out_proj, which act per position. Each rank
hands down (and replay caches) the SSM state and conv tail of ITS block.

Precision: HF's scan computes in float32 whatever the model dtype, and its chunks start at each segment's first
token: a tree schedule equals naive (and HF) to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_branch.attention.context import TakesBranchContext
from megatron_branch.attention.prefix_state import CACHED, StateKind
from megatron_branch.compat.mamba import importable_mamba_mixer
from megatron_branch.models.gdn_tree import Conv, Rows, conv_with_tail, hand_down_states, tree_depths
from megatron_branch.models.mamba_heads import MambaBlocks, MambaDims

importable_mamba_mixer()  # compat/mamba.py shim 0: megatron's module imports triton at the top
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules  # noqa: E402

MAMBA_STATE = StateKind(name="mamba-state", reads="parent", per_row=False)
"""A Mamba layer's state at the fork (SSM state [1, H, P, N] float32, conv tail [1, cd, K-1]): read by the DIRECT
children only, handed down whole (as the gated delta net's)."""

State = tuple[torch.Tensor, torch.Tensor]


def own_state(state: State) -> State:
    """A segment's (SSM state, conv tail) as its own storage, to hand down: transformers' mamba2_chunk_scan returns
    the final state as `new_states[:, -1]`, a view of the scan's c + 1 chunk states, which the prefix cache would
    otherwise keep alive whole. `.clone()` keeps the autograd edge (the cache's leaf injects its gradient through it).
    The tail is already the last K - 1 inputs' own tensor (models/gdn_tree.py conv_with_tail)."""
    return state[0].clone(), state[1]


@dataclass(frozen=True)
class MixerParams:
    """The per-head parameters the conv and scan read: the TP rank's, or a CP block's slices of them (sliced in the
    forward, as megatron's MambaContextParallel does, so their gradients reach the whole parameters)."""

    conv: Conv  # conv1d (weight [cd, 1, K], bias [cd] or None)
    dt_bias: torch.Tensor  # [H]
    A_log: torch.Tensor  # [H]
    D: torch.Tensor  # [H]


def _hf_mixer_parts() -> tuple[Any, Any]:
    """transformers' torch SSD chunk scan and gated norm (modeling_nemotron_h): the reference's own code."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    return hf.mamba2_chunk_scan, hf.NemotronHRMSNormGated


class BranchMambaMixer(MambaMixer, TakesBranchContext):
    """megatron's MambaMixer (its parameters, TP split and sharded state dict) in a GPT layer's self_attention slot,
    with the forward described in the module docstring."""

    def __init__(
        self,
        config: Any,
        submodules: MambaMixerSubmodules,
        layer_number: int | None = None,
        pg_collection: Any = None,
        *,
        d_conv: int,
        conv_bias: bool,
        chunk_size: int,
        dt_min: float,
        **_: Any,
    ) -> None:
        super().__init__(
            config,
            submodules,
            d_model=config.hidden_size,
            d_conv=d_conv,
            conv_bias=conv_bias,
            chunk_size=chunk_size,
            layer_number=layer_number,
            pg_collection=pg_collection,
        )
        self.dt_min = dt_min
        _, gated_norm = _hf_mixer_parts()
        # HF's grouped gated norm (eps = the model's; megatron's mamba_ssm norm fixes 1e-5), this rank's groups
        self.norm = gated_norm(
            self.d_inner_local_tp,
            group_size=self.d_inner_local_tp // self.ngroups_local_tp,
            eps=config.layernorm_epsilon,
        ).to(config.params_dtype)
        if (
            config.params_dtype == torch.float64
        ):  # megatron keeps A_log and D in float32: never narrower than HF
            self.A_log = torch.nn.Parameter(self.A_log.detach().double())
            self.D = torch.nn.Parameter(self.D.detach().double())
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            if p is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        # the head exchange's index tensors: constant per CP size and device, built once (`head_blocks`)
        self._head_blocks: dict[tuple[int, torch.device], MambaBlocks] = {}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> Any:
        """megatron's, with the gated norm's weight split over TP along its channels (as megatron's
        ExtendedRMSNorm.sharded_state_dict does; HF's norm module has no sharded_state_dict of its own)."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(
            make_sharded_tensors_for_checkpoint(
                {"weight": self.norm.weight},
                f"{prefix}norm.",
                {"weight": 0},
                sharded_offsets,
                tp_group=self.tp_group,
                dp_cp_group=metadata["dp_cp_group"],
            )
        )
        return out

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        """hidden_states [s(/tp under SP), b, h] -> (out [s(/tp), b, h], None)."""
        zxBCdt, _ = self.in_proj(hidden_states)  # [s, b, proj/tp]; sequence gathered under SP
        s, b, _ = zxBCdt.shape
        dims, params = self._dims(), self._params()
        z, xBCdt = torch.split(zxBCdt, [dims.d_inner, dims.conv_channels + dims.heads], dim=-1)
        if self.context is None:  # every batch row one root segment
            xBC, dt = torch.split(xBCdt.transpose(0, 1), [dims.conv_channels, dims.heads], dim=-1)
            rows = Rows.of([(0, s)] * b, xBC.device)
            y, _ = self._segments(xBC, dt, rows, None, dims, params, roots=True)
            y = y.transpose(0, 1)  # [s, b, d_inner/tp]
        else:
            assert b == 1, "a chunk is one packed sequence"
            y = self._tree_or_blocks(xBCdt[:, 0], dims, params)[:, None]
        y = self.norm(y, z)  # HF's order: norm(scan * silu(z)), its dtypes
        return self.out_proj(y.to(hidden_states.dtype))

    def _dims(self) -> MambaDims:
        return MambaDims(
            heads=self.nheads_local_tp,
            groups=self.ngroups_local_tp,
            head_dim=self.headdim,
            state=self.d_state,
            kernel=self.d_conv,
        )

    def _params(self) -> MixerParams:
        return MixerParams(
            conv=(self.conv1d.weight, self.conv1d.bias), dt_bias=self.dt_bias, A_log=self.A_log, D=self.D
        )

    def head_blocks(self, cp: int, device: torch.device) -> MambaBlocks:
        """This layer's CP head blocks (models/mamba_heads.py), built on first use per (CP size, device)."""
        key = (cp, torch.device(device))
        if key not in self._head_blocks:
            self._head_blocks[key] = MambaBlocks.of(self._dims(), cp, key[1])
        return self._head_blocks[key]

    def _tree_or_blocks(self, xBCdt: torch.Tensor, dims: MambaDims, params: MixerParams) -> torch.Tensor:
        """xBCdt [s, cd + H] of the chunk's rows on this rank -> scan output y [s, d_inner/tp] float32. Without an
        exchange every row is here: the tree of all this TP rank's heads. Under CP the exchange brings every row
        of the chunk for this rank's block of the heads, the tree runs over them, and the output goes back."""
        ex = self.context.exchange if self.context is not None else None
        if ex is None:
            xBC, dt = torch.split(xBCdt, [dims.conv_channels, dims.heads], dim=-1)
            return self._tree(xBC, dt, dims, params)
        blocks = self.head_blocks(ex.size, xBCdt.device)
        sub, heads, channels = blocks.dims, blocks.heads[ex.rank], blocks.conv[ex.rank]
        xBC, dt = torch.split(
            ex.to_tree(xBCdt[:, blocks.index]), [sub.conv_channels, sub.heads], dim=-1
        )  # xBCdt[:, index] [s_loc, W, c] -> [s_tree, c]
        weight, bias = params.conv
        mine = MixerParams(
            conv=(weight[channels], None if bias is None else bias[channels]),
            dt_bias=params.dt_bias[heads],
            A_log=params.A_log[heads],
            D=params.D[heads],
        )
        y = self._tree(xBC, dt, sub, mine)  # [s_tree, d_inner / W]
        return ex.to_ranks(y).reshape(xBCdt.shape[0], dims.d_inner)  # blocks in head order: [s_loc, d_inner]

    def _segments(
        self,
        xBC: torch.Tensor,
        dt: torch.Tensor,
        rows: Rows,
        start: State | None,
        dims: MambaDims,
        params: MixerParams,
        *,
        roots: bool,
    ) -> tuple[torch.Tensor, State]:
        """n segments, each from its start state (None: zeros; `roots`: every row is a root): xBC [n, L, cd] and dt [n, L, H]
        (pre-conv, pre-softplus; rows past a segment's length are padding) -> (y [n, L, d_inner] float32,
        final (SSM state [n, H, P, N] float32, conv tail [n, cd, K-1])), over the heads `dims` describes."""
        n, L, cd = xBC.shape
        H, P, G, N = dims.heads, dims.head_dim, dims.groups, dims.state
        if start is None:
            start = (xBC.new_zeros(n, H, P, N, dtype=torch.float32), xBC.new_zeros(n, cd, dims.kernel - 1))
        pre, tail = conv_with_tail(xBC.transpose(1, 2), start[1], rows.lengths, params.conv, roots=roots)
        x, B, C = torch.split(self.act(pre).transpose(1, 2), [dims.d_inner, G * N, G * N], dim=-1)
        # HF's mixer: dt + dt_bias, softplus, clamped below at time_step_min; 0 on padding, where the scan's step is
        # then exactly the identity (decay exp(0) = 1, input x dt = 0), so the final state is the last real token's
        dt = F.softplus(dt + params.dt_bias.to(dt.dtype)).clamp(min=self.dt_min)
        dt = torch.where(rows.valid[..., None], dt, torch.zeros((), dtype=dt.dtype, device=dt.device))
        scan, _ = _hf_mixer_parts()
        y, S = scan(
            x.reshape(n, L, H, P),
            dt,
            -torch.exp(params.A_log.float()),
            B.reshape(n, L, G, N),
            C.reshape(n, L, G, N),
            self.chunk_size,
            D=params.D,
            initial_states=start[0],
            return_final_states=True,
        )
        return y.reshape(n, L, H * P), (S, tail)

    def _tree(
        self, xBC: torch.Tensor, dt: torch.Tensor, dims: MambaDims, params: MixerParams
    ) -> torch.Tensor:
        """xBC [s, cd], dt [s, H] of the chunk -> y [s, d_inner] (the heads `dims` describes): every segment of the
        chunk's tree from its parent's state (in the chunk, or handed down by the prefix cache); hands each segment's
        state down when the context captures (models/gdn.py's order: depth by depth, siblings as one right-padded
        batch)."""
        ctx = self.context
        assert ctx is not None and ctx.tree is not None, "a Mamba layer needs the chunk's tree"
        s = xBC.shape[0]
        y = xBC.new_zeros(s, dims.d_inner, dtype=torch.float32)  # rows in no segment stay 0
        states: dict[int, State] = {}
        cached = {
            i: r for r, i in enumerate(i for i, g in enumerate(ctx.tree.segments) if g.parent == CACHED)
        }
        for depth in tree_depths(ctx.tree):
            segs = [ctx.tree.segments[i] for i in depth]
            rows = Rows.of([(g.start, g.end) for g in segs], xBC.device)
            starts = [self._start(g.parent, cached.get(i, 0), states, xBC, dims) for i, g in zip(depth, segs)]
            start = (torch.cat([t[0] for t in starts]), torch.cat([t[1] for t in starts]))
            roots = all(g.parent is None for g in segs)
            out, (S, tail) = self._segments(
                xBC[rows.index], dt[rows.index], rows, start, dims, params, roots=roots
            )
            y = y.index_put((rows.index[rows.valid],), out[rows.valid].float())
            for j, i in enumerate(depth):
                states[i] = (S[j : j + 1], tail[j : j + 1])
        if ctx.capture:
            hand_down_states(
                ctx, self.layer_number, MAMBA_STATE, {i: own_state(t) for i, t in states.items()}
            )
        return y

    def _start(
        self, parent: int | None, cached: int, states: dict[int, State], like: torch.Tensor, dims: MambaDims
    ) -> State:
        """The (SSM state, conv tail) a segment starts from: zeros for a root, its parent's in this chunk, or the
        one its cached parent handed down (one row shared by every segment with a cached parent, or one row per
        such segment in a decode step: row `cached`)."""
        if parent is None:
            S = like.new_zeros(1, dims.heads, dims.head_dim, dims.state, dtype=torch.float32)
            return S, like.new_zeros(1, dims.conv_channels, dims.kernel - 1)
        if parent == CACHED:
            assert self.context is not None
            ((S, tail),) = self.context.handed_down(self.layer_number)
            if S.shape[0] > 1:
                S, tail = S[cached : cached + 1], tail[cached : cached + 1]
            return S, tail
        return states[parent]


def hybrid_layer_specs(arch: Any, attention_layer_spec: ModuleSpec) -> dict[str, ModuleSpec]:
    """The layer kinds of a hybrid_override_pattern (models/mamba_arch.py PATTERN_KINDS) from the model's full
    layer spec (its layer class, norms, attention and MLP): "attention" keeps the attention and drops the MLP,
    "mlp" keeps the MLP and drops the attention, "mamba" puts BranchMambaMixer in the attention slot, "moe" (a MoE
    model's "E" layers) is "mlp" with megatron's MoELayer in the MLP slot."""
    attention = copy.deepcopy(attention_layer_spec)
    _drop_mlp(attention)
    mlp = copy.deepcopy(attention_layer_spec)
    mlp.submodules.input_layernorm = IdentityOp
    mlp.submodules.self_attention = IdentityOp
    mlp.submodules.self_attn_bda = IdentityFuncOp
    mamba = copy.deepcopy(attention)
    mamba.submodules.self_attention = ModuleSpec(
        module=BranchMambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
        params=dict(
            d_conv=arch.mamba_conv_kernel,
            conv_bias=arch.mamba_conv_bias,
            chunk_size=arch.mamba_chunk_size,
            dt_min=arch.mamba_dt_min,
        ),
    )
    # dist-checkpoint names of the norms as megatron's TE Mamba stack fuses them (mamba_layer_specs.py: into
    # in_proj, linear_qkv, linear_fc1), so that one checkpoint serves both specs (models/families/param_rules.py)
    mamba.submodules.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    kinds = {"attention": attention, "mlp": mlp, "mamba": mamba}
    if arch.is_moe:  # "E": the "mlp" layer with megatron's MoELayer in its MLP slot (models/moe.py)
        from megatron_branch.models.moe import moe_layer_spec

        kinds["moe"] = moe_layer_spec(mlp)
    return kinds


def _drop_mlp(spec: ModuleSpec) -> None:
    spec.submodules.pre_mlp_layernorm = IdentityOp
    spec.submodules.mlp = IdentityOp
    spec.submodules.mlp_bda = IdentityFuncOp
