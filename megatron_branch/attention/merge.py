"""THE log-sum-exp merge of partial attention results, used everywhere (branch attention and ring attention).

SHAPE LEGEND (layout-agnostic: only the last dim of out is special):
    out    [..., h]   partial attention output over some subset of the keys (e.g. [b, n, sq, h] or [sq, b, n, h])
    lse    [...]      its log-sum-exp over that subset, out.shape[:-1] (FlashAttention-2's L)

Two parts over disjoint key sets A and B merge exactly:
    lse = log(exp(lse_A) + exp(lse_B))
    out = (exp(lse_A) * out_A + exp(lse_B) * out_B) / exp(lse)
in the stable form of ring-flash-attention (zhuzilin):
    out = out - sigmoid(lse_B - lse) * (out - out_B)
    lse = lse - logsigmoid(lse - lse_B)
Accumulated in fp32 (fp64 when the inputs are fp64); the caller casts the final out back.
A row that sees no key in a part has lse = -inf there; the guards keep such rows NaN-free (a row empty in every
part ends with out = 0, lse = -inf).

Attention sinks (gpt-oss: one learned logit s_h per query head in every row's softmax denominator, value 0;
transformers' `eager_attention_forward` appends it as an extra column and drops it after the softmax) are ONE more
part of this merge, (out 0, lse s_h), merged ONCE into the row's final result after every key block (one rank's
calls, or every ring step): `add_sink`. Counting it per block would add exp(s_h) once per block. The executors'
backward then runs with the merged (out', lse'): P' = exp(S - lse') are the sink-softmax's probabilities, and the
sink column's dP is 0 (its value is 0), so D = rowsum(dO' * O') and every dq/dk/dv formula stays exact; the sink's
own gradient is dL/ds_h = -sum_rows exp(s_h - lse') * rowsum(dO' * O') (`sink_grad`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def lse_merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge (block_out, block_lse) into the running (out, lse); out=None means block is the first part."""
    acc = _acc_dtype(block_out, block_lse) if out is None else _acc_dtype(out, lse, block_out, block_lse)
    block_out, block_lse = block_out.to(acc), block_lse.to(acc)
    if out is None:
        assert lse is None, "out=None (first block) needs lse=None"
        return block_out, block_lse
    assert lse is not None and lse.shape == block_lse.shape == out.shape[:-1] == block_out.shape[:-1], (
        f"lse_merge shapes: out {tuple(out.shape)} lse {tuple(lse.shape)} "
        f"block_out {tuple(block_out.shape)} block_lse {tuple(block_lse.shape)}"
    )
    out, lse = out.to(acc), lse.to(acc)
    empty = lse == float("-inf")  # [...]; running result has seen no key yet
    block_empty = block_lse == float("-inf")  # [...]; this block has no visible key for the row
    # replace -inf by finite stand-ins before the arithmetic, so neither the values nor any gradient see inf - inf
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)
    safe_block = torch.where(block_empty, torch.zeros_like(block_lse), block_lse)
    w = torch.sigmoid(safe_block - safe_lse)  # [...]; block's share of the merged softmax mass
    w = torch.where(block_empty, torch.zeros_like(w), torch.where(empty, torch.ones_like(w), w))
    new_out = out - w.unsqueeze(-1) * (out - block_out)  # [..., h]
    new_lse = safe_lse - torch.nn.functional.logsigmoid(safe_lse - safe_block)  # [...]
    new_lse = torch.where(block_empty, lse, torch.where(empty, block_lse, new_lse))
    return new_out, new_lse


def merge_parts(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge [(out, lse), ...] over disjoint key sets; returns (out, lse) in the accumulation dtype."""
    if not parts:
        raise ValueError("merge_parts needs at least one (out, lse) part")
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for block_out, block_lse in parts:
        out, lse = lse_merge(out, lse, block_out, block_lse)
    assert out is not None and lse is not None
    return out, lse


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink as the last part of the merge: out [sq, b, n, h] and lse [sq, b, n] over every key of the rows,
    sink [n] (this rank's heads) -> (out', lse') with exp(sink) in each row's denominator once."""
    assert sink.shape == lse.shape[-1:], f"sink {tuple(sink.shape)} vs {lse.shape[-1]} heads"
    sink_lse = sink.detach().to(_acc_dtype(out, lse)).expand(lse.shape)  # [sq, b, n]
    return lse_merge(out, lse, torch.zeros_like(out), sink_lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """dL/dsink [n] from the merged (sink included) out' [sq, b, n, h], lse' [sq, b, n] and dout [sq, b, n, h]:
    -sum over rows and batch of P'_sink * rowsum(dO' * O'), P'_sink = exp(sink - lse')."""
    acc = _acc_dtype(out, lse)
    p_sink = torch.exp(sink.detach().to(acc) - lse.to(acc))  # [sq, b, n]
    d = (dout.to(acc) * out.to(acc)).sum(-1)  # [sq, b, n]
    return -(p_sink * d).sum(dim=(0, 1)).to(sink.dtype)
