"""The planner's Mamba-2 hybrids (Nemotron-H, Nemotron 3: `hybrid_override_pattern`, models/mamba.py): each layer is
its norm and ONE block, priced per block kind ("M" a Mamba-2 mixer, "*" attention, "-" a squared-ReLU MLP, "E"
megatron's MoELayer with squared-ReLU experts); plan/model.py, flops.py, activations.py and memory.py dispatch here
for such a model. Checked against the built tiny nemotron_h model (parameters), torch's FlopCounterMode (matmul
FLOPs, exact) and the activation meter (tests/unit/test_plan_mamba.py).

Shape legend (one TP rank): n tokens of one sequence (a segment), h hidden, H = mamba heads / t, P head width,
G = groups / t, N state size, di = H P, cd = di + 2 G N conv channels, pj = 2 di + 2 G N + H in_proj rows, K conv
kernel, Q = mamba_chunk_size the SSD chunk, c = ceil(n / Q) chunks, T = c Q (each segment padded to whole chunks),
e activation bytes, f = 4 (the scan computes in float32, transformers' mamba2_chunk_scan).

Parameters per block (each with its RMS norm, h):
    M   h pj + cd K (+ cd conv bias) + 3 H (dt_bias, A_log, D) + di (gated norm) + di h
    *   h (nq d + 2 g d) + nq d h                     (no bias, no q/k norm, no RoPE)
    -   2 h f                                          (up, down: squared ReLU, no gate)
    E   E h + E (router + correction bias) + E 2 h i + 2 h s   (routed experts and the shared expert ungated)

FLOPs (2 per multiply-add). Per token: each block's projections (M: 2 h pj + 2 di h). Per sequence, the M block's
causal conv 2 cd K (n + K - 1) (torch's conv1d pads K - 1 on both sides) and the SSD scan's einsums as
transformers' torch `mamba2_chunk_scan` computes them (the mixer's scan in every schedule, models/mamba.py: the
chunked state-space-duality algorithm of Dao & Gu 2024, "Transformers are SSMs", which mamba_ssm's kernels also
implement), per sequence of c chunks:
    C.B^T in each chunk  2 H c Q^2 N      (G = einsum bclhn,bcshn)
    (G * L) x            2 H c Q^2 P      (Y_diag)
    B^T x per chunk      2 H c Q P N      (the chunk states)
    chunk recurrence     2 H (c + 1)^2 P N (new_states = einsum bzch,bzhpn over the c + 1 chunk states)
    C . states           2 H c Q N P      (Y_off)
Backward: twice each (`mamba_scan_flops`; tests/unit/test_plan_mamba.py compares both with FlopCounterMode).

Saved for backward by an M block over one sequence of n rows on the tree path (models/mamba.py `_tree`; every
storage once, as the meter counts), besides its norm and in_proj's input (the layer terms):
    rows     in_proj's output n pj e (the conv's input and the gate z are views of it: kept whole), the gathered
             conv input n cd e, its conv output (silu's input) cd (n + K - 1) e, silu's output n cd e, dt's
             softplus input, output and the clamped dt 3 n H e + n H f, the valid mask and the gather index 9 n
    scan     (float32, padded to T) 5 T H P (the D residual's x, two einsum copies of x, C.states, the output)
             + 5 T H N (B repeated, four einsum copies of B / C) + 3 H c Q^2 (L, G, G * L) + 2 T H (decays)
             + (2 c + 1) H P N (the chunk states and their einsum copy) + H (c + 1)^2 + 2 Q^2 + 2 (c + 1)^2
    norm     silu(z), the gated product, the normalised output n di f, rstd n G f, y and out_proj's input 2 n di e
These are the torch path's (CPU, or a GPU without mamba_ssm): where mamba_ssm is installed, transformers' scan is its
mamba_chunk_scan_combined kernel (transformers wraps mamba2_chunk_scan for its kernel hub), which saves
far less and returns the final state as its own tensor: there these terms are an over-count (not measured here).

Under context parallelism (the head exchange: parallel/head_exchange.py, models/mamba_heads.py) a rank runs the
"scan" terms and the conv / dt part of "rows" for its block of heads (H / W heads of its TP rank with the groups they
read: `mamba_block`) over WHOLE segments, and in_proj's output and the "norm" terms over its own r rows for all its
TP rank's heads (the gate z stays home); the exchange saves its gathers' indices and sends, per M layer and chunk,
(W - 1) blocks of r rows each way: [x | B | C | dt] of the block in the activations' dtype, the scan's output back
in float32 (`mamba_exchange_*`; tests/distributed/test_plan_mamba_parallel.py checks the bytes against the
exchange's own count and the meter on both CP2 ranks). Each rank hands down the fork state of ITS heads.

Per-layer checkpointing (`recompute full`) rebuilds every layer, the - and E layers without a token mixer too
(models/layer_checkpoint.py: the context is attached to the layer itself), one at a time (`checkpointed_peak`).

The branch state a fork hands down per M layer (MAMBA_STATE): the SSM state H P N float32 and the conv tail, the
last K - 1 inputs, (K - 1) cd e; with its accumulator (float32 or wider: WideSum) in kv_grads. It is its own memory
term, `cached_ssm_state`, priced as what the engine keeps alive: models/mamba.py hands down a copy of the last
state (`own_state`), not the view of the scan's c + 1 chunk states, so the cache holds H P N float32 per fork
(`mamba_state_bytes`).
"""

