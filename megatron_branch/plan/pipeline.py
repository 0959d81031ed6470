"""The planner's pipeline-parallel terms: a stage's parameters, the heavier stage's peak, the pipeline bubble and
the stage-to-stage messages in the step time, and which parallel axes cross nodes.

The stages as the engine runs them (schedule/pipeline.py; megatron's even split): stage r holds L/pp consecutive
layers, the first stage the embedding, the last the final norm and the output layer (with tied embeddings the last
stage holds a copy, so both end stages hold vocab x h). A rank's memory is its stage's: the planner reports the
heavier of the first and the last stage (the middle ones hold less than both), for a gated-delta-net hybrid the
heaviest of all (each stage's layers priced by kind: a middle stage may hold dearer ones).

Alive micro-batches (memory): megatron's 1F1B order keeps pp - r micro-batches of a wave in flight on stage r
(the first stage the most), so the first stage holds min(pp, M) leaf micro-batches' activations beside the root's
graph and cache; the last stage one, plus the output layer's transient buffers.

Time, per DP replica (every stage of it busy only while its chunk passes): with t = a chunk's per-stage time (its
FLOPs / (tp cp pp) / the assumed rate),
    replay, per prompt group  the root's forward and backward cross the stages one after another (pp t_root
                              instead of t_root) and its M = ceil(G / b) leaf micro-batches flow as one wave in 1F1B
                              ((M + pp - 1) t_leaf instead of M t_leaf): bubble (pp - 1)(t_root + t_leaf)
    replay, root pieces k     the root cut into a chain of k sequence pieces (data/pieces.py) that flow through the
                              stages like micro-batches, forward in order and backward in reverse; each piece costs
                              every stage the same time t_j, so each direction is a proportionate flow shop, whose
                              makespan is sum_j t_j + (pp - 1) max_j t_j: bubble (pp - 1)(max_j t_j + t_leaf). The
                              last piece is the dearest for a long root (it attends to every earlier token, and the
                              root's loss rows are its own), so k pieces cut the root's share of the bubble to a
                              little more than 1/k
    packed                    the DP rank's n groups as one wave: bubble (pp - 1) t_group
    messages                  every chunk's hidden states [rows, h] cross each stage boundary forward and their
                              gradient backward, counted as exposed (megatron's non-interleaved schedule waits
                              on them), at the node-to-node link when the pipeline spans nodes.
Nodes: megatron lays ranks out tp fastest, then cp, dp, pp (parallel_state's default order "tp-cp-ep-dp-pp"), so
an axis's group spans nodes when its stride times its size exceeds the GPUs of a node.
"""

from __future__ import annotations

from megatron_branch.data.pieces import piece_lengths
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.activations import cdiv, local_rows
from megatron_branch.plan.flops import (
    LOGITS_MATMULS,
    StepFlops,
    attention_flops,
    layer_matmul_flops_per_token,
    logits_flops_per_row,
)
from megatron_branch.plan.layers import (
    attention_layer_params,
    expert_params,
    gdn_layer_params,
    replicated_layer_params,
)
from megatron_branch.plan.model import GPU, Layout, RolloutShape, parameter_count

AXES = ("tp", "cp", "dp", "pp")
"""megatron's rank order, fastest first (parallel_state.initialize_model_parallel, order "tp-cp-ep-dp-pp")."""


def crosses_nodes(axis: str, layout: Layout, gpus_per_node: int) -> bool:
    """Whether the groups of `axis` span more than one node (their traffic then goes over the node links)."""
    stride = 1
    for a in AXES[: AXES.index(axis)]:
        stride *= getattr(layout, a)
    size = getattr(layout, axis)
    return size > 1 and stride * size > gpus_per_node


def link_bytes_per_s(gpu: GPU, layout: Layout, *axes: str) -> float:
    """The bandwidth a collective over `axes` gets: the node-to-node link if any of them crosses nodes."""
    across = any(crosses_nodes(a, layout, gpu.gpus_per_node) for a in axes)
    return (gpu.node_link_gbps if across else gpu.link_gbps) * 1e9


