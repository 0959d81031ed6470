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
    what the pipeline does not run     interleaved (virtual) stages, hybrid (gated delta net) models,
                                       mixture-of-experts models, the PPO critic: not pipelined yet
    root pieces are the pipeline's     cutting replay's roots into sequence pieces (root_pieces > 1,
                                       data/pieces.py) fills the pipeline's stages; without pipeline parallelism
                                       the pieces would run one after another as the whole root does, and the
                                       other schedules have no root chunk: refused (a positive count always)
    GDN heads split over CP            a hybrid's gated delta net layer runs under CP by the head exchange (each CP
                                       rank runs a block of a TP rank's heads over the whole chunk,
                                       models/gdn_heads.py): the value heads per TP rank must divide by cp and the
                                       key heads divide by cp or divide it
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
                                       no router (a silent no-op)
    MoE at tp > 1 needs SP             megatron's MoELayer trains tensor-parallel experts only with sequence
                                       parallelism
    token dropping is naive's          a capacity factor drops tokens by which tokens share an expert's batch, so
                                       a prefix computed once is not dropped as each rollout's own batch drops it
                                       (check_moe_run)
    verl's engine runs dense softmax   verl builds the model; the integration then wraps each layer's core
    attention                          attention and makes RoPE follow position ids (integration/verl_model.py):
                                       a hybrid's gated delta net layers have no core attention (and a state
                                       that must follow the tree), multi-latent attention applies its own RoPE
                                       inside the attention, interleaved RoPE is not the table the position ids
                                       index, and MoE router losses would count a shared token once, not once
                                       per rollout (check_verl_model)
    the planner prices what it knows   multi-latent attention (deepseek_v3) is refused by `plan`: its latent
                                       projections, per-head K/V widths and their FLOPs are not priced yet
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_branch import spelling as _spelling
from megatron_branch.errors import SettingError

TRAIN_SCHEDULES = ("replay", "packed", "naive", "naive-fused", "packed-nosharing", "replay-stopgrad")
"""Schedules a training run (`train`'s schedule.name) can step with; all but replay-stopgrad are exact."""
AUTO_SCHEDULE = "auto"
"""`schedule.name: auto` / `grad --schedule auto` (plan/auto.py): packed when its planned memory fits the budget, replay
otherwise; checked as replay (what it falls back to), packed asked per batch."""
GRAD_SCHEDULES = ("replay", "packed", "naive")
"""The schedules of `grad`'s stable contract and of megatron's drop-in (integration/schedule.py)."""
UNSHARED = ("naive", "naive-fused", "packed-nosharing")
"""Schedules that compute every rollout's every position (nothing shared): the baselines."""
NO_RING = ("naive", "naive-fused", "packed-nosharing", "replay-stopgrad")
"""Schedules without context parallelism."""
HYBRID_SCHEDULES = ("naive", "naive-fused", "packed", "replay", "packed-nosharing")
"""Schedules that run a hybrid (gated delta net) model exactly."""
REPLAY_SCHEDULES = ("replay", "replay-stopgrad")
"""Schedules with segment recompute (replay's depth-first walk)."""
MEGATRON_ATTENTION = ("naive",)
"""Schedules that run megatron-core's own attention: no ring, no engine backend, no engine layer checkpointing."""