from __future__ import annotations

from typing import Any

from megatron_branch.models.arch import ModelArch, gdn_block_heads
from megatron_branch.models.mamba_arch import conv_sections, d_inner, in_proj_sections

F32 = 4


def is_mamba_hybrid(arch: ModelArch) -> bool:
    """A hybrid_override_pattern model (nemotron_h): the planner prices it per block kind (this module)."""
    return arch.hybrid_override_pattern is not None


def kind_count(arch: ModelArch, kind: str) -> int:
    """Layers of one block kind ("M", "*", "-", "E")."""
    assert arch.hybrid_override_pattern is not None
    return arch.hybrid_override_pattern.count(kind)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- parameters -----------------------------------------------------------------------------------------------------
def mamba_block_params(arch: ModelArch) -> int:
    """An M layer: its norm and megatron's MambaMixer (in_proj, conv1d, dt_bias, A_log, D, gated norm, out_proj)."""
    h, di, cd, H = arch.hidden_size, d_inner(arch), sum(conv_sections(arch)), arch.mamba_num_heads
    conv = cd * arch.mamba_conv_kernel + (cd if arch.mamba_conv_bias else 0)
    return h + h * sum(in_proj_sections(arch)) + conv + 3 * H + di + di * h


def attention_block_params(arch: ModelArch) -> int:
    """A * layer: its norm, QKV and the output projection (Nemotron-H: no bias, no q/k norm)."""
    h, d, nq, g = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_query_groups
    assert d is not None
    return h + h * (nq + 2 * g) * d + nq * d * h


def relu2_expert_params(arch: ModelArch) -> int:
    """One routed expert: up and down (squared ReLU, no gate)."""
    return 2 * arch.hidden_size * arch.moe_ffn_hidden_size


def moe_block_params(arch: ModelArch) -> int:
    """An E layer without its routed experts: its norm, the router with its correction bias, the shared expert."""
    h, E = arch.hidden_size, arch.num_experts
    return h + E * (h + int(arch.moe_expert_bias)) + 2 * h * arch.shared_expert_ffn_hidden_size


def pattern_parameter_count(arch: ModelArch) -> dict[str, int]:
    """plan/model.py parameter_count's terms for a hybrid_override_pattern model: "layer" an attention block,
    "linear_layer" an M block, "mlp_layer" a - block, "moe_layer" an E block without its routed experts; the
    replicated ones (every TP rank holds them whole) are the norms and the routers (megatron's TopKRouter)."""
    h, V = arch.hidden_size, arch.vocab_size
    n = {k: kind_count(arch, k) for k in "M*-E"}
    mlp = h + 2 * h * arch.ffn_hidden_size
    moe = moe_block_params(arch) if n["E"] else 0
    experts = n["E"] * arch.num_experts * relu2_expert_params(arch)
    total = (
        V * h * (1 if arch.tie_word_embeddings else 2)
        + n["M"] * mamba_block_params(arch)
        + n["*"] * attention_block_params(arch)
        + n["-"] * mlp
        + n["E"] * moe
        + experts
        + h
    )
    router = arch.num_experts * (h + int(arch.moe_expert_bias))
    return {
        "embedding": V * h,
        "output": 0 if arch.tie_word_embeddings else V * h,
        "layer": attention_block_params(arch),
        "linear_layer": mamba_block_params(arch),
        "mlp_layer": mlp,
        "moe_layer": moe,
        "experts": experts,
        "active_experts": n["E"] * arch.moe_top_k * relu2_expert_params(arch),
        "final_norm": h,
        "total": total,
        "replicated": arch.num_layers * h + n["E"] * router + h,
    }


