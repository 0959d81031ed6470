"""What the engine knows about one model family, in one record (`FamilySpec`), and the registry of families.

Modelled on torchtitan's `TrainSpec` / `register_train_spec` (torchtitan/protocols/train_spec.py): a family is one
file in this folder that builds its spec and registers it; every table the rest of the package reads (the HF
classes and model types it accepts, the class written on export, the parameter map, the train config's defaults,
the tiny test models) is derived from the registered specs, never written out again.

    register_family(FamilySpec(name="llama", architectures=("LlamaForCausalLM",), ...))
    get_family("llama").param_rules      # the rules of checkpoint/param_map.py
    families()                            # ("llama", "qwen2", ...) in registration order

The registry is the one module-level state of the families: written when a family's module is imported (the
package's own in models/families/__init__.py; a test's or a user's own from their module), read by name after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families.param_rules import Rule

LAYER_KINDS = ("attention", "gated_attention", "gdn", "mamba", "mlp", "moe", "shared_expert")
"""The layer kinds a family is made of; the planner prices each kind (plan/layers.py, plan/flops.py,
plan/memory.py read them off ModelArch: attention and its gate, GDN layers, dense MLP, routed and shared experts).
A family made of these needs no planner term of its own; a new kind is a new mechanism (docs/design.md). "mamba"
(Nemotron-H's Mamba-2 layers) has no planner term yet: plan/model.py refuses such a model in one line."""
TRAIN_DEFAULT_FIELDS: Mapping[str, Any] = MappingProxyType(
    {
        "qkv_bias": False,
        "qk_norm": False,
        "zero_centered_norm": False,
        "attention_output_gate": False,
        "moe_score_function": "softmax",
        "moe_expert_bias": False,
    }
)
"""ModelArch fields whose default, in a config-defined architecture (train config `model.arch`), is the family's
(field -> the value of a family that does not say)."""


@dataclass(kw_only=True, frozen=True)
class FamilySpec:
    """One decoder-only model family: how its HF config and checkpoint read, what it exports, its tiny test model."""

    name: str
    """The family's name: ModelArch.family, the train config's `model.arch.family`, make_tiny_assets' --family."""
    architectures: tuple[str, ...]
    """HF classes (config.json `architectures`) read as this family; the first is the one the tiny model names."""
    model_types: tuple[str, ...]
    """config.json `model_type` values read as this family (a multimodal container's and its text model's)."""
    export_class: str
    """The HF class written on export (a container family exports its text model)."""
    read_hf: Callable[[dict[str, Any], str], dict[str, Any]]
    """(config dict, where) -> ModelArch(**fields): this family's part of reading a config.json, refusing with a
    one-line UserError what the engine would not compute exactly (a missing field may raise KeyError: the caller
    names it)."""
    hf_config: Callable[[Any, dict[str, Any]], Any]
    """(arch, common HF fields) -> the transformers config that `read_hf` maps back to `arch` (export)."""
    param_rules: tuple[Rule, ...]
    """The parameter map's rules (models/families/param_rules.py: shared rows, one tuple per layer set)."""
    tiny_hf_config: Callable[..., Any]
    """(common HF fields, *, head_dim, layer_types, moe) -> a tiny transformers config of this family (the tests',
    examples/make_tiny_assets.py's); `moe` overrides the expert fields."""
    layer_kinds: tuple[str, ...]
    """Which of LAYER_KINDS its layers are made of (what the planner prices for it)."""
    moe: bool = False
    """A mixture of experts: ModelArch needs num_experts > 0, rollouts may carry `routed_experts`."""
    text_config_container: bool = False
    """Its multimodal config holds the text model's fields under `text_config` (read from there)."""
    hf_text_prefixes: tuple[tuple[str, str], ...] = ()
    """(stored prefix, canonical prefix): a container checkpoint's text-model tensors under the rules' names."""
    hf_not_converted: tuple[str, ...] = ()
    """HF tensor prefixes that are not part of the policy (vision tower, multi-token-prediction head)."""
    train_defaults: Mapping[str, Any] = field(default_factory=dict)
    """Defaults of TRAIN_DEFAULT_FIELDS in a config-defined architecture (a field not given: TRAIN_DEFAULT_FIELDS')."""

    def __post_init__(self) -> None:
        assert self.name.isidentifier(), self.name
        assert self.architectures and self.model_types, f"{self.name}: give its HF classes and model types"
        assert self.export_class in self.architectures, (self.name, self.export_class)
        assert set(self.layer_kinds) <= set(LAYER_KINDS), (self.name, self.layer_kinds)
        assert self.moe == ("moe" in self.layer_kinds), (self.name, "moe flag vs layer kinds")
        assert set(self.train_defaults) <= set(TRAIN_DEFAULT_FIELDS), (self.name, self.train_defaults)
        object.__setattr__(self, "train_defaults", MappingProxyType(dict(self.train_defaults)))

    def train_default(self, field_name: str) -> Any:
        """The family's default of one of TRAIN_DEFAULT_FIELDS."""
        assert field_name in TRAIN_DEFAULT_FIELDS, field_name
        return self.train_defaults.get(field_name, TRAIN_DEFAULT_FIELDS[field_name])


class FamilyRegistry:
    """name -> FamilySpec. A name, an HF class or a model_type claimed twice is refused (ValueError, one line);
    an unknown name is a UserError listing the registered ones."""

    def __init__(self) -> None:
        self._specs: dict[str, FamilySpec] = {}

    def register(self, spec: FamilySpec) -> FamilySpec:
        if spec.name in self._specs:
            raise ValueError(f"model family {spec.name!r} is already registered")
        for other in self._specs.values():
            for what, mine, theirs in (
                ("HF class", spec.architectures, other.architectures),
                ("model_type", spec.model_types, other.model_types),
            ):
                clash = sorted(set(mine) & set(theirs))
                if clash:
                    raise ValueError(
                        f"{what} {clash[0]!r} of family {spec.name!r} is already claimed by family {other.name!r}"
                    )
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> FamilySpec:
        self.get(name)  # an unknown name: the same one line
        return self._specs.pop(name)

    def get(self, name: str) -> FamilySpec:
        spec = self._specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise UserError(f"unknown model family {name!r}; registered: {', '.join(self._specs)}")
        return spec

    def names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    def specs(self) -> tuple[FamilySpec, ...]:
        return tuple(self._specs.values())


FAMILY_REGISTRY = FamilyRegistry()
"""The registered families, in registration order."""


def register_family(spec: FamilySpec) -> FamilySpec:
    """Register `spec` (a duplicate name, HF class or model_type is refused); returns it."""
    return FAMILY_REGISTRY.register(spec)


def unregister_family(name: str) -> FamilySpec:
    """Remove a registered family (tests that register their own); returns its spec."""
    return FAMILY_REGISTRY.unregister(name)


def get_family(name: str) -> FamilySpec:
    """The spec of family `name`; an unknown name is a one-line UserError listing the registered families."""
    return FAMILY_REGISTRY.get(name)


def families() -> tuple[str, ...]:
    """The registered families' names, in registration order."""
    return FAMILY_REGISTRY.names()


def moe_families() -> tuple[str, ...]:
    """The registered mixtures of experts."""
    return tuple(s.name for s in FAMILY_REGISTRY.specs() if s.moe)


def supported_architectures() -> dict[str, str]:
    """HF class -> family, for every registered family."""
    return {a: s.name for s in FAMILY_REGISTRY.specs() for a in s.architectures}


def model_types() -> dict[str, str]:
    """config.json model_type -> family, for every registered family."""
    return {t: s.name for s in FAMILY_REGISTRY.specs() for t in s.model_types}


def export_classes() -> dict[str, str]:
    """family -> the HF class written on export."""
    return {s.name: s.export_class for s in FAMILY_REGISTRY.specs()}


def param_maps() -> dict[str, tuple[Rule, ...]]:
    """family -> its parameter rules."""
    return {s.name: s.param_rules for s in FAMILY_REGISTRY.specs()}
