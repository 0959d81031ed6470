"""Model families: one file per family, each registering its `FamilySpec` (registry.py); every family table of
the package is derived from the registry. Adding a family: docs/design.md ("Adding a model family")."""

from megatron_branch.models.families import (  # noqa: F401  (importing a family's module registers it)
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    llama,
    mixtral,
    nemotron_h,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from megatron_branch.models.families.hf_config import (
    arch_fields_from_hf,
    check_supported_architecture,
    hf_config_of,
    tiny_hf_config,
)
from megatron_branch.models.families.registry import (
    FAMILY_REGISTRY,
    FamilySpec,
    export_classes,
    families,
    get_family,
    model_types,
    moe_families,
    param_maps,
    register_family,
    supported_architectures,
    unregister_family,
)

__all__ = [
    "FAMILY_REGISTRY",
    "FamilySpec",
    "arch_fields_from_hf",
    "check_supported_architecture",
    "export_classes",
    "families",
    "get_family",
    "hf_config_of",
    "model_types",
    "moe_families",
    "param_maps",
    "register_family",
    "supported_architectures",
    "tiny_hf_config",
    "unregister_family",
]