# --- FLOPs ----------------------------------------------------------------------------------------------------------
def pattern_matmul_flops_per_token(arch: ModelArch) -> int:
    """Forward FLOPs of one token through every block's matmuls (no attention scores, no scan, no output layer)."""
    h, d = arch.hidden_size, arch.head_dim
    assert d is not None
    n = {k: kind_count(arch, k) for k in "M*-E"}
    mamba = 2 * h * sum(in_proj_sections(arch)) + 2 * d_inner(arch) * h
    attention = (
        2 * h * (arch.num_attention_heads + 2 * arch.num_query_groups) * d
        + 2 * arch.num_attention_heads * d * h
    )
    mlp = 2 * 2 * h * arch.ffn_hidden_size
    moe = (
        2 * h * arch.num_experts
        + arch.moe_top_k * 2 * relu2_expert_params(arch)
        + 2 * 2 * h * arch.shared_expert_ffn_hidden_size
    )
    return n["M"] * mamba + n["*"] * attention + n["-"] * mlp + n["E"] * (moe if n["E"] else 0)


def mamba_scan_flops(arch: ModelArch, n: int, *, tp: int = 1) -> tuple[int, int]:
    """(forward, backward) FLOPs of ONE M layer's conv and SSD scan over one sequence of n tokens on one TP rank
    (the module docstring's five einsums and the conv)."""
    if n <= 0:
        return 0, 0
    H, P, N, Q = arch.mamba_num_heads // tp, arch.mamba_head_dim, arch.mamba_state_dim, arch.mamba_chunk_size
    cd, K = sum(conv_sections(arch)) // tp, arch.mamba_conv_kernel
    c = cdiv(n, Q)
    scan = 2 * H * c * Q * Q * (N + P) + 2 * 2 * H * c * Q * P * N + 2 * H * (c + 1) ** 2 * P * N
    conv = 2 * cd * K * (n + K - 1)
    return conv + scan, 2 * (conv + scan)


def scan_flops(arch: ModelArch, sequences: list[tuple[int, int]], *, backward: bool = True) -> float:
    """Conv + scan FLOPs of every M layer over `sequences` ((length, count) pairs)."""
    total = 0
    for length, count in sequences:
        fwd, bwd = mamba_scan_flops(arch, length)
        total += count * (fwd + (bwd if backward else 0))
    return float(kind_count(arch, "M") * total)


# --- saved activations ----------------------------------------------------------------------------------------------
def mamba_mixer_saved_bytes(arch: ModelArch, n: int, *, tp: int = 1, e: int = 4) -> int:
    """Bytes an M block's mixer saves over one sequence (segment) of n rows on one TP rank, in_proj's output
    included, in_proj's input not (the module docstring)."""
    return mamba_heads_saved_bytes(arch, n, tp=tp, e=e) + mamba_rows_saved_bytes(arch, n, tp=tp, e=e)