def check_run(
    schedule: str,
    *,
    cp: int = 1,
    recompute: bool = False,
    recompute_layers: bool = False,
    backend: str | None = None,
    training: bool = True,
    device: str | None = None,
) -> None:
    """Refuse a schedule with settings it cannot honour (see the module doc). A SettingError, command-line
    wording; re-spell it at entry points with other names. `training` and `device` (default: cuda when available)
    say how and where the backend must run."""
    own = schedule in MEGATRON_ATTENTION
    if schedule in NO_RING and cp > 1:
        raise SettingError(
            lambda s: (
                f"{s.value('schedule', schedule)} has no context parallelism (it has no ring: every CP rank "
                f"would compute the whole batch); use packed or replay with {s.name('cp')} > 1"
            )
        )
    if recompute and schedule not in REPLAY_SCHEDULES:
        raise SettingError(
            lambda s: (
                f"{s.name('recompute')} applies to {s.name('schedule')} replay only; "
                f"{s.value('schedule', schedule)} ignores it"
            )
        )
    if own and recompute_layers:
        raise SettingError(
            lambda s: (
                f"{s.name('recompute_layers')} applies to {s.name('schedule')} replay or packed; the "
                f"{schedule} schedule runs megatron's own attention without the engine's layer checkpointing"
            )
        )
    if own and backend is not None:
        raise SettingError(
            lambda s: (
                f"{s.name('backend')} applies to {s.name('schedule')} replay or packed; the {schedule} "
                "schedule runs megatron's own attention, not an engine backend"
            )
        )
    if not own:
        from megatron_branch.attention.dispatch import (
            backend_problem,
        )  # lazy: rules stay importable without torch

        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        problem = backend_problem(backend, cp_size=cp, training=training, device=device)
        if problem is not None:
            raise SettingError(lambda s: f"{s.value('backend', backend)}: {problem}")


def check_hybrid_schedule(schedule: str, *, model: str) -> None:
    """Refuse a schedule that cannot run a hybrid (gated delta net) model exactly; `model` describes the model."""
    if schedule not in HYBRID_SCHEDULES:
        raise SettingError(
            lambda s: (
                f"{s.value('schedule', schedule)} cannot run a hybrid model ({model}); use {s.name('schedule')} "
                f"{', '.join(HYBRID_SCHEDULES)}"
            )
        )


PIPELINE_SCHEDULES = ("replay", "packed", "naive-fused")
"""Schedules that run under pipeline parallelism (schedule/pipeline.py; naive-fused: the benchmark's fair
baseline)."""


def check_pipeline(
    schedule: str,
    *,
    pp: int,
    num_layers: int | None = None,
    virtual: int | None = None,
    hybrid: bool = False,
    critic: bool = False,
    moe: bool = False,
    root_pieces: int = 1,
) -> None:
    """Refuse what pipeline parallelism cannot run (see the module doc): a SettingError, command-line wording.
    `num_layers`: the model's (when known); `virtual`: megatron's virtual_pipeline_model_parallel_size;
    `root_pieces`: the sequence pieces each replay root is cut into (schedule/options.py)."""
    if root_pieces < 1:
        raise SettingError(
            lambda s: f"{s.name('root_pieces')} must be a positive number of pieces, got {root_pieces}"
        )
    if root_pieces > 1 and schedule != "replay":
        raise SettingError(
            lambda s: (
                f"{s.value('root_pieces', root_pieces)} applies to {s.name('schedule')} replay only (it cuts "
                f"replay's shared roots into pieces); {s.value('schedule', schedule)} has no root chunk to cut"
            )
        )
    if root_pieces > 1 and pp == 1:
        raise SettingError(
            lambda s: (
                f"{s.value('root_pieces', root_pieces)} needs pipeline parallelism ({s.name('pp')} > 1): the "
                "pieces fill the stages; on one stage they would run one after another as the whole root does"
            )
        )
    if virtual not in (None, 1):
        raise SettingError(
            lambda s: (
                f"{s.value('vp', virtual)}: interleaved (virtual) pipeline stages are not supported; branch replay "
                "runs one contiguous block of layers per stage"
            )
        )
    if pp == 1:
        return
    if schedule not in PIPELINE_SCHEDULES:
        raise SettingError(
            lambda s: (
                f"{s.value('schedule', schedule)} has no pipeline parallelism; use {s.name('schedule')} replay or "
                f"packed (or naive-fused, the baseline) with {s.value('pp', pp)}"
            )
        )
    if num_layers is not None and num_layers % pp:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)} does not divide the model's {num_layers} layers (each stage holds "
                "num_layers / pp consecutive layers)"
            )
        )
    if hybrid:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)}: pipeline parallelism cannot run a hybrid (gated delta net) model yet; "
                f"use {s.value('pp', 1)}"
            )
        )
    if critic:
        raise SettingError(
            lambda s: f"{s.value('pp', pp)}: the PPO critic is not pipelined yet; use {s.value('pp', 1)}"
        )
    if moe:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)}: pipeline parallelism cannot run a mixture-of-experts model yet (its router "
                f"losses and routing replay are bound per step, not per stage); use {s.value('pp', 1)}"
            )
        )


