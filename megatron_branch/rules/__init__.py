"""Which run settings go together: every refusal rule between a schedule, its options and the layout, written once.

Every entry point calls `check_run` with what it was given, BEFORE any work: `megatron-branch grad` (flags),
`train`'s config validation (config keys), the planner, the long-context rehearsal, and the naive schedule itself
(library callers). Each refusal is a SettingError, worded in the entry point's own names (errors.Spelling:
`--schedule naive` / `schedule.name=naive`). The layout's own rules (positive sizes, the world, sequence parallel
at tp 1) live with it: parallel/layout.py.

Rules (a flag that would do nothing is refused, not ignored):
    naive has no context parallelism   naive runs each rollout whole through megatron's own attention (no ring):
                                       every CP rank would compute the whole batch and the dp x cp gradient SUM
                                       would count it cp times; so do the unshared baselines (naive-fused,
                                       packed-nosharing) and the stop-gradient comparison (replay-stopgrad)
    recompute is replay's              segment recompute is a step of replay's depth-first walk
    recompute_layers needs the engine  naive runs megatron's own layers, which never checkpoint themselves
    backend needs the engine           naive runs megatron's own attention, not one of the engine's backends
    the backend can run it             attention/dispatch.backend_problem: a baseline has no ring executor, a
                                       backend without a CPU backward cannot train on CPU
    a hybrid runs the GDN schedules    a hybrid's gated delta net layers carry each tree segment's state from its
                                       parent (models/gdn.py) in naive (megatron's own layer), naive-fused,
                                       packed, packed-nosharing and replay; replay-stopgrad (prompt K/V held
                                       constant) has no meaning defined for a recurrent state
    the pipeline runs the tree         under pipeline parallelism (pp > 1) the stages run replay's or packed's
                                       walk (schedule/pipeline.py) or naive-fused's rollouts; naive,
                                       packed-nosharing and the stop-gradient comparison are not pipelined
    stages split the layers            each stage holds num_layers / pp consecutive layers (megatron's even
                                       split)
    what the pipeline does not run     interleaved (virtual) stages, Mamba-2 hybrid models, a
                                       mixture-of-experts model at EP > 1: not pipelined yet (the PPO critic
                                       is: its value head on the last stage)
    root pieces are the pipeline's     cutting replay's roots into sequence pieces (root_pieces > 1,
                                       data/pieces.py) fills the pipeline's stages; without pipeline parallelism
                                       the pieces would run one after another as the whole root does, and the
                                       other schedules have no root chunk: refused (a positive count always)
    GDN heads split over CP            a hybrid's gated delta net layer runs under CP by the head exchange (each CP
                                       rank runs a block of a TP rank's heads over the whole chunk,
                                       models/gdn_heads.py): the value heads per TP rank must divide by cp and the
                                       key heads divide by cp or divide it
    Mamba heads split over CP          a Mamba-2 layer runs under CP by the same exchange (models/mamba_heads.py):
                                       the heads per TP rank must divide by cp and the groups divide by cp or
                                       divide it (check_mamba_run)
    independent rollouts do not fork   sampling without a shared prefix (`share_prefix` off: every rollout its
                                       own prefill, an engine without prefix caching) has no shared response
                                       starts to fork at (`branch_at`)
    forks inside the response          tree sampling forks after k sampled tokens, k in `branch_at` strictly
                                       increasing in (0, max_new_tokens), into `branch_factor` branches each:
                                       n (the leaves) divides by branch_factor ** len(branch_at)
    forks at turns or at tokens        a multi-turn rollout forks after finished assistant turns
                                       (`branch_at_turns`, increasing, >= 1, below max_assistant_turns), not also
                                       at token counts; n divides by branch_factor ** len(branch_at_turns); the
                                       turn loop needs a turn-end token (check_multi_turn, check_sampling)
    half precision sums in fp32        bf16 / fp16 parameters accumulate their gradients in megatron DDP's fp32
                                       main gradients; grad's plain reduction (`--grad-sync manual`) would sum
                                       them in bf16
    fp16 does not train                megatron's fp16 needs its loss scale in every backward; the schedules do
                                       not apply it (grad's fp16 gradients need none: no optimizer steps)
    MoE settings need a MoE model      ep > 1, router losses, routing replay, a capacity factor: a dense model has
                                       no router (a silent no-op); so does an expert TP other than tp (no experts)
    expert grads need DDP              whole experts on each TP rank (etp 1 < tp) or split over EP sum their
                                       gradients over megatron's expert-data-parallel group, which only megatron
                                       DDP reduces (`--grad-sync manual` refused)
    MoE at tp > 1 needs SP             megatron's MoELayer trains tensor-parallel experts only with sequence
                                       parallelism
    token dropping is naive's          a capacity factor drops tokens by which tokens share an expert's batch, so
                                       a prefix computed once is not dropped as each rollout's own batch drops it
                                       (check_moe_run)
    verl's engine runs softmax         verl builds the model; the integration then wraps each layer's core
    attention (MLA included) and       attention, makes a hybrid's GatedDeltaNet branch-aware and RoPE follow
    gated delta nets                   position ids (integration/verl_model.py): interleaved and multimodal RoPE
                                       are not the table the position ids index, a hybrid's CP size must split
                                       its GDN heads, and MoE router losses would count a shared token once, not once
                                       per rollout (check_verl_model)
    the planner prices what it knows   check_plannable: multi-latent attention (plan/mla.py), gpt-oss's
                                       windows, sinks and biases and Mamba-2 hybrids (plan/mamba.py), under CP
                                       too (the head exchange), are priced; a Mamba-2 hybrid's CP size the
                                       heads cannot split at that TP size is the engine's rule (check_mamba_run)
"""

