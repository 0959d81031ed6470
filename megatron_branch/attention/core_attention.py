"""The megatron-core `core_attention` plug-in that attends over cached ancestor keys/values.

Shape legend (Megatron, sequence first):
    s  tokens of the current chunk (one segment, a micro-batch of sibling segments, or a whole packed tree)
    c  tokens of the cached ancestors that are NOT in the chunk (replay: the current path above the chunk)
    b  batch (always 1 here: a chunk is a packed sequence)
    n  query heads on this tensor-parallel rank, g key/value groups on this rank, h head dim

`Attention.forward` in megatron-core computes q [s,b,n,h], k/v [s,b,g,h] (RoPE applied) and calls
`core_attention(q, k, v, mask, ...)`. With no `BranchContext` attached, this module is megatron's own
`DotProductAttention` (the naive schedule's baseline runs through it). With a context attached (attention/context.py: Local, Ring
or Decode), the context decides which keys each query sees, reads the cached ancestor K/V in place, records this
chunk's K/V for the schedule, and runs the executor the schedule chose (attention/dispatch.py).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_branch.attention.context import BranchContext, TakesBranchContext


class CoreAttentionSlot(MegatronModule):
    """What every module in megatron's `core_attention` slot shares: DotProductAttention's constructor (the layer
    spec builds the slot with it) and the softmax scale, 1 / sqrt(head dim) unless given."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        # k_channels / v_channels: what megatron's MLA passes (q/k and v head widths); the executors read the
        # widths off the tensors, and the stock attention sizes its output by config.kv_channels (models/mla.py)
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5


class BranchCoreAttention(CoreAttentionSlot, TakesBranchContext):
    """Drop-in for megatron's DotProductAttention (same constructor), branch-aware when a context is attached.

    Without a context it is `stock`: megatron's DotProductAttention built here (none under CP, whose attention
    only a context runs), or an existing core attention given as `stock` (a model built elsewhere:
    integration/verl_model.py BranchFallbackAttention)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        *,
        stock: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """megatron's arguments (`kwargs`: attention_dropout, softmax_scale, cp_comm_type, pg_collection, as the
        spec passes them, by keyword) go to the slot and to the DotProductAttention built as `stock`."""
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        pgc = kwargs.get("pg_collection")
        self.sink_tp_group = getattr(
            pgc, "tp", None
        )  # the sink's shards' group (sharded_state_dict); None: megatron's
        self.context: BranchContext | None = None
        self.stock: torch.nn.Module | None = stock
        self.window = layer_window(config, self.layer_number)
        if stock is None and config.context_parallel_size == 1:
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            kwargs = {k: v for k, v in kwargs.items() if k not in ("k_channels", "v_channels")}

            self.stock = DotProductAttention(
                config=config,
                layer_number=layer_number,
                attn_mask_type=attn_mask_type,
                attention_type=attention_type,
                **kwargs,
            )
        if getattr(config, "softmax_type", "vanilla") == "learnable" and stock is None:
            self._own_sink(config)

    def _own_sink(self, config: Any) -> None:
        """The learned sinks [n / tp] as THIS module's `softmax_offset` (megatron's name and init), so that the
        parameter exists under CP too (no stock module there); megatron's DotProductAttention reads the same
        tensor (held outside its parameters: one parameter, one state-dict key)."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        if self.stock is not None:
            self.softmax_offset = self.stock._parameters.pop("softmax_offset")
            object.__setattr__(self.stock, "softmax_offset", self.softmax_offset)  # read, not registered
        else:
            heads = config.num_attention_heads // config.tensor_model_parallel_size
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        # one logit per head: split over TP with the heads (megatron shards it so in its sharded_state_dict)
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The sink this module holds (_own_sink) split over TP along its one axis, the heads, as megatron's
        DotProductAttention.sharded_state_dict declares it (MegatronModule's default would save each TP rank's
        [n / tp] as the whole tensor: a TP2 checkpoint would hold half the heads, twice)."""
        if self._parameters.get("softmax_offset") is None:
            return super().sharded_state_dict(prefix, sharded_offsets, metadata)
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        groups = {}
        if self.sink_tp_group is not None:  # else megatron's own fallback: its parallel_state's groups
            groups = dict(
                tp_group=self.sink_tp_group,
                dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"],
            )
        return make_sharded_tensors_for_checkpoint(
            {"softmax_offset": self.softmax_offset}, prefix, {"softmax_offset": 0}, sharded_offsets, **groups
        )

    @property
    def sink(self) -> torch.Tensor | None:
        """The learned sink logits [n] of this rank's heads (None: plain softmax)."""
        own = self._parameters.get("softmax_offset")
        if own is not None:
            return own
        return getattr(self.stock, "softmax_offset", None) if self.stock is not None else None

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
        if self.context is None:
            assert self.stock is not None, (
                "no BranchContext attached and megatron's attention is unavailable (CP>1)"
            )
            return self.stock(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        assert (
            packed_seq_params is None and attention_bias is None
        )  # the context's layout decides what each sees
        return self.context.attend(
            self.layer_number, query, key, value, self.softmax_scale, window=self.window, sink=self.sink
        )


def layer_window(config: Any, layer_number: int) -> int | None:
    """The sliding window W (path positions) of megatron layer `layer_number` (1-based), None for full attention:
    megatron's own per-layer rule (transformer/utils.py is_layer_window_attention) over its (left, right) window,
    W = left + 1 (a causal window: right must be 0)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    size = getattr(config, "window_size", None)
    if not is_layer_window_attention(size, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    assert size is not None and size[1] == 0 and size[0] >= 0, f"a causal sliding window, not {size}"
    return int(size[0]) + 1