def gdn_context_parallel_sizes(*, key_heads: int, value_heads: int, tp: int) -> list[int]:
    """CP sizes whose head blocks split a gated delta net layer on a TP rank (the rule below)."""
    nk, nv = key_heads // tp, value_heads // tp
    return [c for c in range(1, nv + 1) if nv % c == 0 and (nk % c == 0 or c % nk == 0)]


def check_hybrid_run(arch: Any, schedule: str, *, cp: int = 1, tp: int = 1) -> None:
    """A hybrid (gated delta net or Mamba-2) model's rules read off its arch (a models.ModelArch): its schedules
    and the CP split of its GDN heads, Mamba's CP refusal; nothing for a model without such layers."""
    check_mamba_run(arch, schedule, cp=cp)
    if not arch.is_hybrid:
        return
    check_hybrid_schedule(
        schedule, model=f"{arch.family}, {arch.num_linear_layers} of {arch.num_layers} layers gated delta net"
    )
    check_gdn_context_parallel(
        key_heads=arch.linear_num_key_heads, value_heads=arch.linear_num_value_heads, tp=tp, cp=cp
    )


def check_mamba_run(arch: Any, schedule: str, *, cp: int = 1) -> None:
    """A Mamba-2 hybrid (Nemotron-H: hybrid_override_pattern with "M" layers): the recurrent schedules, and no
    context parallelism yet (its SSM scan over a tree segment needs every row of the path on one rank; a head
    exchange like the gated delta net's, models/gdn_heads.py, is not built for it)."""
    pattern = getattr(arch, "hybrid_override_pattern", None) or ""
    if "M" not in pattern:
        return
    check_hybrid_schedule(
        schedule, model=f"{arch.family}, {pattern.count('M')} of {len(pattern)} layers Mamba-2"
    )
    if cp > 1:
        raise SettingError(
            lambda s: (
                f"{s.value('cp', cp)}: context parallelism cannot run a Mamba-2 hybrid yet (a segment's SSM scan "
                f"needs every row of its path on one rank; no head exchange is built for Mamba); use "
                f"{s.value('cp', 1)}"
            )
        )


def check_gdn_context_parallel(*, key_heads: int, value_heads: int, tp: int, cp: int) -> None:
    """Refuse a CP size the head exchange cannot split a hybrid's gated delta net layers over: each CP rank runs a
    block of value heads with the key heads they read (whole key heads, or one key head shared by cp / key heads
    ranks), as megatron-core's Mamba context parallelism splits Mamba heads and groups."""
    if cp <= 1 or tp <= 0 or key_heads % tp or value_heads % tp:
        return  # the TP split itself is the model's rule (ModelArch.check_tensor_parallel)
    ok = gdn_context_parallel_sizes(key_heads=key_heads, value_heads=value_heads, tp=tp)
    if cp in ok:
        return
    nk, nv = key_heads // tp, value_heads // tp
    raise SettingError(
        lambda s: (
            f"{s.value('cp', cp)} cannot split the hybrid's gated delta net heads: a TP rank holds {nk} key / {nv} "
            f"value heads ({s.value('tp', tp)}) and each CP rank runs a block of them over the whole chunk, which "
            f"needs the value heads divisible by the CP size and the key heads divisible by it or dividing it; use "
            f"{s.name('cp')} in {', '.join(map(str, ok))}"
        )
    )


