"""Which heads, groups and channels of a Mamba-2 mixer each context-parallel rank runs (the head exchange).

SHAPE LEGEND (one TP rank's MambaMixer, megatron's names; W the CP size):
    H heads of P channels, G groups (each group's B and C are read by H / G consecutive heads), state N
    d_inner = H P      conv channels cd = d_inner + 2 G N      kernel K
    xBCdt       in_proj output after the gate z: [x (d_inner) | B (G N) | C (G N) | dt (H)]
    block j     (CP rank j) heads [j H/W, (j+1) H/W) and the group(s) they read
    index [W, c]     xBCdt channels of each block: [x_j | B_j | C_j | dt_j]
    conv  [W, cd_j]  conv1d channels of each block: [x_j | B_j | C_j] (the first cd_j entries of `index`)
    heads [W, H/W]   A_log / dt_bias / D entries of each block

The blocks are megatron-core's Mamba context parallelism's (ssm/mamba_context_parallel.py): heads split evenly over
the CP ranks, groups with them when W divides their count (`ngroups_local_tpcp = G / W`), or each group's B and C
replicated over the W / G ranks that hold its heads (`group_repeat_count`; the gather's backward sums their
gradients, and the sliced conv weights' gradients are summed over CP by the gradient reduction like every other
parameter's). They are the gated delta net's blocks (models/gdn_heads.py) with the groups as its key heads, so the
widths come from the same function (models/arch.py `gdn_block_heads`). Any other CP size is refused before any work
(rules/ `check_mamba_run`). The gate z stays home: the grouped gated norm runs per position after the exchange back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_branch.models.arch import gdn_block_heads


@dataclass(frozen=True)
class MambaDims:
    """The widths the SSD scan and conv of one TP rank (or of one CP block of it) run over."""

    heads: int
    groups: int
    head_dim: int  # P
    state: int  # N
    kernel: int  # K

    @property
    def d_inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.d_inner + 2 * self.groups * self.state


@dataclass(frozen=True)
class MambaBlocks:
    """The W head blocks of one TP rank's MambaMixer (module docstring)."""

    index: torch.Tensor  # [W, c] long
    conv: torch.Tensor  # [W, cd_j] long
    heads: torch.Tensor  # [W, H/W] long
    dims: MambaDims  # the widths of ONE block

    @classmethod
    def of(cls, dims: MambaDims, cp: int, device: torch.device) -> MambaBlocks:
        H, G, P, N = dims.heads, dims.groups, dims.head_dim, dims.state
        n_g, per_block = gdn_block_heads(G, H, cp)  # groups / heads of one block
        reads = H // G  # heads per group
        index, conv, heads = [], [], []
        for j in range(cp):
            h = torch.arange(j * per_block, (j + 1) * per_block)
            g = torch.unique(h // reads)  # the contiguous groups these heads read
            assert g.numel() == n_g, (g, n_g)
            x = (h[:, None] * P + torch.arange(P)).reshape(-1)
            b = (g[:, None] * N + torch.arange(N)).reshape(-1)
            channels = torch.cat([x, dims.d_inner + b, dims.d_inner + G * N + b])  # [x_j | B_j | C_j]
            conv.append(channels)
            index.append(torch.cat([channels, dims.conv_channels + h]))  # + dt_j
            heads.append(h)
        block = MambaDims(heads=per_block, groups=n_g, head_dim=P, state=N, kernel=dims.kernel)
        return cls(
            index=torch.stack(index).to(device),
            conv=torch.stack(conv).to(device),
            heads=torch.stack(heads).to(device),
            dims=block,
        )
