"""The planner's multi-latent attention terms (DeepSeek-V3, Kimi-K2: models/mla.py, models/mla_latent.py):
parameters, FLOPs and saved activations of an MLA layer's attention part, and the compact latent prefix cache,
read off megatron-core 0.16.1's MLASelfAttention (local spec, replicated down projections) with this engine's
core attention, and checked against torch's FlopCounterMode and the activation meter (tests/unit/test_plan_mla.py).

Shape legend (one TP rank): r rows of a chunk (r_n = r / t under sequence parallelism), c cached ancestor rows a
chunk reads, h hidden, n = heads / t, d qk_nope_head_dim, rr qk_rope_head_dim, dv v_head_dim, cq q_lora_rank,
ckv kv_lora_rank, e activation bytes, f32 = max(e, 4).

Parameters of the attention part (the layer's norms and MLP are the plain layer's):
    q   h cq + cq + cq n (d + rr)      (q_lora_rank None: h n (d + rr))     q_down, q_layernorm, q_up
    kv  h (ckv + rr) + ckv + ckv n (d + dv)                                 kv_down, kv_layernorm, kv_up
    o   n dv h
Forward FLOPs per token: 2 x each matmul above; per (query, visible key) pair: 2 n (d + rr) + 2 n dv.

Saved for backward per MLA layer over r rows (besides the two layer norms, fc1's input and the MLP):
    q path       q_down's input (the input norm's output, r_n h e); q_layernorm's input, rstd and x * rstd, its
                 output (q_up's input): 3 r_n cq e + r_n f32   (q_lora_rank None: nothing more)
    kv path      kv_layernorm's input is a view of kv_down's output [r_n, ckv + rr], which it keeps whole, its rstd,
                 x * rstd, and its output (kv_up's input): r_n (ckv + rr) e + 2 r_n ckv e + r_n f32
    RoPE         cos / sin for q and for k: 4 r rr e
    attention    the query [r, n, d + rr], the output [r, n dv] (linear_proj's input), the lse n r f32
    K/V          key [r, n, d + rr] (a cat) and value [r, n, dv] (megatron's .contiguous() copy)
    decompressed a chunk under cached ancestors: their key and value, c n (d + rr + dv) e, decompressed from the
                 latent in the chunk and saved by its attention (models/mla_latent.py)
The prefix cache per cached row and layer: the latent c_kv and the roped k_rope, (ckv + rr) e, plus its gradient
accumulator (ckv + rr) f32 -- instead of per-head K/V, n (d + rr + dv) e (held under context parallelism, where the
ring carries K/V). Replay pays for it in FLOPs: every leaf micro-batch decompresses the path's rows again,
2 c ckv n (d + dv) per layer forward and twice that backward (`decompress_flops`).
"""

from __future__ import annotations

from typing import Any

from megatron_branch.models.arch import ModelArch


def mla_widths(arch: ModelArch) -> tuple[int, int, int, int, int, int | None]:
    """(n, d, rr, dv, ckv, cq) of every MLA layer: all heads (divide n by TP for a rank's)."""
    assert arch.multi_latent and arch.head_dim is not None
    return (
        arch.num_attention_heads,
        arch.head_dim,
        arch.qk_rope_head_dim,
        arch.v_head_dim,
        arch.kv_lora_rank,
        arch.q_lora_rank,
    )


def mla_attention_params(arch: ModelArch) -> int:
    """The attention part of an MLA layer: q (down, norm, up; or q_proj), kv (down, norm, up), linear_proj."""
    h = arch.hidden_size
    n, d, rr, dv, ckv, cq = mla_widths(arch)
    q = h * n * (d + rr) if cq is None else h * cq + cq + cq * n * (d + rr)
    kv = h * (ckv + rr) + ckv + ckv * n * (d + dv)
    return q + kv + n * dv * h


def mla_replicated_params(arch: ModelArch) -> int:
    """The latent norms every TP rank holds whole (q_layernorm, kv_layernorm)."""
    _, _, _, _, ckv, cq = mla_widths(arch)
    return ckv + (cq or 0)


def mla_matmul_flops_per_token(arch: ModelArch) -> int:
    """Forward FLOPs of one token through an MLA layer's projections (not its MLP)."""
    h = arch.hidden_size
    n, d, rr, dv, ckv, cq = mla_widths(arch)
    q = 2 * h * n * (d + rr) if cq is None else 2 * h * cq + 2 * cq * n * (d + rr)
    return q + 2 * h * (ckv + rr) + 2 * ckv * n * (d + dv) + 2 * n * dv * h


def mla_flops_per_pair(arch: ModelArch) -> int:
    """Forward FLOPs of one (query, visible key) pair in one MLA layer: q.k over d + rr, p.v over dv."""
    n, d, rr, dv, _, _ = mla_widths(arch)
    return 2 * n * (d + rr) + 2 * n * dv


def decompress_flops(arch: ModelArch, rows: int, *, backward: bool = True) -> int:
    """FLOPs of decompressing `rows` cached latent rows through kv_up in every layer (forward, + backward's two)."""
    n, d, _, dv, ckv, _ = mla_widths(arch)
    return arch.num_layers * 2 * rows * ckv * n * (d + dv) * (3 if backward else 1)


def mla_kv_bytes(dm: Any, r: int) -> int:
    """Per MLA layer: a chunk's own key and value storages over r rows (dm: plan/activations.Dims)."""
    n, d, rr, dv, _, _ = mla_widths(dm.arch)
    return r * (n // dm.tp) * (d + rr + dv) * dm.e


def mla_latent_row_bytes(dm: Any) -> int:
    """Per MLA layer and cached row: the latent c_kv and k_rope the compact cache holds (every TP rank whole)."""
    _, _, rr, _, ckv, _ = mla_widths(dm.arch)
    return (ckv + rr) * dm.e


def mla_other_bytes(dm: Any, r: int, *, ext: int = 0) -> int:
    """Per MLA layer over r rows reading `ext` cached rows: the attention part's saved tensors other than its own
    K/V (the module docstring; the layer's two norms, fc1's input and the MLP are the caller's)."""
    n, d, rr, dv, ckv, cq = mla_widths(dm.arch)
    n //= dm.tp
    rn, e, f32 = dm.seq_rows(r), dm.e, dm.f32
    q_path = rn * dm.h * e + (3 * rn * cq * e + rn * f32 if cq is not None else 0)
    kv_path = rn * (ckv + rr) * e + 2 * rn * ckv * e + rn * f32
    rope = 4 * r * rr * e
    attention = r * n * (d + rr) * e + r * n * dv * e + n * r * f32
    decompressed = ext * n * (d + rr + dv) * e if dm.latent else 0
    return q_path + kv_path + rope + attention + decompressed