def check_sampling(
    *,
    n: int,
    max_new_tokens: int,
    branch_at: Sequence[int],
    branch_factor: int,
    share_prefix: bool,
    branch_at_turns: Sequence[int] = (),
) -> None:
    """The rules between sampling settings (see the module doc), each field valid on its own (SamplingParams):
    tree sampling (`branch_at`, or a multi-turn rollout's `branch_at_turns`) needs prefix sharing, forks inside
    the response and ends with n leaves."""
    at, turns = list(branch_at), list(branch_at_turns)
    if at and turns:
        raise SettingError(
            lambda s: (
                f"{s.name('branch_at')} and {s.name('branch_at_turns')} both fork rollouts: use one or the other"
            )
        )
    forks, key, shared = (
        (turns, "branch_at_turns", "earlier turns") if turns else (at, "branch_at", "a response start")
    )
    if not share_prefix and forks:
        raise SettingError(
            lambda s: (
                f"{s.value('share_prefix', 'false')} samples every rollout on its own (its own prefill); "
                f"{s.name(key)} forks rollouts that share {shared}: use one or the other"
            )
        )
    if at != sorted(set(at)) or any(not 0 < k < max_new_tokens for k in at):
        raise SettingError(
            lambda s: (
                f"{s.name('branch_at')} must be strictly increasing token counts in (0, "
                f"{s.value('max_new_tokens', max_new_tokens)}), got {at}"
            )
        )  # branch_at_turns' own rule: check_multi_turn
    if n % branch_factor ** len(forks):
        raise SettingError(
            lambda s: (
                f"{s.value('n', n)} must be divisible by {s.name('branch_factor')} ** len({s.name(key)}) = "
                f"{branch_factor ** len(forks)}"
            )
        )


def check_multi_turn(
    *, turn_end_token_ids: Sequence[int], branch_at_turns: Sequence[int], max_assistant_turns: int | None
) -> None:
    """The turn loop's own rules (generation/multi_turn.py MultiTurnParams): a turn-end token to stop a policy
    turn at, forks after finished turns (increasing, >= 1, before the last turn allowed)."""
    ends, at = list(turn_end_token_ids), list(branch_at_turns)
    if not ends or any(t < 0 for t in ends):
        raise SettingError(
            lambda s: f"{s.name('turn_end')} must name at least one token that ends a policy turn, got {ends}"
        )
    limit = max_assistant_turns
    if at != sorted(set(at)) or any(t < 1 or (limit is not None and t >= limit) for t in at):
        raise SettingError(
            lambda s: (
                f"{s.name('branch_at_turns')} must be strictly increasing turn counts >= 1"
                + ("" if limit is None else f" below {s.value('max_assistant_turns', limit)}")
                + f", got {at}"
            )
        )


def check_precision(dtype: str, *, grad_sync: str = "ddp", training: bool = False) -> None:
    """Refuse a half-precision run whose gradients would be summed in that precision (bf16 / fp16 parameters
    accumulate in megatron DDP's fp32 main gradients, precision.py; the plain reduction sums `param.grad` in its
    dtype), and fp16 training (`training`: an optimizer steps on the gradients): megatron's fp16 needs its dynamic
    loss scale multiplied into every backward, and the schedules' backward calls (replay's injections included) do
    not apply it, so the scaler would unscale gradients that were never scaled."""
    from megatron_branch.precision import HALF_NAMES

    if dtype in HALF_NAMES and grad_sync != "ddp":
        raise SettingError(
            lambda s: (
                f"{s.value('dtype', dtype)} accumulates gradients in megatron DDP's fp32 main gradients; "
                f"{s.value('grad_sync', grad_sync)} would sum them in {dtype}: use {s.value('grad_sync', 'ddp')}"
            )
        )
    if dtype == "float16" and training:
        raise SettingError(
            lambda s: (
                f"{s.value('dtype', dtype)}: training in fp16 needs megatron's dynamic loss scale in every backward, "
                "which the engine's schedules do not apply yet; use bfloat16 (megatron's bf16 needs no loss scale)"
            )
        )


def check_moe_run(
    schedule: str,
    *,
    moe: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    ep: int = 1,
    router_settings: bool = False,
    capacity_factor: float | None = None,
) -> None:
    """The mixture-of-experts rules (see the module doc). `moe`: the model has MoE layers; `router_settings`:
    router losses or routing replay were asked for. A SettingError, command-line wording."""
    if not moe:
        if ep > 1 or router_settings or capacity_factor is not None:
            raise SettingError(
                lambda s: (
                    f"{s.name('ep')} / {s.name('moe')} need a mixture-of-experts model (this one is dense: it has "
                    "no router)"
                )
            )
        return
    if tp > 1 and not sequence_parallel:
        raise SettingError(
            lambda s: (
                f"a mixture-of-experts model at {s.value('tp', tp)} needs {s.name('sequence_parallel')} (megatron's "
                "MoELayer trains tensor-parallel experts only with sequence parallelism)"
            )
        )
    if capacity_factor is not None:
        if not capacity_factor > 0:
            raise SettingError(
                lambda s: f"{s.name('capacity_factor')} must be positive, got {capacity_factor}"
            )
        if schedule != "naive":
            raise SettingError(
                lambda s: (
                    f"{s.value('capacity_factor', capacity_factor)}: token dropping is not exact under sharing (an "
                    f"expert's capacity depends on which tokens share its batch); {s.value('schedule', schedule)} "
                    "refuses it, use dropless routing or the naive schedule"
                )
            )


