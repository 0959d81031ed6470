"""Multi-latent attention's compact prefix cache: a replayed segment hands its descendants the compressed latent
(c_kv after kv_layernorm, and the roped k_rope) instead of per-head K/V; each chunk below it decompresses the
cached latent through linear_kv_up_proj itself (issue 32 item 1). models/mla.py has the MLA shapes.

Shape legend (Megatron sequence-first, this TP rank): s chunk rows (s/tp of them under sequence parallel before
the attention), c_j rows of one cached ancestor, b batch (1), n_loc heads on this rank, d qk_nope_head_dim,
r qk_rope_head_dim, dv v_head_dim, ckv kv_lora_rank.

    handed down per layer and segment   c_kv [c_j, b, ckv] (normed), k_rope [c_j, b, r] (roped at its positions)
                                        -- (ckv + r) values per row, whatever n (DeepSeek-V3: 576 vs 40,960)
    decompressed in a descendant chunk  k_nope|v = c_kv . W_kv_up^T  [c_j, b, n_loc, d + dv]
                                        key = [k_nope | k_rope expanded over heads]  [c_j, b, n_loc, d + r]
    (megatron's own MLASelfAttention.uncompress_kv_from_cache does this for inference, on a layer split by
    prepare_for_absorption, which training cannot use; the same three steps here, on linear_kv_up_proj's weight.)

Why the gradient is exact, and which design: the decompression runs INSIDE each descendant chunk's graph, so the
chunk's backward back-projects its dK/dV of the ancestors' rows through W_kv_up there and then: W_kv_up^T dKV into
c_kv's leaf, the heads' sum of dk_rope into k_rope's leaf (both accumulate in the leaves' .grad over every child,
like dK/dV did), and c_kv^T dKV into W_kv_up's own gradient. After the last child the summed latent gradient is
injected into the segment's c_kv / k_rope once (schedule/prefix_cache.py, unchanged: a StateKind). Naive training
computes the same sums (W_kv_up^T is linear, so back-projecting per child and summing equals back-projecting the
sum). The other design -- accumulate per-head dK/dV and back-project once -- would keep accumulators of the per-head
K/V's size for every cached segment, the size this cache exists to avoid.

What a chunk holds: the path's decompressed K/V exist while the chunk's attention runs and are saved for its
backward like any activation (per layer; with per-layer recompute, `recompute_layers`, one layer's at a time); the
cache between chunks, for every cached segment on the path and every layer, is the latent only.

Tensor parallelism: c_kv is not split by TP (the down projection is replicated, models/mla.py; linear_kv_up_proj is
column-parallel: each rank decompresses its own heads from the whole latent), so each rank caches the whole latent
and its descendants send it a PARTIAL gradient (this rank's heads). The handed-down c_kv is therefore taken through
megatron's sequence-parallel gather (backward: reduce-scatter, the partial gradients summed), or without sequence
parallelism its copy-to-TP region (backward: all-reduce), as linear_kv_up_proj's own input is; k_rope is already
gathered by megatron's MLA under SP (the same reduce-scatter). Context parallelism (the ring, parallel/context.py)
and the sampler's prefill (its decode cache) keep per-head K/V: only a `LocalContext` with `latent_cache` set (the
schedules' one-rank chunks, schedule/chunks.py) takes this path.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size

from megatron_branch.attention.context import LocalContext
from megatron_branch.attention.prefix_state import StateKind, compact

MLA_LATENT = StateKind(name="mla-latent", reads="path", per_row=True)
"""Multi-latent attention layers with the compact cache: every descendant reads the latent rows (c_kv, k_rope) of
all its ancestors and decompresses them itself."""


class BranchMLASelfAttention(MLASelfAttention):
    """megatron's MLASelfAttention (same constructor, parameters and state dict); under a `LocalContext` with
    `latent_cache` its forward hands down the latent and decompresses the ancestors' (this module's docstring).
    Anywhere else (no context, the ring, decode, the sampler's prefill) it is megatron's forward unchanged."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = getattr(self.core_attention, "context", None)
        if not (isinstance(ctx, LocalContext) and ctx.latent_cache):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        # what TransformerLayer passes in training: no inference context, RoPE table, bias or packing (MLA owns
        # its RoPE; the context's layout decides what each row sees)
        assert not args and all(v is None for v in kwargs.values()), (args, kwargs)
        assert not (self.recompute_up_proj or self.offload_qkv_linear or self.checkpoint_core_attention)
        layer = self.core_attention.layer_number
        # query [s,b,n_loc,d+r], key [s,b,n_loc,d+r], value [s,b,n_loc,dv]; latent [s(/tp),b,ckv] normed
        query, key, value, _, latent = self.get_query_key_value_tensors(hidden_states)
        if ctx.capture:
            k_rope = key[..., 0, self.config.qk_head_dim :]  # [s,b,r]: roped, one for every head
            ctx.hand_down(layer, MLA_LATENT, (compact(self._whole_latent(latent)), compact(k_rope)))
        blocks = [self.decompress(c, kr) for c, kr in ctx.handed_down(layer)]
        blocks.append((compact(key), compact(value)))
        out = ctx.attend_blocks(
            query.contiguous(),
            [k for k, _ in blocks],
            [v for _, v in blocks],
            self.core_attention.softmax_scale,
        )  # [s,b,n_loc*dv]
        return self.linear_proj(out)

    def _whole_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [s(/tp),b,ckv] -> [s,b,ckv] on every TP rank, with the backward that sums the ranks' partial
        gradients (the module docstring)."""
        if get_pg_size(self.tp_group) == 1:
            return latent
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(latent, group=self.tp_group)
        return copy_to_tensor_model_parallel_region(latent, group=self.tp_group)

    def decompress(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A cached ancestor's latent c_kv [c_j,b,ckv], k_rope [c_j,b,r] -> key [c_j,b,n_loc,d+r], value
        [c_j,b,n_loc,dv], as megatron's forward computes them from the same latent (uncompress_kv_from_cache)."""
        d, dv, n = self.config.qk_head_dim, self.config.v_head_dim, self.num_attention_heads_per_partition
        assert self.linear_kv_up_proj.bias is None  # megatron builds it bias-free
        # W_kv_up's gradient from here reaches the parameter as autograd's .grad, which megatron's DDP hook adds to
        # main_grad: right while gradient_accumulation_fusion is off (models/transformer_config.py sets it off;
        # with it on, that hook would skip .grad once the fused kernel had written main_grad)
        kv = torch.nn.functional.linear(c_kv, self.linear_kv_up_proj.weight)
        k_nope, value = torch.split(kv.view(*kv.shape[:-1], n, d + dv), [d, dv], dim=-1)
        key = torch.cat([k_nope, k_rope.unsqueeze(-2).expand(-1, -1, n, -1)], dim=-1)
        return key, value.contiguous()
