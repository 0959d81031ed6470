"""The bytes one chunk saves for backward on one rank, per layer and term: what THIS engine keeps alive, counted
from its code, one storage counted once, exactly as the activation meter (megatron_branch/memory.py) counts
them, and the transient buffers beside them the meter does not see (ring blocks, the head exchange, the logits
chunks, the MoE dispatcher). The step's peak over these chunks, and the static terms: plan/memory.py.

Saved per transformer layer for r rows on this rank (tp t, sp: sequence parallel, e: activation bytes, f32:
max(e, 4) for statistics the kernels keep in fp32; n = heads/t, g = kv heads/t, d head dim, h hidden, f ffn/t),
read off megatron-core 0.16's local spec with this engine's core attention (checked by tests/unit/test_plan.py):
    norms (x2)        input x, rstd, x * rstd          2 * (2 r_n h e + r_n f32)     r_n = r / t under SP
    QKV, fc1 inputs   the norm outputs                 2 * r_n h e                   (SP: saved before gather;
                                                                                     MoE: fc1's is the router's)
    RoPE              cos / sin for q and for k        4 r d e
    attention         q (rotated), out, lse            r n d e * 2 + n r f32
    K/V               k (rotated) and v, each in a storage of its own (the contexts copy V out of the fused
                      QKV output, attention/prefix_state.compact)       2 r g d e
    MLP (SwiGLU)      fc1 out, silu out, product, ...  5 r f e
Under CP (ring attention) the same: the ring saves the local blocks in place and nothing of its own. These are
Korthikanti et al. (2022)'s per-layer terms for THIS
implementation: no score matrix (fused kernels), no dropout masks (dropout is 0), SwiGLU instead of GeLU.

A MoE layer (megatron's MoELayer, alltoall dispatcher; E experts, top-k, expert width i = I/t, shared expert
width s_h = S/t; balanced routing assumed) saves instead of the dense MLP's 5 r f e, for r_n router rows:
    router            its input, fp32 scores, probs      r_n h e + r_n E f32 + r_n E e
    permute           its indices (the permuted copy is saved as the experts' input: counted there)   r_n k INDEX
    experts           the r k rows this rank's experts run after the all-to-all and the TP gather (SwiGLU's
                      fc1 input, its 5 intermediates, and megatron's MLP scaling the GLU output by each row's
                      probability: that output and the probabilities)             r k h e + 6 r k i e + r k f32
                      (expert TP 1 at t > 1, every expert whole on each TP rank: no TP gather, the rank runs its
                      own r_n rows through whole experts, i = I: r_n k h e + 6 r_n k I e + r_n k f32; megatron's
                      alltoall dispatcher gathers over the experts' TP group, token_dispatcher.py, 0.16.1)
                      (gpt-oss's clamped GLU keeps one more i per row: 7 r k i e; `expert_glu_saved_widths`)
    combine           unpermute's probs and indices      r_n k (e + INDEX)
    shared expert     a SwiGLU of width s_h               5 r s_h e
                      (+ its sigmoid gate: megatron's output * gate saves both)    + r_n h e + r_n e
and the dispatcher's transient buffers (not saved; the largest layer's): the all-to-all's send and receive copies
and the TP-gathered rows, 2 r_n k h e + r k h e (expert TP 1: r_n rows, nothing gathered).

Replay keeps, for the cached ancestors on the current root-to-leaf path, their K/V (the two compact storages above:
the cache is detached views of them, 2 g d e per row and layer, nothing else kept alive) and a dK/dV accumulator per
cached row and layer (2 g d e, the leaves' .grad; for bf16 / fp16 leaves an fp32 sum, 2 g d 4: precision.py).

Family extras and hybrids (plan/layers.py has the formulas and their sources): q/k norms and the output gate add
to a full-attention layer, partial RoPE saves cos/sin of the rotated dims only; a gated delta net layer saves its
two norms, in_proj's and fc1's inputs and the MLP like an attention layer, and instead of RoPE, attention and K/V
its mixer's tensors per sequence (`gdn_kernel`: "torch", megatron's torch_chunk_gated_delta_rule, measured here;
"fla" on GPU, from fla's source). No K/V: a GDN layer's prefix is a fixed-size state, H dk dv float32 plus the
convolution's last K - 1 inputs (cd e), which replay hands down at each fork (models/gdn.py, the GDN_STATE kind of
the prefix cache) with a gradient accumulator of the same size (tests/unit/test_plan_hybrid.py: the replay step
against the meter, the cache's bytes exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.layers import (
    attention_extra_saved_bytes,
    gdn_block,
    gdn_exchange_buffer_bytes,
    gdn_exchange_saved_bytes,
    gdn_exchange_widths,
    gdn_heads_saved_bytes,
    gdn_rows_saved_bytes,
)
from megatron_branch.plan.mamba import mamba_exchange_buffer_bytes, pattern_chunk_saved_bytes
from megatron_branch.plan.mla import mla_kv_bytes, mla_latent_row_bytes, mla_other_bytes
from megatron_branch.plan.model import Layout

INDEX_BYTES = 8  # int64 token ids / indices


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def local_rows(length: int, count: int, layout: Layout) -> int:
    """Rows one CP rank holds for `count` segments of `length` tokens (zigzag: 2 equal padded pieces per segment),
    padded to a multiple of TP under sequence parallel (parallel/cp_layout.py, schedule/chunks.py)."""
    if layout.cp == 1:
        r = length * count
    else:
        r = count * 2 * cdiv(length, 2 * layout.cp)
    return cdiv(r, layout.tp) * layout.tp if layout.sp else r


@dataclass(frozen=True, kw_only=True)
class Dims:
    """The per-rank widths the formulas use."""

    h: int
    d: int
    n: int  # query heads on this TP rank
    g: int  # kv heads on this TP rank (replicated when tp > kv heads)
    f: int  # ffn width on this TP rank
    v: int  # vocabulary slice on this TP rank
    layers: int
    tp: int
    sp: bool
    e: int  # activation bytes
    f32: int  # statistics bytes (max(e, 4))
    arch: ModelArch  # the family's extras and a hybrid's layer kinds (plan/layers.py)
    gdn_kernel: str = "fla"  # a GDN layer's delta-rule kernel: "fla" (GPU) or "torch"
    pp: int = 1  # pipeline stages: this rank holds num_layers / pp of them (plan/pipeline.py)
    head: bool = True  # this rank's stage holds the final norm and the output layer (the last stage)
    cp: int = 1  # context parallel size: a GDN layer runs its head block over whole sequences
    latent: bool = False  # MLA's compact prefix cache (one rank per CP group; the ring carries per-head K/V)

    stage: int | None = None  # under PP, the stage whose layers these are (None: an even share of each kind)

    @property
    def attn_layers(self) -> int:
        """Full-attention layers on this rank's stage (all of them unless hybrid): the ones with K/V, RoPE and a
        ring under CP; a Mamba hybrid's "*" blocks, plan/mamba.py)."""
        if self.arch.hybrid_override_pattern is not None:
            return self.arch.hybrid_override_pattern.count("*") // self.pp
        if self.stage is not None:  # a GDN hybrid's stage: its own layers' kinds (megatron's even split)
            return self.layers - self.linear_layers
        return self.arch.num_full_layers // self.pp

    @property
    def linear_layers(self) -> int:
        if self.stage is not None and self.arch.hybrid_override_pattern is None:
            first = self.stage * self.layers
            return sum(self.arch.is_linear(i) for i in range(first, first + self.layers))
        return self.arch.num_linear_layers // self.pp

    moe_layers: int = 0  # MoE layers (the rest are dense), of either mixer kind
    experts: int = 0  # E
    top_k: int = 0
    i: int = 0  # routed expert width on this rank (I / expert TP)
    shared: int = 0  # shared expert width on this TP rank
    etp: int = (
        1  # the experts' tensor-parallel size (layout.expert_tp: tp, or 1 with whole experts on each rank)
    )

    @classmethod
    def of(cls, arch: ModelArch, layout: Layout, act_bytes: int, *, gdn_kernel: str = "fla") -> Dims:
        t = layout.tp
        assert arch.head_dim is not None
        return cls(
            moe_layers=len(arch.moe_layers),
            experts=arch.num_experts,
            top_k=arch.moe_top_k,
            i=arch.moe_ffn_hidden_size // layout.expert_tp,
            etp=layout.expert_tp,
            shared=arch.shared_expert_ffn_hidden_size // t,
            h=arch.hidden_size,
            d=arch.head_dim,
            n=arch.num_attention_heads // t,
            g=max(1, arch.num_query_groups // t),
            f=arch.ffn_hidden_size // t,
            v=arch.padded_vocab_size(t) // t,
            layers=arch.num_layers // layout.pp,
            tp=t,
            sp=layout.sp,
            e=act_bytes,
            f32=max(act_bytes, 4),
            arch=arch,
            gdn_kernel=gdn_kernel,
            pp=layout.pp,
            cp=layout.cp,
            latent=arch.multi_latent and layout.cp == 1,
        )

    @property
    def moe_attn_layers(self) -> int:
        """MoE layers among the full-attention ones (a MoE hybrid has MoE blocks after GDN layers too)."""
        return sum(1 for i in self.arch.moe_layers if not self.arch.is_linear(i)) if self.moe_layers else 0

    @property
    def moe_linear_layers(self) -> int:
        """MoE layers among the GDN ones."""
        return self.moe_layers - self.moe_attn_layers

    def seq_rows(self, r: int) -> int:
        """Rows of a sequence-sharded tensor (SP shards the norms and linear inputs over TP)."""
        return r // self.tp if self.sp else r

    def expert_rows(self, r: int) -> int:
        """Rows a rank's routed experts see per top-k slot: all r, gathered over the experts' TP group, or with
        whole experts on each TP rank (expert TP 1 < tp) the rank's own sequence shard (module docstring)."""
        return r if self.etp > 1 else self.seq_rows(r)


def layer_kv_bytes(dm: Dims, r: int) -> int:
    """Per layer: the compact K and V storages of r rows (alive while K/V are cached or saved)."""
    if dm.arch.multi_latent:  # n (d + rr) keys and n dv values per row (plan/mla.py)
        return mla_kv_bytes(dm, r)
    return 2 * r * dm.g * dm.d * dm.e


def layer_cache_bytes(dm: Dims, rows: int) -> int:
    """Per layer: what replay's prefix cache holds for `rows` cached rows: their K/V, or MLA's latent
    (`cached_latent`, plan/mla.py)."""
    return rows * mla_latent_row_bytes(dm) if dm.latent else layer_kv_bytes(dm, rows)


def moe_mlp_bytes(dm: Dims, r: int) -> int:
    """What a MoE layer's MLP slot saves for backward over r rows (the module docstring's MoE terms)."""
    rn, k = dm.seq_rows(r), dm.top_k
    router = rn * dm.h * dm.e + rn * dm.experts * (dm.f32 + dm.e)
    permute = rn * k * INDEX_BYTES  # index_select saves its index; the copy it makes is the experts' input
    x = dm.expert_rows(r)
    experts = x * k * dm.h * dm.e + expert_glu_saved_widths(dm.arch) * x * k * dm.i * dm.e + x * k * dm.f32
    combine = rn * k * (dm.e + INDEX_BYTES)
    shared = 5 * r * dm.shared * dm.e if dm.shared else 0
    if dm.shared and dm.arch.shared_expert_gate:  # output * sigmoid(gate) saves both factors
        shared += rn * dm.h * dm.e + rn * dm.e
    return router + permute + experts + combine + shared


def expert_glu_saved_widths(arch: ModelArch) -> int:
    """Widths i one routed row saves between fc1's output and fc2's input: megatron's MLP.forward on the local
    path (transformer/mlp.py `glu`, then the row's probability scaling, `per_token_scale`).
    SwiGLU: fc1's output (2i, silu's input is a view of it), silu's output and up + glu_linear_offset (the
    product's factors: the sum is a new tensor even for offset 0), the product and the scaled product (fc2's
    input): 6.
    gpt-oss's clamped GLU (`activation_func_clamp_value`, quick_gelu, glu_linear_offset 1): fc1's output (2i, the
    clamps' input), the clamped gate (quick_gelu's one saved input: it is megatron's `jit_fuser`, torch.compile,
    whose backward recomputes the sigmoid), the activation and the clamped up + 1 (the product's factors), the
    product and the scaled product: 7. Eager, quick_gelu keeps its sigmoid too (8): where dynamo skips the frame,
    e.g. for good once it ran under a TorchDispatchMode such as FlopCounterMode (torch/_dynamo/convert_frame.py)."""
    return 7 if arch.swiglu_limit is not None else 6


def dispatcher_bytes(dm: Dims, r: int) -> int:
    """Transient all-to-all / TP-gather buffers of one MoE layer over r rows (0 for a dense model)."""
    if not dm.moe_layers:
        return 0
    rn = dm.seq_rows(r)
    return 2 * rn * dm.top_k * dm.h * dm.e + dm.expert_rows(r) * dm.top_k * dm.h * dm.e


def stack_other_bytes(dm: Dims, r: int, *, ext: int = 0, cp: int = 1) -> int:
    """`layer_other_bytes` over every full-attention layer: the dense ones and the MoE ones."""
    dense = dm.attn_layers - dm.moe_attn_layers
    out = dense * layer_other_bytes(dm, r, ext=ext, cp=cp)
    if dm.moe_attn_layers:
        out += dm.moe_attn_layers * layer_other_bytes(dm, r, ext=ext, cp=cp, moe=True)
    return out


def layer_other_bytes(dm: Dims, r: int, *, ext: int = 0, cp: int = 1, moe: bool = False) -> int:
    """Per layer: everything else a layer saves for backward over r rows (ext cached rows it attends to); `moe`:
    a MoE layer (its MLP slot: `moe_mlp_bytes`)."""
    rn = dm.seq_rows(r)
    norms = 2 * (2 * rn * dm.h * dm.e + rn * dm.f32)
    mlp = moe_mlp_bytes(dm, r) if moe else 5 * r * dm.f * dm.e
    if dm.arch.multi_latent:  # its attention part (plan/mla.py) with fc1's input, the norms and the MLP
        return norms + (0 if moe else rn * dm.h * dm.e) + mla_other_bytes(dm, r, ext=ext) + mlp
    # QKV's input and fc1's; a MoE layer's MLP input is its router's (counted in moe_mlp_bytes)
    linear_in = (1 if moe else 2) * rn * dm.h * dm.e
    rope = 4 * r * dm.arch.rotary_dim * dm.e
    attn = 2 * r * dm.n * dm.d * dm.e + dm.n * r * dm.f32
    attn += attention_extra_saved_bytes(dm.arch, r, n=dm.n, g=dm.g, e=dm.e)
    # under CP the ring saves what one rank's executor saves: q, the output, lse and the local K/V blocks in place
    # (no concatenated copy of the cached ancestors, no separate output copy, no metadata; parallel/ring.py)
    return norms + linear_in + rope + attn + mlp


def linear_layer_bytes(
    dm: Dims, r: int, sequences: list[tuple[int, int]] | None = None, *, moe: bool = False
) -> int:
    """Per GDN layer over r local rows made of `sequences` ((length, count) of the WHOLE segments; default one
    sequence of r): the attention layer's norms, linear inputs and MLP (`moe`: a MoE layer's, `moe_mlp_bytes`), and
    the mixer's tensors (plan/layers.py): its per-head part per sequence, for this rank's head block under CP (the
    head exchange runs it over every position), its per-row part over the r rows, and the exchange's indices."""
    rn = dm.seq_rows(r)
    mlp = moe_mlp_bytes(dm, r) if moe else 5 * r * dm.f * dm.e
    linear_in = (1 if moe else 2) * rn * dm.h * dm.e  # in_proj's and fc1's (MoE: the router's, in `mlp`)
    norms_in_mlp = 2 * (2 * rn * dm.h * dm.e + rn * dm.f32) + linear_in + mlp
    heads = sum(
        count * gdn_heads_saved_bytes(dm.arch, length, tp=dm.tp, cp=dm.cp, e=dm.e, kernel=dm.gdn_kernel)
        for length, count in (sequences or [(r, 1)])
    )
    rows = gdn_rows_saved_bytes(dm.arch, r, tp=dm.tp, e=dm.e)
    return norms_in_mlp + heads + rows + gdn_exchange_saved_bytes(dm.arch, r, tp=dm.tp, cp=dm.cp)


def linear_state_bytes(dm: Dims) -> int:
    """Per GDN layer: the prefix state a fork hands down, H dk dv float32 + the last K - 1 conv inputs (under CP
    this rank's head block: each rank caches the state of its heads)."""
    a = dm.arch
    _, heads = gdn_block(a, tp=dm.tp, cp=dm.cp)
    _, _, cd = gdn_exchange_widths(a, tp=dm.tp, cp=dm.cp)
    return (
        heads * a.linear_key_head_dim * a.linear_value_head_dim * 4
        + (a.linear_conv_kernel_dim - 1) * cd * dm.e
    )


def exchange_buffer_bytes(dm: Dims, rows: int) -> int:
    """Transient head-exchange buffers of one GDN or M layer over `rows` local rows (0 without such layers or
    CP)."""
    if dm.arch.hybrid_override_pattern is not None:  # a Mamba hybrid's M layers (plan/mamba.py)
        return mamba_exchange_buffer_bytes(dm.arch, rows, tp=dm.tp, cp=dm.cp, e=dm.e)
    if not dm.linear_layers:
        return 0
    return gdn_exchange_buffer_bytes(dm.arch, rows, tp=dm.tp, cp=dm.cp, e=dm.e)


def head_bytes(dm: Dims, r: int, m: int) -> int:
    """Embedding indices, final norm, and the fused output projection + logprob over m target rows (a pipeline
    stage without the output layer: the indices only)."""
    rn = dm.seq_rows(r)
    embed = r * INDEX_BYTES
    if not dm.head:
        return embed
    norm = 2 * rn * dm.h * dm.e + rn * dm.f32
    # index_select saves its index; the fused logprob saves the selected hidden rows, target idx, mask, lse;
    # the objective saves its per-target weights
    logprob = m * INDEX_BYTES + m * dm.h * dm.e + m * INDEX_BYTES + m + m * dm.f32 + m * dm.e
    return embed + norm + logprob


def chunk_saved_bytes(
    dm: Dims,
    r: int,
    m: int,
    *,
    ext: int = 0,
    cp: int = 1,
    layer_recompute: bool = False,
    capture: bool = False,
    sequences: list[tuple[int, int]] | None = None,
) -> dict[str, int]:
    """Bytes a chunk of r local rows (m local targets) holds for backward: its own K/V part and the rest.

    With `layer_recompute` (per-layer activation checkpointing, models/layer_checkpoint.py) a layer keeps only its
    input: "other" is then the chunk's peak in its own backward, every layer's input plus the larger of the head's
    saved tensors (released before the last layer is rebuilt) and one rebuilt layer; "held" what it keeps while
    it waits for its backward (inputs + head); "kv" the K/V a capturing chunk (replay's inner segment) keeps
    outside autograd for its backward, whose gradient the children send (0 for a chunk that captures nothing).
    A Mamba hybrid's layers are priced per block kind (plan/mamba.py).
    """
    if dm.arch.hybrid_override_pattern is not None:
        return pattern_chunk_saved_bytes(
            dm, r, sequences or [(r, 1)], head=head_bytes(dm, r, m), kv=layer_kv_bytes(dm, r),
            moe=moe_mlp_bytes(dm, r) if dm.moe_layers else 0, layer_recompute=layer_recompute, capture=capture,
        )  # fmt: skip
    dense_linear = dm.linear_layers - dm.moe_linear_layers
    linear = linear_layer_bytes(dm, r, sequences) if dense_linear else 0
    moe_linear = linear_layer_bytes(dm, r, sequences, moe=True) if dm.moe_linear_layers else 0
    if layer_recompute:
        layer_input = dm.seq_rows(r) * dm.h * dm.e
        inputs = dm.layers * layer_input
        # a rebuilt layer's first norm saves the layer's input again: the same storage as the kept input, so it
        # is not counted twice (the meter counts storages)
        one_layer = (
            max(
                layer_kv_bytes(dm, r) + layer_other_bytes(dm, r, ext=ext, cp=cp, moe=dm.moe_attn_layers > 0)
                if dm.attn_layers
                else 0,
                linear,
                moe_linear,
            )
            - layer_input
        )
        head = head_bytes(dm, r, m)
        return {
            "kv": dm.attn_layers * layer_cache_bytes(dm, r) if capture else 0,
            "other": inputs + max(head, one_layer),
            "held": inputs + head,
        }
    other = (
        stack_other_bytes(dm, r, ext=ext, cp=cp)
        + dense_linear * linear
        + dm.moe_linear_layers * moe_linear
        + head_bytes(dm, r, m)
    )
    kv = dm.attn_layers * layer_kv_bytes(dm, r)
    # a capturing chunk's K/V are the cache's storage, except under MLA's latent cache: its graph holds them too
    return {"kv": kv, "other": other, "held": other + (kv if capture and dm.latent else 0)}


def kv_grad_bytes(dm: Dims, rows: int) -> int:
    """dK/dV accumulators for `rows` cached rows, all layers: the cached leaves' .grad in their dtype, or for bf16 /
    fp16 leaves an fp32 sum (schedule/prefix_cache.py WideSum): f32 = max(e, 4) bytes per value. MLA: the
    latent's (or its per-head K/V's under CP) widths."""
    if dm.arch.multi_latent:
        return dm.attn_layers * layer_cache_bytes(dm, rows) // dm.e * dm.f32
    return dm.attn_layers * 2 * rows * dm.g * dm.d * dm.f32


def linear_state_grad_bytes(dm: Dims) -> int:
    """Per GDN layer: the accumulator of the state a fork hands down (both parts fp32 or wider: WideSum)."""
    a = dm.arch
    cd = (2 * a.linear_qk_dim + a.linear_v_dim) // dm.tp
    heads = a.linear_num_value_heads // dm.tp
    return (
        heads * a.linear_key_head_dim * a.linear_value_head_dim * 4
        + (a.linear_conv_kernel_dim - 1) * cd * dm.f32
    )


def ring_buffer_bytes(dm: Dims, rows: int, keys: int, cp: int) -> int:
    """Transient ring buffers of one layer (not saved, so the meter does not see them): the K/V block computed on
    and the one in flight; in backward also their fp32 dK/dV accumulators and the fp32 dQ accumulator."""
    if cp == 1:
        return 0
    block = 2 * keys * dm.g * dm.d  # k and v stacked: one message
    forward = 2 * block * dm.e
    backward = 2 * block * (dm.e + 4) + rows * dm.n * dm.d * 4
    return max(forward, backward)


def logits_bytes(dm: Dims, m: int, chunk_rows: int) -> int:
    """Transient buffers of the fused output projection + logprob (losses/fused_logprobs.py): two row chunks of
    logits in fp32 (logits and their exp / softmax and its gradient), the fp32 weight-gradient accumulator and the
    fp32 hidden-gradient; the meter does not see them (not saved). None on a stage without the output layer."""
    if not dm.head:
        return 0
    rows = min(m, chunk_rows)
    return 2 * rows * dm.v * dm.f32 + dm.v * dm.h * dm.f32 + m * dm.h * dm.f32
