"""Which heads and channels of a gated delta net layer each context-parallel rank runs (the head exchange).

SHAPE LEGEND (one TP rank's GatedDeltaNet, megatron's names; W the CP size):
    nk key heads, H value heads (H / nk value heads read each key head), dk / dv head widths
    in_proj output channels   [q (nk dk) | k (nk dk) | v (H dv) | z (H dv) | beta (H) | alpha (H)]
    block j (CP rank j)       value heads [j H/W, (j+1) H/W), the key heads they read, and their channels
    index  [W, c]             in_proj-output channels of each block: [q_j | k_j | v_j | beta_j | alpha_j]
    conv   [W, cd_j]          conv1d channels of each block ([q_j | k_j | v_j]: the first 2 qk + vd of `index`)
    value_heads [W, H/W]      A_log / dt_bias entries of each block

The blocks follow megatron-core's Mamba context parallelism (ssm/mamba_context_parallel.py: heads split evenly over
the CP ranks; groups split with them when W divides their count, or each group replicated over the W / groups ranks
that share its heads). Here the groups are the key heads: when W divides nk a block holds nk / W whole key heads
with their value heads; when nk divides W each key head's q/k channels go to the W / nk ranks holding its value
heads (the gather's backward sums their gradients), and its conv weights' gradient is summed over CP by the
gradient reduction like every other parameter's. Any other shape is refused before any work
(rules.check_gdn_context_parallel). The z (output gate) channels stay home: the gated norm runs per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_branch.models.arch import gdn_block_heads
from megatron_branch.models.gdn_tree import GDNDims


@dataclass(frozen=True)
class HeadBlocks:
    """The W head blocks of one TP rank's GatedDeltaNet (module docstring)."""

    index: torch.Tensor  # [W, c] long
    conv: torch.Tensor  # [W, cd_j] long
    value_heads: torch.Tensor  # [W, H/W] long
    dims: GDNDims  # the widths of ONE block

    @classmethod
    def of(cls, dims: GDNDims, cp: int, device: torch.device) -> HeadBlocks:
        nk, H, dk, dv = dims.heads_k, dims.heads_v, dims.dk, dims.dv
        n_k, per_block = gdn_block_heads(nk, H, cp)  # key / value heads of one block
        reads = H // nk  # value heads per key head
        z_end = 2 * dims.qk + 2 * dims.v  # beta starts after z
        index, conv, value_heads = [], [], []
        for j in range(cp):
            vh = torch.arange(j * per_block, (j + 1) * per_block)
            kh = torch.unique(vh // reads)  # contiguous key heads of this block
            assert kh.numel() == n_k, (kh, n_k)
            q = (kh[:, None] * dk + torch.arange(dk)).reshape(-1)
            v = (vh[:, None] * dv + torch.arange(dv)).reshape(-1)
            channels = torch.cat([q, dims.qk + q, 2 * dims.qk + v])  # [q_j | k_j | v_j]
            conv.append(channels)
            index.append(torch.cat([channels, z_end + vh, z_end + H + vh]))
            value_heads.append(vh)
        block = GDNDims(
            qk=n_k * dk,
            v=per_block * dv,
            heads_k=n_k,
            heads_v=per_block,
            dk=dk,
            dv=dv,
            kernel=dims.kernel,
        )
        return cls(
            index=torch.stack(index).to(device),
            conv=torch.stack(conv).to(device),
            value_heads=torch.stack(value_heads).to(device),
            dims=block,
        )
