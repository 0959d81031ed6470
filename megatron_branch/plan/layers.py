"""The planner's per-layer-kind terms: parameters, FLOPs and saved activations of a full-attention layer's
family extras (q/k norms, output gate, partial RoPE) and of a gated delta net (GDN) layer, read off the code that
runs (megatron-core 0.16.1's ssm/gated_delta_net.py and its torch_chunk_gated_delta_rule; fla's
chunk_gated_delta_rule on GPU) and checked against torch's FlopCounterMode and the activation meter
(tests/unit/test_plan_hybrid.py).

Shape legend (one TP rank): n tokens of one sequence, h hidden, H value heads (nv / tp), nk key heads (/ tp),
dk / dv key / value head widths, qk = nk dk, vd = H dv, cd = 2 qk + vd conv channels, K conv kernel, C = 64 the
delta rule's chunk, c = ceil(n / C) chunks (each sequence is padded to c C), e activation bytes, f = 4 (float32).

FLOPs of one GDN layer over one sequence (2 per multiply-add; forward):
    projections   2 n h (2 qk + 2 vd + 2 nv) + 2 n vd h                  (in_proj, out_proj)
    conv1d        2 cd K (n + K - 1)                                      (torch's conv1d pads K - 1 on both sides)
    delta rule    H c [3 (2 C^2 dk) + 2 (2 C^2 dv) + 3 (2 C dk dv)]       (torch_chunk_gated_delta_rule's matmuls)
Backward: twice each matmul, except two [C, dk] x [dk, dv] products of the first chunk against a state that needs
no gradient (no initial state) and the last chunk's state update that nothing reads (no final state kept): 2 x
forward - 4 H (2 C dk dv) per sequence without either. (FlopCounterMode charges torch's depthwise
convolution_backward as a dense one; the planner counts the real 2 x forward.)

Saved for backward by a GDN layer (torch path, every storage once, as the meter counts), besides the layer's two
norms, in_proj's and fc1's inputs and the MLP, which are the attention layer's terms:
    conv in [cd, n] e, silu in [cd, n + K - 1] e, q/k copies and L2 rstd 2 (n qk + n nk) e, softplus in/out 2 n H
    max(e, 4), beta n H e, gate n vd e (+ its float32 copy when e != 4), gated norm 3 n vd e + n H 4 (+ silu out
    in float32 when e != 4), out_proj in n vd e; in the float32 kernel (padded to T = c C): keys, values, beta,
    scaled q, v*beta, k*beta, k*beta*exp(g), k_cumdecay 6 H T d + H T; per chunk the decay mask and its exp, k.k^T,
    the attention with identity 4 H C^2, the triangular solve's clones sum_{i<C} (i + i^2) H (O(C^3): the torch
    path's dominant term), the chunk loop's q.k^T and masked copy 2 H C^2, v_new, q*exp(g), states and decays.
On GPU with fla's chunk_gated_delta_rule the kernel saves instead q, k, v, beta (e), g (f) and the [n, 64] WY
matrix A per head (fla's ChunkGatedDeltaRuleFunction.save_for_backward; from its source, not measured here).

Under context parallelism (the head exchange, parallel/head_exchange.py) a rank runs the per-head part (conv, q/k,
g, beta, the rule) for its head block (nk / W or one shared key head, H / W value heads: `gdn_block`) over WHOLE
sequences, and the per-row part (the output gate, gated norm, out_proj's input) over its own rows for all its heads;
the exchange saves a few index tensors and sends (W - 1) blocks of its rows each way per layer (forward; backward
the same): `gdn_exchange_*`, checked against the meter and the exchange's own byte count under CP2
(tests/distributed/test_plan_parallel.py).
"""

from __future__ import annotations

from megatron_branch.models.arch import ModelArch, gdn_block_heads
from megatron_branch.plan.mla import mla_attention_params, mla_matmul_flops_per_token, mla_replicated_params

