"""RoPE with explicit position ids.

megatron-core's GPTModel builds its rotary table for positions 0..s-1 of the input. Branch replay needs every
token's ORIGINAL position: a branch continues from its parent's end, a packed tree restarts positions per branch,
and context parallelism reorders tokens. `PositionRotaryEmbedding` replaces the model's `rotary_pos_emb` module and
returns the table rows for the position ids of the current forward, set by `BranchGPTModel.forward`.

Frequencies are computed in float32 exactly as megatron (and Hugging Face) compute them, so results match both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class PositionRotaryEmbedding(torch.nn.Module):
    """Returns emb [s, 1, 1, rot_dim] for the current position ids (megatron's non-interleaved layout)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        # inner: megatron's RotaryEmbedding; we reuse its inv_freq (and its rope settings) and only change which
        # positions the table is built for.
        self.inner = inner
        self.position_ids: torch.Tensor | None = None

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> Any:
        """emb [s, 1, 1, rot_dim]; for megatron's YarnRotaryEmbedding (emb, its concentration factor), as it
        returns (GPTModel unpacks the pair; attention applies the factor from the config)."""
        from megatron.core.models.common.embeddings import YarnRotaryEmbedding

        yarn = isinstance(self.inner, YarnRotaryEmbedding)
        inv_freq = yarn_inv_freq(self.inner) if yarn else self.inner.inv_freq
        inv_freq = inv_freq.to("cpu" if not torch.cuda.is_available() else inv_freq.device)
        if self.position_ids is None:
            pos = torch.arange(max_seq_len, device=inv_freq.device) + offset
        else:
            pos = self.position_ids.to(inv_freq.device)
            assert pos.dim() == 1, "position ids must be shared across the batch ([s])"
        seq = pos.to(inv_freq.dtype)
        if getattr(self.inner, "seq_len_interpolation_factor", None) is not None:
            seq = seq / self.inner.seq_len_interpolation_factor
        freqs = torch.outer(seq, inv_freq)  # [s, rot_dim/2]
        assert not getattr(self.inner, "rotary_interleaved", False)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]  # [s, 1, 1, rot_dim]
        if yarn:
            from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
                _yarn_get_concentration_factor,
            )

            inner = self.inner
            return emb, _yarn_get_concentration_factor(
                inner.scaling_factor, inner.mscale, inner.mscale_all_dim
            )
        return emb

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)


def yarn_inv_freq(inner: Any) -> torch.Tensor:
    """[rot_dim / 2] float32: megatron's YarnRotaryEmbedding's frequencies (its get_emb's blend of the plain and
    the interpolated ones over the correction ramp, with its own helpers), which equal transformers'
    `_compute_yarn_parameters` (tests/unit/test_gpt_oss.py)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_find_correction_range,
        _yarn_linear_ramp_mask,
    )

    low, high = _yarn_find_correction_range(
        inner.beta_fast,
        inner.beta_slow,
        inner.dim,
        inner.rotary_base,
        inner.original_max_position_embeddings,
        inner.correction_range_round_to_int,
    )
    extra = inner.inv_freq_extra.to(inner.inv_freq.device)
    mask = 1.0 - _yarn_linear_ramp_mask(low, high, inner.dim // 2, device=extra.device).to(torch.float32)
    return inner.inv_freq_inter.to(extra.device) * (1 - mask) + extra * mask


@contextmanager
def rope_positions(rope: PositionRotaryEmbedding | None, positions: torch.Tensor | None) -> Iterator[None]:
    """`positions` set on `rope` for a recomputation in backward (after the model's hook cleared them), then what
    was there; nothing with no `rope` (a layer whose RoPE table is the model's, passed in as a tensor)."""
    if rope is None:
        yield
        return
    held, rope.position_ids = rope.position_ids, positions
    try:
        yield
    finally:
        rope.position_ids = held


def enable_position_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Make an existing megatron GPTModel's RoPE follow the `position_ids` of each forward (idempotent).

    This is the whole model-side patch for an existing Megatron run (besides the core_attention slot): the model's
    `rotary_pos_emb` is wrapped (multi-latent attention: every MLA layer's own, megatron's GPTModel builds none),
    and forward hooks hand them `position_ids[0]` (GPTModel.forward's second argument) for the duration of the
    call. Batch rows must share position ids ([b, s] with identical rows; b is 1 here).
    """
    if getattr(model, "position_embedding_type", None) not in ("rope", "yarn"):
        raise ValueError(
            "enable_position_rope needs a GPTModel with position_embedding_type 'rope' or 'yarn'"
        )
    owners = [model] if hasattr(model, "rotary_pos_emb") else []
    if getattr(model.config, "multi_latent_attention", False):
        owners = [m for m in model.modules() if m is not model and hasattr(m, "rotary_pos_emb")]
    if not owners or all(isinstance(m.rotary_pos_emb, PositionRotaryEmbedding) for m in owners):
        return model
    ropes = []
    for owner in owners:
        owner.rotary_pos_emb = PositionRotaryEmbedding(owner.rotary_pos_emb)
        ropes.append(owner.rotary_pos_emb)

    def before(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pos = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
        for rope in ropes:
            rope.position_ids = None if pos is None else pos[0]

    def after(*_: Any) -> None:
        for rope in ropes:
            rope.position_ids = None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, always_call=True)
    return model