def check_verl_model(
    *,
    attention_variant: str | None = None,
    multi_latent_attention: bool = False,
    rotary_interleaved: bool = False,
    moe_reason: str | None = None,
) -> None:
    """Refuse a model verl's engine built that branch replay cannot run inside it (see the module doc): the
    fields of megatron's TransformerConfig. A SettingError; the settings are the model's, not a flag's."""
    where = "branch replay in verl's engine"
    if attention_variant == "gated_delta_net":
        raise SettingError(
            lambda _: (
                f"{where} cannot run a hybrid (gated delta net) model yet (experimental_attention_variant="
                "gated_delta_net: its linear-attention layers have no core attention to wrap, and their state must "
                "follow the tree); megatron-branch's own train and grad run hybrids"
            )
        )
    if attention_variant is not None:
        raise SettingError(
            lambda _: (
                f"{where} supports softmax attention layers only, not experimental_attention_variant="
                f"{attention_variant}"
            )
        )
    if multi_latent_attention:
        raise SettingError(
            lambda _: (
                f"{where} does not support multi-latent attention (MLA applies its own RoPE inside the attention, "
                "not the model's table the tree's position ids index)"
            )
        )
    if rotary_interleaved:
        raise SettingError(
            lambda _: (
                f"{where} does not support interleaved RoPE (rotary_interleaved=True); use the default layout"
            )
        )
    if moe_reason is not None:  # integration/verl_moe.py refusal_reason: what of a MoE model is not wired
        raise SettingError(lambda _: f"{where} cannot run this MoE model: {moe_reason}")


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
    if spec.grad_sync == "manual" and layout.ep > 1:
        raise SettingError(
            lambda w: (
                f"{w.value('grad_sync', 'manual')} does not reduce expert-parallel gradients (over the expert "
                f"data-parallel group); use {w.value('grad_sync', 'ddp')} with {w.name('ep')}"
            )
        )
    check_pipeline(s.name, pp=layout.pp, critic=spec.critic, root_pieces=s.root_pieces)
    if spec.arch is not None:
        check_model(spec)


def check_model(spec: Any) -> None:
    """The rules between a run and its model (spec.arch, a models.ModelArch): the pipeline's split of its layers,
    a hybrid's schedules and CP split (check_hybrid_run), the mixture-of-experts rules."""
    s, layout, arch, m = spec.schedule, spec.layout, spec.arch, spec.moe
    check_pipeline(
        s.name, pp=layout.pp, num_layers=arch.num_layers, moe=arch.is_moe, critic=spec.critic,
        hybrid=arch.is_hybrid or bool(arch.hybrid_override_pattern), root_pieces=s.root_pieces,
    )  # fmt: skip
    check_hybrid_run(arch, s.name, cp=layout.cp, tp=layout.tp)
    check_moe_run(
        s.name, moe=arch.is_moe, tp=layout.tp, sequence_parallel=layout.sequence_parallel, ep=layout.ep,
        router_settings=m.router_settings, capacity_factor=m.expert_capacity_factor,
    )  # fmt: skip


API = _spelling.API
"""How a library caller names the settings (spelling.py's library column): the schedules' and the sampler's own
checks."""


def check_plannable(arch: Any) -> None:
    """Refuse, in one line, a model the planner would misprice (plan/model.py load_model calls it)."""
    if arch.multi_latent:
        raise SettingError(
            lambda _: (
                f"{arch.family}: plan does not price multi-latent attention yet (its latent projections, "
                "per-head K/V widths and their FLOPs); grad, train and the sampler run it"
            )
        )
