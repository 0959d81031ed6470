"""The model's rules: a hybrid's (gated delta net, Mamba-2) schedules and CP split, the mixture-of-experts rules,
what verl's engine can run inside it, and what the planner can price.

The rules are listed in the package doc (megatron_branch/rules/__init__.py); `check_model` there runs them.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import SettingError
from megatron_branch.rules.schedule import check_hybrid_schedule


def gdn_context_parallel_sizes(*, key_heads: int, value_heads: int, tp: int) -> list[int]:
    """CP sizes whose head blocks split a gated delta net layer on a TP rank (the rule below)."""
    nk, nv = key_heads // tp, value_heads // tp
    return [c for c in range(1, nv + 1) if nv % c == 0 and (nk % c == 0 or c % nk == 0)]


def check_hybrid_run(arch: Any, schedule: str, *, cp: int = 1, tp: int = 1) -> None:
    """A hybrid (gated delta net or Mamba-2) model's rules read off its arch (a models.ModelArch): its schedules
    and the CP split of its GDN or Mamba heads; nothing for a model without such layers."""
    check_mamba_run(arch, schedule, cp=cp, tp=tp)
    if not arch.is_hybrid:
        return
    check_hybrid_schedule(
        schedule, model=f"{arch.family}, {arch.num_linear_layers} of {arch.num_layers} layers gated delta net"
    )
    check_gdn_context_parallel(
        key_heads=arch.linear_num_key_heads, value_heads=arch.linear_num_value_heads, tp=tp, cp=cp
    )


def check_mamba_run(arch: Any, schedule: str, *, cp: int = 1, tp: int = 1) -> None:
    """A Mamba-2 hybrid (Nemotron-H: hybrid_override_pattern with "M" layers): the recurrent schedules, and a CP
    size the head exchange can split its Mamba heads and groups over (models/mamba_heads.py, megatron-core's
    MambaContextParallel split: the heads per TP rank divisible by cp, the groups divisible by it or dividing it)."""
    pattern = getattr(arch, "hybrid_override_pattern", None) or ""
    if "M" not in pattern:
        return
    check_hybrid_schedule(
        schedule, model=f"{arch.family}, {pattern.count('M')} of {len(pattern)} layers Mamba-2"
    )
    heads, groups = arch.mamba_num_heads, arch.mamba_num_groups
    if cp <= 1 or tp <= 0 or heads % tp or groups % tp:
        return  # the TP split itself is the model's rule (mamba_arch.check_mamba_tensor_parallel)
    ok = gdn_context_parallel_sizes(
        key_heads=groups, value_heads=heads, tp=tp
    )  # the same rule, groups as keys
    if cp in ok:
        return
    g = groups // tp
    raise SettingError(
        lambda s: (
            f"{s.value('cp', cp)} cannot split the Mamba-2 heads: a TP rank holds {heads // tp} heads in "
            f"{g} group{'s' if g > 1 else ''} ({s.value('tp', tp)}) and each CP rank runs a block of them over the whole "
            f"chunk, which needs the heads divisible by the CP size and the groups divisible by it or dividing it; "
            f"use {s.name('cp')} in {', '.join(map(str, ok))}"
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


def check_moe_run(
    schedule: str,
    *,
    moe: bool,
    tp: int = 1,
    sequence_parallel: bool = False,
    ep: int = 1,
    etp: int | None = None,
    router_settings: bool = False,
    capacity_factor: float | None = None,
) -> None:
    """The mixture-of-experts rules (see the module doc). `moe`: the model has MoE layers; `etp`: the experts'
    tensor-parallel size asked for (None: tp); `router_settings`: router losses or routing replay were asked for.
    A SettingError, command-line wording."""
    check_expert_tensor_parallel(etp, moe=moe, tp=tp)
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


def check_expert_tensor_parallel(etp: int | None, *, moe: bool, tp: int | None) -> None:
    """An expert tensor-parallel size needs experts: refuse one on a dense model that differs from `tp` (None: any
    TP, the planner's search, where every --etp is a setting for experts). Its value (1 or tp) is the layout's rule
    (parallel/layout.py). A SettingError, command-line wording."""
    if moe or etp is None or etp == tp:
        return
    raise SettingError(
        lambda s: f"{s.value('etp', etp)} needs a mixture-of-experts model (this one is dense: no experts)"
    )


def check_verl_model(
    *,
    attention_variant: str | None = None,
    rotary_interleaved: bool = False,
    moe_reason: str | None = None,
    cp: int = 1,
    position_embedding: str = "rope",
) -> None:
    """Refuse a model verl's engine built that branch replay cannot run inside it (see the module doc): the
    fields of megatron's TransformerConfig. A SettingError; the settings are the model's, not a flag's.
    `cp`: verl's context_parallel_size (a hybrid runs at 1 only: check_verl_hybrid)."""
    where = "branch replay in verl's engine"
    if attention_variant == "gated_delta_net":  # a hybrid: its GDN state follows the tree (models/gdn.py)
        check_verl_hybrid(cp=cp)
        attention_variant = None
    if position_embedding == "mrope":
        raise SettingError(
            lambda _: (
                f"{where} runs text models: this one has multimodal RoPE (position_embedding_type=mrope, a "
                "vision-language checkpoint); save its text model (e.g. Qwen3_5ForCausalLM) and point model.path "
                "at it"
            )
        )
    if attention_variant is not None:
        raise SettingError(
            lambda _: (
                f"{where} supports softmax attention layers only, not experimental_attention_variant="
                f"{attention_variant}"
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


def check_verl_hybrid(*, cp: int) -> None:
    """Refuse a gated-delta-net hybrid under context parallelism in verl's engine, before verl builds it:
    megatron-core 0.16.1's TransformerConfig asserts `context_parallel_size == 1` for GDN models
    (transformer_config.py, "Gated delta net does not support context parallel for now"), and verl builds the model
    with its CP size in that config. megatron-branch's own engine runs hybrids under CP (its config keeps CP out of
    megatron's TransformerConfig; the head exchange, models/gdn_heads.py): grad / train --cp."""
    if cp > 1:
        raise SettingError(
            lambda _: (
                f"branch replay in verl's engine does not run a gated delta net hybrid at context_parallel_size={cp} "
                "(megatron-core 0.16.1's TransformerConfig refuses gated delta net with context parallelism when "
                "verl builds the model): use context_parallel_size=1, or megatron-branch's own train / grad --cp"
            )
        )


def check_plannable(arch: Any, *, schedule: str = "replay", cp: int = 1, tp: int = 1) -> None:
    """Refuse, in one line, a model (plan/model.py load_model) or a layout of it (the search: plan/candidates.py,
    plan/search.py) the planner would misprice. Sliding windows, sinks and linear biases (gpt-oss: plan/flops.py
    attention_flops, plan/layers.py), multi-latent attention (plan/mla.py) and Mamba-2 hybrids (plan/mamba.py),
    under context parallelism too (the head exchange: plan/mamba.py mamba_exchange_*), are priced; a Mamba-2
    hybrid's CP size the engine cannot split the heads over at this TP size is the engine's own rule
    (check_mamba_run), asked here so the planner never prices what would not run."""
    pattern = getattr(arch, "hybrid_override_pattern", None) or ""
    if "M" not in pattern or cp <= 1:
        return
    check_mamba_run(arch, schedule, cp=cp, tp=tp)