def stage_parameters(arch: ModelArch, layout: Layout, stage: int) -> int:
    """Parameters one rank of pipeline stage `stage` holds (a dense attention model), exactly as the engine builds
    it (models/gpt.py): its L/pp layers (TP shards + replicated norms; a GDN hybrid's each by its kind), the embedding's padded vocabulary rows on
    the first stage, the final norm and the output layer on the last (with tied embeddings the last stage's copy
    of the embedding: megatron's shared output weight; so both end stages hold padded vocab x h / tp)."""
    per_stage = arch.num_layers // layout.pp
    layers = range(stage * per_stage, (stage + 1) * per_stage)
    vocab = arch.padded_vocab_size(layout.tp) * arch.hidden_size // layout.tp
    out = sum(_layer_parameters(arch, layout.tp, arch.is_linear(i)) for i in layers)
    out += vocab if stage == 0 else 0
    out += vocab + arch.hidden_size if stage == layout.pp - 1 else 0
    return out


def _layer_parameters(arch: ModelArch, tp: int, linear: bool) -> int:
    """One layer's parameters on a TP rank: a full-attention or a gated-delta-net layer (plan/layers.py), its
    norms (GDN: and out_norm) whole on every rank, the rest split over TP."""
    whole = gdn_layer_params(arch) if linear else attention_layer_params(arch)
    rep = replicated_layer_params(arch, linear)
    return (whole - rep) // tp + rep


def stage_parameters_per_rank(arch: ModelArch, layout: Layout) -> int:
    """Parameters one rank of the heaviest stage holds (`stage_parameters`; at PP1 the whole model's share): an end
    stage, unless a hybrid's middle stage holds dearer layers."""
    return max(stage_parameters(arch, layout, s) for s in range(layout.pp))


def moe_stage_parameters_per_rank(arch: ModelArch, layout: Layout) -> tuple[int, int]:
    """(dense, routed-expert) parameters one rank of a MoE model's heaviest stage holds: each stage its L/pp layers
    (a MoE layer's attention, router and shared expert over TP, its routed experts over EP x expert TP; a dense layer as
    `stage_parameters_per_rank`; `first_k_dense_replace` puts the dense layers on the first stage), the embedding on
    the first stage, the output layer and the final norm on the last."""
    pc, rep = parameter_count(arch), replicated_layer_params(arch, False)
    per_stage, moe = arch.num_layers // layout.pp, set(arch.moe_layers)
    layer_experts = arch.num_experts * expert_params(arch) // (layout.expert_tp * layout.ep)
    vocab = arch.vocab_size * arch.hidden_size // layout.tp
    best = (0, 0)
    for r in range(layout.pp):
        layers = range(r * per_stage, (r + 1) * per_stage)
        dense = sum((pc["moe_layer"] if i in moe else pc["layer"]) - rep for i in layers) // layout.tp
        dense += (
            per_stage * rep
            + (vocab if r == 0 else 0)
            + (vocab + arch.hidden_size if r == layout.pp - 1 else 0)
        )
        experts = sum(i in moe for i in layers) * layer_experts
        best = max(best, (dense, experts), key=sum)
    return best


MIN_PIECE_TOKENS = 4096
"""The search's shortest root piece: the assumed MFU is a large-GEMM rate, and a piece's GEMMs have its tokens as
rows (a stated assumption, not measured; a fixed `--root-pieces` is taken as given)."""

PIECES_SEARCHED = (1, 2, 4, 8, 16)