CHUNK = 64
"""The delta rule's chunk (torch_chunk_gated_delta_rule's and fla's default)."""
GDN_KERNELS = ("torch", "fla")
"""torch: megatron's torch_chunk_gated_delta_rule (CPU, or no fla); fla: flash-linear-attention's Triton kernel."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _attention_widths(arch: ModelArch) -> tuple[int, int, int, int, int, int]:
    """(h, d, nq, g, f, q_rows) of a full-attention layer: q_rows the query rows of the fused QKV (doubled by
    the output gate, which megatron packs with the query); the parameter and FLOP counts both read these."""
    h, d, nq, g, f = (
        arch.hidden_size,
        arch.head_dim,
        arch.num_attention_heads,
        arch.num_query_groups,
        arch.ffn_hidden_size,
    )
    assert d is not None
    return h, d, nq, g, f, nq * d * (2 if arch.attention_output_gate else 1)


# --- parameters -----------------------------------------------------------------------------------------------------
def attention_layer_params(arch: ModelArch) -> int:
    """A full-attention layer: QKV (+ output gate rows, + bias), proj, q/k norms, 2 norms, SwiGLU."""
    h, d, nq, g, f, q_rows = _attention_widths(arch)
    if arch.multi_latent:  # its latent projections instead of QKV (plan/mla.py)
        return mla_attention_params(arch) + 2 * h + 3 * h * f
    qkv = h * (q_rows + 2 * g * d) + ((nq + 2 * g) * d if arch.qkv_bias else 0)
    qk_norms = 2 * d if arch.qk_norm else 0
    return qkv + nq * d * h + qk_norms + 2 * h + 3 * h * f + attention_extra_params(arch)


def attention_extra_params(arch: ModelArch) -> int:
    """gpt-oss's extras of an attention layer: o_proj's bias (linear_bias; megatron's add_bias_linear) and one
    learned sink logit per query head (attention_sinks: the core attention's softmax_offset)."""
    return (arch.hidden_size if arch.linear_bias else 0) + (
        arch.num_attention_heads if arch.attention_sinks else 0
    )


def expert_params(arch: ModelArch) -> int:
    """One routed expert: its SwiGLU (or gpt-oss's clamped GLU: the same three matrices, gate and up fused) and,
    with linear_bias, fc1's 2 I and fc2's h biases (gpt-oss's gate_up_proj_bias and down_proj_bias)."""
    h, i = arch.hidden_size, arch.moe_ffn_hidden_size
    return 3 * h * i + ((2 * i + h) if arch.linear_bias else 0)


def gdn_layer_params(arch: ModelArch) -> int:
    """A GDN layer: in_proj [q; k; v; z; beta; alpha], conv1d, A_log, dt_bias, out_norm, out_proj, 2 norms, SwiGLU."""
    h, f, nv = arch.hidden_size, arch.ffn_hidden_size, arch.linear_num_value_heads
    cd = 2 * arch.linear_qk_dim + arch.linear_v_dim
    in_proj = h * sum(arch.gdn_in_proj_sections())
    mixer = (
        in_proj
        + cd * arch.linear_conv_kernel_dim
        + 2 * nv
        + arch.linear_value_head_dim
        + arch.linear_v_dim * h
    )
    return mixer + 2 * h + 3 * h * f


def replicated_layer_params(arch: ModelArch, linear: bool) -> int:
    """Parameters of one layer that every TP rank holds whole (norms; GDN's out_norm; q/k norms; gpt-oss's o_proj
    bias: megatron's RowParallelLinear keeps its bias whole)."""
    if linear:
        return 2 * arch.hidden_size + arch.linear_value_head_dim
    assert arch.head_dim is not None
    if arch.multi_latent:
        return 2 * arch.hidden_size + mla_replicated_params(arch)
    bias = arch.hidden_size if arch.linear_bias else 0
    return 2 * arch.hidden_size + (2 * arch.head_dim if arch.qk_norm else 0) + bias


# --- FLOPs ----------------------------------------------------------------------------------------------------------
def attention_matmul_flops_per_token(arch: ModelArch) -> int:
    """Forward FLOPs of one token through a full-attention layer's matmuls (QKV incl. the gate, proj, SwiGLU)."""
    h, d, nq, g, f, q_rows = _attention_widths(arch)
    if arch.multi_latent:  # plan/mla.py
        return mla_matmul_flops_per_token(arch) + 2 * 3 * h * f
    return 2 * h * (q_rows + 2 * g * d) + 2 * nq * d * h + 2 * 3 * h * f


def gdn_matmul_flops_per_token(arch: ModelArch) -> int:
    """Forward FLOPs of one token through a GDN layer's projections (in_proj, out_proj) and its SwiGLU."""
    h = arch.hidden_size
    return (
        2 * h * sum(arch.gdn_in_proj_sections())
        + 2 * arch.linear_v_dim * h
        + 2 * 3 * h * arch.ffn_hidden_size
    )


def gdn_mixer_flops(arch: ModelArch, n: int, *, tp: int = 1) -> tuple[int, int]:
    """(forward, backward) FLOPs of the convolution and the chunked delta rule of ONE GDN layer over one sequence
    of n tokens on one TP rank (no initial state, no final state kept: how every schedule that runs a hybrid today
    runs it; module docstring)."""
    if n <= 0:
        return 0, 0
    dk, dv, K = arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_conv_kernel_dim
    heads = arch.linear_num_value_heads // tp
    cd = (2 * arch.linear_qk_dim + arch.linear_v_dim) // tp
    c = cdiv(n, CHUNK)
    small = 2 * CHUNK * dk * dv  # one [C, dk] x [dk, dv] product
    per_chunk = 3 * 2 * CHUNK**2 * dk + 2 * 2 * CHUNK**2 * dv + 3 * small
    rule = heads * c * per_chunk
    conv = 2 * cd * K * (n + K - 1)
    return conv + rule, 2 * conv + 2 * rule - 4 * heads * small


# --- saved activations ----------------------------------------------------------------------------------------------
def gdn_block(arch: ModelArch, *, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """(key heads, value heads) one rank runs the conv and rule for: its TP share, and under CP its head block
    (models/arch.py gdn_block_heads, the engine's split)."""
    return gdn_block_heads(arch.linear_num_key_heads // tp, arch.linear_num_value_heads // tp, cp)


def gdn_mixer_saved_bytes(arch: ModelArch, n: int, *, tp: int = 1, e: int = 2, kernel: str = "torch") -> int:
    """Bytes a GDN mixer (megatron's GatedDeltaNet between in_proj's output and out_proj's input, both projections'
    saved inputs included) saves for backward over one sequence of n tokens on one TP rank (module docstring)."""
    return gdn_heads_saved_bytes(arch, n, tp=tp, e=e, kernel=kernel) + gdn_rows_saved_bytes(
        arch, n, tp=tp, e=e
    )


def gdn_heads_saved_bytes(
    arch: ModelArch, n: int, *, tp: int = 1, cp: int = 1, e: int = 2, kernel: str = "torch"
) -> int:
    """The part of `gdn_mixer_saved_bytes` that runs per head along the whole sequence (conv, q/k and their L2
    norm, g, beta, the delta rule): under CP one rank's head block over every position (the head exchange)."""
    assert kernel in GDN_KERNELS, kernel
    if n <= 0:
        return 0
    nk, H = gdn_block(arch, tp=tp, cp=cp)
    dk, dv, K = arch.linear_key_head_dim, arch.linear_value_head_dim, arch.linear_conv_kernel_dim
    qk, vd = nk * dk, H * dv
    cd, f, p = 2 * qk + vd, 4, max(e, 4)
    outside = (
        cd * n * e  # conv1d input
        + cd * (n + K - 1) * e  # silu input (the padded conv output)
        + 2 * (n * qk * e + n * nk * e)  # q, k contiguous copies and their L2 rstd
        + 2 * n * H * p  # softplus input and output (g in float32, or the model dtype if wider)
        + n * H * e  # sigmoid(beta)
    )
    if kernel == "fla":
        return outside + n * H * ((2 * dk + dv + 1 + CHUNK) * e + f)
    c = cdiv(n, CHUNK)
    T, C = c * CHUNK, CHUNK
    rule = (
        H
        * T
        * (3 * dk + dk + dv + dv + 1)
        * f  # keys, scaled q, k*beta, k*beta*exp(g) | values, v*beta | beta
        + H * T * dk * f  # k_cumdecay
        + 4 * H * c * C * C * f  # exp of the decay, decay mask, k_beta.k^T, attention + identity
        + sum(i + i * i for i in range(1, C)) * H * c * f  # the triangular solve's row / block clones
        + H * c * C * f  # exp(g) per chunk
        + c * H * dk * dv * f  # the state entering each chunk
        + c * (2 * H * C * C + H * C * dv + H * C + H * C * dk) * f  # q.k^T, masked, v_new, exp, q*exp
        + (c - 1) * (H + H * C + H * C * dk) * f  # state updates that a later chunk reads
    )
    return outside + rule


def gdn_rows_saved_bytes(arch: ModelArch, r: int, *, tp: int = 1, e: int = 2) -> int:
    """The part of `gdn_mixer_saved_bytes` that runs per row over all of a TP rank's heads (the output gate, the
    gated norm, out_proj's input): under CP this rank's r rows."""
    H = arch.linear_num_value_heads // tp
    vd, f = H * arch.linear_value_head_dim, 4
    widened = e != 4  # gate.float() / silu in float32 make copies unless the model is float32
    return (
        r * vd * e
        + (r * vd * f if widened else 0)  # the output gate (and its float32 copy)
        + 3 * r * vd * e
        + r * H * f
        + (r * vd * f if widened else 0)  # gated norm: input, rstd, y, silu(gate)
        + r * vd * e  # out_proj's input
    )


def gdn_exchange_widths(arch: ModelArch, *, tp: int, cp: int) -> tuple[int, int, int]:
    """(in, out, conv) channels of one head block: what the head exchange carries to the tree ([q|k|v] of the
    block, beta, alpha) and back (the core output, H dv), and the block's conv channels."""
    nk, H = gdn_block(arch, tp=tp, cp=cp)
    conv = 2 * nk * arch.linear_key_head_dim + H * arch.linear_value_head_dim
    return conv + 2 * H, H * arch.linear_value_head_dim, conv


def gdn_exchange_saved_bytes(arch: ModelArch, r: int, *, tp: int, cp: int) -> int:
    """Indices the head exchange's gathers save per GDN layer and chunk of r local rows (models/gdn.py): the
    block channel map [W, in], the conv channels [W, conv], the value heads [W, H] (long), and the way back's
    row index [W, r] (long) and padding mask [W, r] (bool)."""
    if cp <= 1:
        return 0
    c_in, _, conv = gdn_exchange_widths(arch, tp=tp, cp=cp)
    _, H = gdn_block(arch, tp=tp, cp=cp)
    return 8 * cp * (c_in + conv + H) + 9 * cp * r


def gdn_exchange_buffer_bytes(arch: ModelArch, r: int, *, tp: int, cp: int, e: int) -> int:
    """Transient buffers of one GDN layer's head exchange (not saved, so the meter does not see them): the blocks
    sent, the blocks received and their tree-ordered copy, W r in-channels each."""
    if cp <= 1:
        return 0
    c_in, _, _ = gdn_exchange_widths(arch, tp=tp, cp=cp)
    return 3 * cp * r * c_in * e


def gdn_exchange_bytes(arch: ModelArch, r: int, *, tp: int, cp: int, e: int) -> int:
    """Bytes one rank sends in ONE GDN layer's forward over a chunk of r local rows per rank: (W - 1) blocks of
    r rows each way (parallel/head_exchange.py; backward sends as much again)."""
    if cp <= 1:
        return 0
    c_in, c_out, _ = gdn_exchange_widths(arch, tp=tp, cp=cp)
    return (cp - 1) * r * (c_in + c_out) * e


def attention_extra_saved_bytes(arch: ModelArch, r: int, *, n: int, g: int, e: int) -> int:
    """Per full-attention layer over r rows (n, g heads on this rank): what q/k norms and the output gate add to the
    plain layer's terms (plan/activations.py): the normalised q and k (RoPE's inputs) with their rstd, and the fused
    QKV output itself, (n + 2g) d per row, which the k norm keeps alive because its input is a view of it (the
    compact K/V of the plain layer does not free it then); with more than one query group on the rank also the
    query the q norm reads, n d per row: megatron's get_query_key_value_tensors reshapes the query it split out of
    [s, b, g, (n/g + 2) d] to [s, b, n, d], which copies (the g groups' query blocks are not evenly strided),
    and the norm saves its input (a view of the fused output when g = 1); the gated output and sigmoid(gate) in
    float32."""
    assert arch.head_dim is not None
    d, f32 = arch.head_dim, max(e, 4)
    extra = 0
    if arch.qk_norm:
        extra += r * (n + g) * d * e + r * (n + g) * f32 + r * (n + 2 * g) * d * e
        extra += r * n * d * e if g > 1 else 0
    if arch.attention_output_gate:
        extra += r * n * d * e + r * n * d * f32
    return extra