def mamba_block(arch: ModelArch, *, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """(groups, heads) one rank runs the conv and scan for: its TP share, and under CP its head block (models/arch.py
    gdn_block_heads with the groups as key heads: models/mamba_heads.py, the engine's split)."""
    return gdn_block_heads(arch.mamba_num_groups // tp, arch.mamba_num_heads // tp, cp)


def mamba_heads_saved_bytes(arch: ModelArch, n: int, *, tp: int = 1, cp: int = 1, e: int = 4) -> int:
    """The part of `mamba_mixer_saved_bytes` that runs per head along the whole sequence (the gathered conv input,
    conv, silu, dt, the tree's row index and mask, the scan): under CP one rank's head block over every position
    (the head exchange brings them)."""
    if n <= 0:
        return 0
    G, H = mamba_block(arch, tp=tp, cp=cp)
    P, N = arch.mamba_head_dim, arch.mamba_state_dim
    Q, K = arch.mamba_chunk_size, arch.mamba_conv_kernel
    cd = H * P + 2 * G * N
    c = cdiv(n, Q)
    T = c * Q
    rows = n * cd * e + cd * (n + K - 1) * e + n * cd * e + 3 * n * H * e + n * H * F32 + 9 * n
    scan = (
        F32 * (5 * T * H * P + 5 * T * H * N + 3 * H * c * Q * Q + 2 * T * H + (2 * c + 1) * H * P * N)
        + F32 * H * (c + 1) ** 2
        + 2 * Q * Q
        + 2 * (c + 1) ** 2
    )
    return rows + scan


def mamba_rows_saved_bytes(arch: ModelArch, r: int, *, tp: int = 1, e: int = 4) -> int:
    """The part of `mamba_mixer_saved_bytes` that runs per row over all of a TP rank's heads: in_proj's output (the
    gate z stays home under CP and keeps it whole) and the grouped gated norm: under CP this rank's r rows."""
    if r <= 0:
        return 0
    H, P, N, G = (arch.mamba_num_heads // tp, arch.mamba_head_dim, arch.mamba_state_dim,
                  arch.mamba_num_groups // tp)  # fmt: skip
    di = H * P
    pj = 2 * di + 2 * G * N + H
    return r * pj * e + 3 * r * di * F32 + r * G * F32 + 2 * r * di * e


# --- the head exchange under CP (parallel/head_exchange.py, models/mamba_heads.py) -----------------------------------
def mamba_exchange_widths(arch: ModelArch, *, tp: int, cp: int) -> tuple[int, int, int]:
    """(in, out, conv) channels of one head block: what the exchange carries to the tree ([x | B | C | dt] of the
    block: its conv channels and its heads' dt), what it carries back (the scan's output, H P, float32: the mixer
    hands the norm the scan's float32 output, models/mamba.py), and the block's conv channels."""
    G, H = mamba_block(arch, tp=tp, cp=cp)
    conv = H * arch.mamba_head_dim + 2 * G * arch.mamba_state_dim
    return conv + H, H * arch.mamba_head_dim, conv


def mamba_exchange_bytes(arch: ModelArch, r: int, *, tp: int, cp: int, e: int) -> int:
    """Bytes one rank sends in ONE M layer's forward over a chunk of r local rows per rank: (W - 1) blocks of r rows
    each way, [x | B | C | dt] at the activations' e bytes there, the scan's output in float32 back (backward sends
    as much again: the same all-to-all of the gradients)."""
    if cp <= 1:
        return 0
    c_in, c_out, _ = mamba_exchange_widths(arch, tp=tp, cp=cp)
    return (cp - 1) * r * (c_in * e + c_out * F32)


def mamba_exchange_saved_bytes(arch: ModelArch, r: int, *, tp: int, cp: int) -> int:
    """Indices the exchange's gathers save per M layer and chunk of r local rows (models/mamba.py): the block channel
    map [W, in], the conv channels [W, conv] and the heads [W, H] (the storages the rank's rows of them view; long),
    and the way back's row index [W, r] (long) and padding mask [W, r] (bool)."""
    if cp <= 1:
        return 0
    c_in, _, conv = mamba_exchange_widths(arch, tp=tp, cp=cp)
    _, H = mamba_block(arch, tp=tp, cp=cp)
    return 8 * cp * (c_in + conv + H) + 9 * cp * r


def mamba_exchange_buffer_bytes(arch: ModelArch, r: int, *, tp: int, cp: int, e: int) -> int:
    """Transient buffers of one M layer's exchange (not saved: the meter does not see them): the blocks sent, the
    blocks received and their tree-ordered copy, W r channels each, the larger of the way there and back."""
    if cp <= 1:
        return 0
    c_in, c_out, _ = mamba_exchange_widths(arch, tp=tp, cp=cp)
    return 3 * cp * r * max(c_in * e, c_out * F32)


def mamba_state_bytes(dm: Any) -> int:
    """Per M layer: what the state a fork hands down keeps alive (dm: plan/activations.Dims): the conv's last K - 1
    inputs, and the SSM state H P N float32, which models/mamba.py hands down as its own copy (`own_state`: not the
    view of the scan's chunk states, whose storage grows with the parent's length) (measured:
    tests/unit/test_plan_mamba.py)."""
    a = dm.arch
    H, cd = _state_widths(dm)
    return H * a.mamba_head_dim * a.mamba_state_dim * F32 + (a.mamba_conv_kernel - 1) * cd * dm.e


def mamba_state_grad_bytes(dm: Any) -> int:
    """Per M layer: the accumulator of the state a fork hands down, H P N + (K - 1) cd (float32 or wider:
    WideSum): the cached leaf's own shape."""
    a = dm.arch
    H, cd = _state_widths(dm)
    return H * a.mamba_head_dim * a.mamba_state_dim * F32 + (a.mamba_conv_kernel - 1) * cd * dm.f32


def _state_widths(dm: Any) -> tuple[int, int]:
    """(heads, conv channels) of the state one rank hands down: its TP share, under CP its head block's (each rank
    caches the state of ITS heads, models/mamba.py)."""
    a = dm.arch
    if dm.cp <= 1:
        return a.mamba_num_heads // dm.tp, sum(conv_sections(a)) // dm.tp
    _, _, conv = mamba_exchange_widths(a, tp=dm.tp, cp=dm.cp)
    return mamba_block(a, tp=dm.tp, cp=dm.cp)[1], conv


def _norm_bytes(dm: Any, r: int) -> int:
    """One RMS norm over r rows and the next linear's input (its output): input, rstd, x * rstd, output."""
    rn = dm.seq_rows(r)
    return 2 * rn * dm.h * dm.e + rn * dm.f32 + rn * dm.h * dm.e


def block_bytes(dm: Any, kind: str, r: int, sequences: list[tuple[int, int]], *, moe: int = 0) -> int:
    """What one layer of `kind` saves for backward over r local rows made of `sequences` (its own K/V, for "*",
    are the caller's `kv`; `moe`: plan/activations.py moe_mlp_bytes over r rows, for "E")."""
    if kind == "M":
        a = dm.arch
        heads = sum(
            count * mamba_heads_saved_bytes(a, n, tp=dm.tp, cp=dm.cp, e=dm.e) for n, count in sequences
        )
        rows = mamba_rows_saved_bytes(a, r, tp=dm.tp, e=dm.e) + mamba_exchange_saved_bytes(
            a, r, tp=dm.tp, cp=dm.cp
        )
        return _norm_bytes(dm, r) + heads + rows
    if kind == "*":  # q, the output, lse (no RoPE: position_embedding none)
        return _norm_bytes(dm, r) + 2 * r * dm.n * dm.d * dm.e + dm.n * r * dm.f32
    if kind == "-":  # fc1's output (squared ReLU's input) and fc2's input
        return _norm_bytes(dm, r) + 2 * r * dm.f * dm.e
    assert kind == "E", kind
    # megatron's MoELayer with squared-ReLU experts: moe_mlp_bytes' SwiGLU terms (6 i per routed row, 5 s per row)
    # become fc1's output, the activation's output and fc2's input (3 i), with the probability (f32) per routed row,
    # and 2 s for the shared expert (measured: tests/unit/test_plan_mamba.py); the norm's output is the router's input
    k = dm.top_k
    relu2 = moe - 3 * r * k * dm.i * dm.e + r * k * dm.f32 - 3 * r * dm.shared * dm.e
    rn = dm.seq_rows(r)
    return 2 * rn * dm.h * dm.e + rn * dm.f32 + relu2


def checkpointed_peak(dm: Any, r: int, per_kind: dict[str, int], *, kv: int, head: int) -> tuple[int, int]:
    """(held, peak) of a chunk under per-layer checkpointing (models/layer_checkpoint.py): every layer, M, *, - and
    E alike (the context is attached to the layer itself, mixer or not), keeps only its input and is rebuilt in
    backward, one at a time, last layer first. held: every kept input, with the head; the peak: that, or, while
    layer j is rebuilt, the kept inputs of the layers before j and j's graph (its first norm saves its kept input:
    one storage)."""
    layer_input = dm.seq_rows(r) * dm.h * dm.e
    before, peak = 0, 0  # what the layers before j keep
    for kind in dm.arch.hybrid_override_pattern:
        peak = max(peak, before + per_kind[kind] + (kv if kind == "*" else 0))
        before += layer_input
    return before + head, max(before + head, peak)


def pattern_chunk_saved_bytes(
    dm: Any,
    r: int,
    sequences: list[tuple[int, int]],
    *,
    head: int,
    kv: int,
    moe: int,
    layer_recompute: bool = False,
    capture: bool = False,
) -> dict[str, int]:
    """plan/activations.py chunk_saved_bytes for a hybrid_override_pattern model over r local rows made of
    `sequences`, given that module's terms over them (`head`: the head's bytes, `kv`: one layer's K/V, `moe`: one
    MoE slot's): "kv" the attention blocks' K/V, "other" the rest with the head, "held" what the chunk keeps until
    its backward (per-layer checkpointing: the layers' inputs and the head; one rebuilt layer at a time)."""
    kinds = {k: kind_count(dm.arch, k) for k in "M*-E" if kind_count(dm.arch, k)}
    per_kind = {k: block_bytes(dm, k, r, sequences, moe=moe) for k in kinds}
    if layer_recompute:
        held, other = checkpointed_peak(dm, r, per_kind, kv=kv, head=head)
        return {"kv": kinds.get("*", 0) * kv if capture else 0, "other": other, "held": held}
    other = sum(kinds[k] * per_kind[k] for k in kinds) + head
    return {"kv": kinds.get("*", 0) * kv, "other": other, "held": other}