from __future__ import annotations

from typing import Any

from megatron_branch import spelling as _spelling
from megatron_branch.errors import SettingError
from megatron_branch.rules.model import (
    check_expert_tensor_parallel,
    check_gdn_context_parallel,
    check_hybrid_run,
    check_mamba_run,
    check_moe_run,
    check_plannable,
    check_verl_hybrid,
    check_verl_model,
    gdn_context_parallel_sizes,
)
from megatron_branch.rules.sampling import check_multi_turn, check_sampling
from megatron_branch.rules.schedule import (
    AUTO_SCHEDULE,
    GRAD_SCHEDULES,
    HYBRID_SCHEDULES,
    MEGATRON_ATTENTION,
    NO_RING,
    PIPELINE_SCHEDULES,
    REPLAY_SCHEDULES,
    TRAIN_SCHEDULES,
    UNSHARED,
    check_hybrid_schedule,
    check_pipeline,
    check_precision,
    check_run,
)

__all__ = [
    "API",
    "AUTO_SCHEDULE",
    "GRAD_SCHEDULES",
    "HYBRID_SCHEDULES",
    "MEGATRON_ATTENTION",
    "NO_RING",
    "PIPELINE_SCHEDULES",
    "REPLAY_SCHEDULES",
    "TRAIN_SCHEDULES",
    "UNSHARED",
    "check",
    "check_expert_tensor_parallel",
    "check_gdn_context_parallel",
    "check_hybrid_run",
    "check_hybrid_schedule",
    "check_mamba_run",
    "check_model",
    "check_moe_run",
    "check_multi_turn",
    "check_pipeline",
    "check_plannable",
    "check_precision",
    "check_run",
    "check_sampling",
    "check_verl_hybrid",
    "check_verl_model",
    "gdn_context_parallel_sizes",
]


def check(spec: Any) -> None:
    """The one check sequence of a run (assembly/spec.py RunSpec), before any work: the layout's no-ops, the
    precision, the schedule's options, the pipeline; with spec.arch, the model's rules too (check_model: an entry
    point that reads the model later calls that then). A SettingError in command-line wording; each entry point
    re-spells it (spelling.py)."""
    s, layout = spec.schedule, spec.layout
    layout.check_no_op()
    check_precision(spec.dtype, grad_sync=spec.grad_sync, training=spec.training)
    check_run(s.name, cp=layout.cp, recompute=s.recompute, recompute_layers=s.enable_gradient_checkpointing,
              backend=s.backend)  # fmt: skip
    if spec.grad_sync == "manual" and (layout.ep > 1 or layout.expert_tp != layout.tp):
        axis = "ep" if layout.ep > 1 else "etp"
        raise SettingError(
            lambda w: (
                f"{w.value('grad_sync', 'manual')} does not reduce expert-parallel gradients (over the expert "
                f"data-parallel group); use {w.value('grad_sync', 'ddp')} with {w.name(axis)}"
            )
        )
    check_pipeline(s.name, pp=layout.pp, root_pieces=s.root_pieces)
    if spec.arch is not None:
        check_model(spec)


def check_model(spec: Any) -> None:
    """The rules between a run and its model (spec.arch, a models.ModelArch): the pipeline's split of its layers,
    a hybrid's schedules and CP split (check_hybrid_run), the mixture-of-experts rules."""
    s, layout, arch, m = spec.schedule, spec.layout, spec.arch, spec.moe
    check_pipeline(
        s.name, pp=layout.pp, num_layers=arch.num_layers, moe=arch.is_moe, ep=layout.ep,
        ep_spans_dp=layout.ep_spans_dp,
        hybrid=arch.is_hybrid, mamba=bool(arch.hybrid_override_pattern), root_pieces=s.root_pieces,
    )  # fmt: skip
    check_hybrid_run(arch, s.name, cp=layout.cp, tp=layout.tp)
    check_moe_run(
        s.name, moe=arch.is_moe, tp=layout.tp, sequence_parallel=layout.sequence_parallel, ep=layout.ep,
        etp=layout.etp, router_settings=m.router_settings, capacity_factor=m.expert_capacity_factor,
    )  # fmt: skip


API = _spelling.API
"""How a library caller names the settings (spelling.py's library column): the schedules' and the sampler's own
checks."""