def root_pieces_searched(shape: RolloutShape, layout: Layout, schedule: str) -> tuple[int, ...]:
    """The root piece counts the search tries: under PP for replay's shared roots, pieces of at least
    MIN_PIECE_TOKENS tokens; 1 (whole roots) otherwise."""
    if layout.pp == 1 or schedule != "replay" or shape.responses == 1:
        return (1,)
    return tuple(k for k in PIECES_SEARCHED if k == 1 or shape.root_length // k >= MIN_PIECE_TOKENS)


def _chunk_flops(arch: ModelArch, layout: Layout, tokens: int, attention: int, rows: int) -> float:
    """FLOPs of a chunk of `tokens` tokens with `attention` forward attention FLOPs (plan/flops.py
    attention_flops: its visible pairs, windows included) whose `rows` rows reach the output layer (forward, backward and the recompute of `layout`), as plan/flops.py counts the whole step."""
    again = (1 if layout.recompute in ("selective", "full") else 0) + (1 if layout.recompute == "full" else 0)
    rows_again = rows if layout.recompute in ("selective", "full") else 0
    return float(
        layer_matmul_flops_per_token(arch) * (3 + again) * tokens
        + (3 + again) * attention
        + logits_flops_per_row(arch) * (LOGITS_MATMULS * rows + rows_again)
    )


def root_flops(arch: ModelArch, shape: RolloutShape, layout: Layout) -> float:
    """FLOPs of one prompt group's root chunk under replay (forward, backward, its recomputed forward): its R
    tokens causally, its K + G loss rows (the shared response tokens and one fork token per child)."""
    R, rows = shape.root_length, shape.shared_response_length + shape.responses
    return _chunk_flops(arch, layout, R, attention_flops(arch, R), rows)


def piece_flops(arch: ModelArch, shape: RolloutShape, layout: Layout, pieces: int) -> list[float]:
    """FLOPs of each of the root's pieces (data/pieces.py's lengths): piece j's tokens attend causally to
    themselves and fully to the earlier pieces; the root's loss rows sit at its end, in the last piece (a bound
    when K + G exceed the last piece's tokens). They add up to `root_flops`."""
    out, start = [], 0
    lengths = piece_lengths(shape.root_length, pieces)
    rows = shape.shared_response_length + shape.responses
    for j, n in enumerate(lengths):
        out.append(
            _chunk_flops(
                arch, layout, n, attention_flops(arch, n, start), rows if j == len(lengths) - 1 else 0
            )
        )
        start += n
    return out


def pipeline_seconds(
    arch: ModelArch,
    shape: RolloutShape,
    layout: Layout,
    gpu: GPU,
    schedule: str,
    fl: StepFlops,
    *,
    rate: float,
    act_bytes: int,
    branch_micro_batch: int,
    root_pieces: int = 1,
) -> dict[str, float]:
    """The pipeline's bubble and its stage-to-stage messages (seconds per step; 0 without PP); `root_pieces`:
    replay's roots cut into that many pieces (the module doc)."""
    pp = layout.pp
    if pp == 1:
        return {"pipeline_bubble": 0.0, "pipeline_messages": 0.0}
    ranks = layout.tp * layout.cp * pp  # one DP replica
    groups = cdiv(shape.prompts, layout.dp)  # prompt groups of one replica
    per_group = fl.total / shape.prompts
    G = shape.responses
    if schedule == "replay" and G > 1:
        micro = cdiv(G, min(branch_micro_batch, G))
        t_root = max(piece_flops(arch, shape, layout, root_pieces)) / ranks / rate  # the dearest piece
        t_leaf = (per_group - root_flops(arch, shape, layout)) / micro / ranks / rate
        bubble = groups * (pp - 1) * (t_root + t_leaf)
        rows = local_rows(shape.root_length, 1, layout) + micro * local_rows(
            shape.leaf_length, min(branch_micro_batch, G), layout
        )
    else:  # packed, or one-response groups: the groups are one wave of micro-batches
        bubble = (pp - 1) * per_group / ranks / rate
        rows = local_rows(shape.root_length, 1, layout) + local_rows(shape.leaf_length, G, layout)
    if layout.sp:
        rows //= layout.tp
    # each rank sends every chunk's output forward and its input's gradient backward once (end stages: one way)
    message = 2 * groups * rows * arch.hidden_size * act_bytes
    return {"pipeline_bubble": bubble, "pipeline_messages": message / link_bytes_per_s(gpu, layout, "pp")}
