"""A Mamba-2 hybrid's part of `ModelArch` (Nemotron-H: models/families/nemotron_h.py): its checks, widths and
megatron-core settings, kept here so that arch.py holds only the fields.

Widths (megatron's ssm/mamba_mixer.py, HF's NemotronHMamba2Mixer, the same numbers):
    d_inner = heads x head_dim            conv channels cd = d_inner + 2 G N   (x | B | C)
    in_proj rows = [z (d_inner); x (d_inner); B (G N); C (G N); dt (heads)]   (megatron's split order = HF's)
Tensor parallelism splits heads and groups (megatron asserts both divide): each rank holds its share of EVERY
section of in_proj and conv1d (checkpoint/layouts.py `tp_sections`).
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError

PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
"""megatron's hybrid_override_pattern characters this engine builds (mamba_hybrid_layer_allocation.Symbols): "E" a
MoE layer (megatron's MoELayer alone after its norm: models/mamba.py)."""


def check_mamba_arch(arch: Any) -> None:
    """ValueErrors (one line) for a hybrid_override_pattern arch that megatron's MambaMixer cannot build."""
    from megatron_branch.models.families import get_family

    pattern = arch.hybrid_override_pattern
    mamba_family = "mamba" in get_family(arch.family).layer_kinds
    if pattern is None or not mamba_family:  # the pattern and the family's parameter map go together
        raise ValueError(
            f"family {arch.family} needs hybrid_override_pattern"
            if pattern is None
            else f"hybrid_override_pattern needs a Mamba hybrid family (nemotron_h), not {arch.family}"
        )
    if len(pattern) != arch.num_layers:
        raise ValueError(
            f"hybrid_override_pattern has {len(pattern)} layers for num_hidden_layers={arch.num_layers}"
        )
    bad = sorted(set(pattern) - set(PATTERN_KINDS))
    if bad:
        raise ValueError(f"hybrid_override_pattern layer {bad[0]!r} is not supported; supported: M, *, -, E")
    check_moe_pattern(arch, pattern)
    if arch.layer_types is not None:
        raise ValueError("hybrid_override_pattern and layer_types (gated delta nets) cannot be combined")
    if arch.mlp_activation not in ("swiglu", "relu2"):
        raise ValueError(f"mlp_activation must be swiglu or relu2, got {arch.mlp_activation!r}")
    if arch.position_embedding not in ("rope", "none"):
        raise ValueError(f"position_embedding must be rope or none, got {arch.position_embedding!r}")
    if "M" not in pattern:
        return
    for name in (
        "mamba_num_heads",
        "mamba_head_dim",
        "mamba_state_dim",
        "mamba_num_groups",
        "mamba_conv_kernel",
    ):
        if getattr(arch, name) <= 0:
            raise ValueError(f"{name} must be positive for Mamba layers, got {getattr(arch, name)}")
    if arch.mamba_num_heads % arch.mamba_num_groups:
        raise ValueError(
            f"mamba_num_heads={arch.mamba_num_heads} is not a multiple of n_groups={arch.mamba_num_groups}"
        )


def check_moe_pattern(arch: Any, pattern: str) -> None:
    """The "E" layers are the MoE layers: num_experts set exactly when some layer is "E", and moe_layer_pattern
    (ModelArch's canonical form: None when every layer is MoE) marking exactly those; left out (a config-defined
    arch), it is read off the pattern."""
    if ("E" in pattern) != arch.is_moe:
        raise ValueError(
            "hybrid_override_pattern has MoE layers ('E') but num_experts is 0"
            if "E" in pattern
            else "num_experts > 0 needs MoE layers ('E') in hybrid_override_pattern"
        )
    marks = tuple(int(c == "E") for c in pattern)
    if arch.is_moe and arch.moe_layer_pattern is None and not all(marks):
        arch.moe_layer_pattern = marks
    if arch.is_moe and arch.moe_layer_pattern != (None if all(marks) else marks):
        raise ValueError(f"moe_layer_pattern {arch.moe_layer_pattern} is not the 'E' layers of {pattern}")


def layer_kind(arch: Any, layer: int) -> str | None:
    """ "mamba", "attention", "mlp" or "moe" for a hybrid_override_pattern arch's layer (0-based); None otherwise."""
    if arch.hybrid_override_pattern is None:
        return None
    return PATTERN_KINDS[arch.hybrid_override_pattern[layer]]


def d_inner(arch: Any) -> int:
    return arch.mamba_num_heads * arch.mamba_head_dim


def in_proj_sections(arch: Any) -> tuple[int, ...]:
    """Rows of the full in_proj: [z, x, B, C, dt]."""
    gn = arch.mamba_num_groups * arch.mamba_state_dim
    return (d_inner(arch), d_inner(arch), gn, gn, arch.mamba_num_heads)


def conv_sections(arch: Any) -> tuple[int, ...]:
    """Channels of the causal convolution: [x, B, C]."""
    gn = arch.mamba_num_groups * arch.mamba_state_dim
    return (d_inner(arch), gn, gn)


def check_mamba_tensor_parallel(arch: Any, tp: int) -> None:
    """megatron's MambaMixer splits heads and groups over TP (each rank at least one group)."""
    if "M" not in (arch.hybrid_override_pattern or ""):
        return
    for name in ("mamba_num_heads", "mamba_num_groups"):
        if getattr(arch, name) % tp:
            raise UserError(f"tensor parallel size {tp} does not divide {name}={getattr(arch, name)}")


def mamba_config_kwargs(arch: Any) -> dict[str, Any]:
    """TransformerConfig settings of a hybrid_override_pattern arch (its MLP activation, its Mamba widths)."""
    kwargs: dict[str, Any] = {}
    if arch.mlp_activation == "relu2":
        from megatron.core.activations import squared_relu

        from megatron_branch.compat.cpu import needs_cpu_shims

        if (
            needs_cpu_shims()
        ):  # megatron's jit_fuser is torch.compile: on CPU, inductor per shape; the same math
            squared_relu = getattr(squared_relu, "_torchdynamo_orig_callable", squared_relu)
        kwargs.update(gated_linear_unit=False, activation_func=squared_relu)
    if "M" in arch.hybrid_override_pattern:
        kwargs.update(
            mamba_state_dim=arch.mamba_state_dim,
            mamba_head_dim=arch.mamba_head_dim,
            mamba_num_groups=arch.mamba_num_groups,
            mamba_num_heads=arch.mamba_num_heads,
            # megatron's fused training path needs mamba_ssm's kernels; the mixer's tree forward is ours
            # (models/mamba.py), so the flag only keeps megatron's constructor off that path
            use_mamba_mem_eff_path=False,
        )
    # the layers differ: a dist checkpoint names each by its index (transformer_block.py sharded_state_dict)
    kwargs["hetereogenous_dist_checkpoint"] = True
    return kwargs
