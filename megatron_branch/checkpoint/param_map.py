"""The one map between Hugging Face and megatron-core parameter names, for every family: which of the declarative
rules (the family's `param_rules`, from models/families/param_rules.py: one `Rule` per megatron tensor, its HF
tensors and transform; the layouts they follow) apply to an arch and which layers, the HF container's names, and the conversions in both directions.

Streaming: `iter_hf_to_mcore` / `iter_mcore_to_hf` ask for the source tensors of one rule at a time, so a caller
that reads lazily (hf_io) holds about one layer in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from megatron_branch.checkpoint.fused_experts import fuse_stream, split_views
from megatron_branch.checkpoint.layouts import TRANSFORMS, TRANSPOSED, hf_shape, mcore_rows
from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.models.families import get_family
from megatron_branch.models.families.param_rules import IGNORED_HF_SUFFIXES, PATTERN_LAYERS, Rule


# --- which rules, which layers ---------------------------------------------------------------------------------------
def _rules(arch: ModelArch) -> tuple[Rule, ...]:
    return get_family(arch.family).param_rules  # an unknown family: one line naming the registered ones


def _applies(rule: Rule, arch: ModelArch, layer: int | None) -> bool:
    if rule.when == "qkv_bias" and not arch.qkv_bias:
        return False
    if rule.when == "untied" and arch.tie_word_embeddings:
        return False
    if rule.when == "qk_norm" and not arch.qk_norm:
        return False
    if rule.when == "shared_expert" and not arch.shared_expert_ffn_hidden_size:
        return False
    if rule.when == "shared_expert_gate" and not arch.shared_expert_gate:
        return False
    if rule.when == "expert_bias" and not arch.moe_expert_bias:
        return False
    if rule.when in ("q_lora", "no_q_lora") and (rule.when == "q_lora") != (arch.q_lora_rank is not None):
        return False
    if rule.when == "mamba_conv_bias" and not arch.mamba_conv_bias:
        return False
    if layer is not None and rule.mlp is not None and (rule.mlp == "moe") != arch.is_moe_layer(layer):
        return False
    if rule.layers in PATTERN_LAYERS:  # Nemotron-H: the layers of this hybrid_override_pattern character
        return layer is None or arch.hybrid_override_pattern[layer] == rule.layers
    if rule.layers is None or layer is None:
        return True
    return (rule.layers == "linear") == arch.is_linear(layer)


def _active_rules(arch: ModelArch) -> Iterator[tuple[Rule, int | None]]:
    """(rule, layer) in file order: embedding, then layer by layer, then the head (one layer resident at a time)."""
    rules = _rules(arch)
    for r in rules:
        if not r.per_layer and r.mcore.startswith("embedding.") and _applies(r, arch, None):
            yield r, None
    for i in range(arch.num_layers):
        for r in rules:
            if r.per_layer and _applies(r, arch, i):
                if r.per_expert:  # one rule per routed expert, in expert order
                    yield from ((r.for_expert(j), i) for j in range(arch.num_experts))
                else:
                    yield r, i
    for r in rules:
        if not r.per_layer and not r.mcore.startswith("embedding.") and _applies(r, arch, None):
            yield r, None


def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of `arch` (canonical text-model names) with the shape its config implies."""
    return {
        name.format(i=layer): hf_shape(name.format(i=layer), arch)
        for rule, layer in _active_rules(arch)
        for name in rule.hf
    }


def mcore_names(arch: ModelArch, spec: str = "local") -> list[str]:
    return [r.name(spec).format(i=i) for r, i in _active_rules(arch)]


def sharded_keys(arch: ModelArch) -> list[str]:
    """The tensor keys of a megatron dist checkpoint of `arch`, under EITHER layer spec.

    megatron stacks the layers of one tensor into one sharded key (`decoder.layers.X`, the layer an offset), unless
    the layers differ (a hybrid: `linear_attention_freq`, transformer_block.py), when every layer keeps its index;
    and it names it as the TE spec's module tree does: the local spec's `sharded_state_dict_keys_map`
    (`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`, `pre_mlp_layernorm.` ->
    `mlp.linear_fc1.layer_norm_`, gpt_layer_specs.py; models/gdn.py for GDN layers) exists so that one
    checkpoint loads under both specs. Hence: the rules' TE names, without the layer index unless hybrid. (A
    GatedDeltaNet saves in_proj and conv1d as several parts of one key: the key here is the tensor's.)
    """
    if arch.is_hybrid or arch.has_dense_mlp_layers or arch.hybrid_override_pattern:  # non-homogeneous layers
        return list(dict.fromkeys(r.checkpoint_key().format(i=i) for r, i in _active_rules(arch)))
    return list(dict.fromkeys(r.checkpoint_key().replace("{i}.", "") for r, _ in _active_rules(arch)))


def detect_spec(names: Iterable[str]) -> str:
    """ "te" when the names are those of megatron's TransformerEngine layer spec (fused norm weights), else "local"."""
    fused = (
        "linear_qkv.layer_norm_weight",
        "in_proj.layer_norm_weight",
        "linear_kv_up_proj.layer_norm_weight",
    )
    return "te" if any(n.endswith(fused) for n in names) else "local"


# --- HF names: the container's view ------------------------------------------------------------------------------------
def hf_name_map(hf_names: Iterable[str], arch: ModelArch) -> dict[str, str]:
    """canonical HF name (the rules' names) -> the name stored in the checkpoint, for every stored tensor that is
    part of the policy (a container's text model renamed; vision tower, MTP head and rotary buffers dropped)."""
    spec = get_family(arch.family)
    prefixes, skip = spec.hf_text_prefixes, spec.hf_not_converted
    out: dict[str, str] = {}
    for stored in hf_names:
        if stored.endswith(IGNORED_HF_SUFFIXES) or stored.startswith(skip):
            continue
        canonical = stored
        for old, new in prefixes:
            if stored.startswith(old):
                canonical = new + stored[len(old) :]
        if canonical in out:
            raise UserError(f"tensor {canonical!r} is stored twice (as {out[canonical]!r} and {stored!r})")
        out[canonical] = stored
    return out


def check_hf_names(hf_names: Iterable[str], arch: ModelArch, *, where: str = "checkpoint") -> dict[str, str]:
    """Refuse missing or unexpected HF tensors (a tied lm_head.weight copy is accepted and ignored).
    Returns `hf_name_map` (canonical -> stored)."""
    names = hf_name_map(hf_names, arch)
    expected = hf_shapes(arch)
    if arch.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    missing = [n for n in expected if n not in names]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"missing tensor {missing[0]!r}{more} required by the config", where=where)
    unexpected = sorted(names[n] for n in set(names) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UserError(f"unexpected tensor {unexpected[0]!r}{more} not described by the config", where=where)
    return names


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], where: str) -> None:
    if tuple(t.shape) != expected:
        raise UserError(
            f"tensor {name!r} has shape {list(t.shape)} but the config implies {list(expected)}", where=where
        )


# --- streaming conversion -------------------------------------------------------------------------------------------
def iter_hf_to_mcore(
    hf_names: Iterable[str],
    get_hf_tensor: Callable[[str], torch.Tensor],
    arch: ModelArch,
    *,
    padded_vocab: int,
    where: str = "checkpoint",
    spec: str = "local",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (megatron name under `spec`, full megatron tensor) one at a time, reading the HF tensors each needs."""
    if padded_vocab < arch.vocab_size:
        raise UserError(f"padded vocabulary {padded_vocab} is smaller than vocab_size={arch.vocab_size}")
    hf_names, get_hf_tensor = split_views(hf_names, get_hf_tensor, arch.num_experts, where=where)  # gpt-oss
    stored = check_hf_names(hf_names, arch, where=where)
    shapes = hf_shapes(arch)
    for rule, layer in _active_rules(arch):
        srcs = []
        for pat in rule.hf:
            name = pat.format(i=layer)
            t = get_hf_tensor(stored[name])
            _check_shape(stored[name], t, shapes[name], where)
            srcs.append(t)
        yield rule.name(spec).format(i=layer), TRANSFORMS[rule.transform][0](srcs, arch, padded_vocab)


def iter_mcore_to_hf(
    get_mcore_tensor: Callable[[str], torch.Tensor],
    arch: ModelArch,
    *,
    where: str = "megatron state",
    spec: str = "local",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) in HF file order; vocabulary padding is dropped. Works for weights and grads.
    gpt-oss's experts come out fused, as its checkpoints store them (checkpoint/fused_experts.py)."""
    return fuse_stream(_iter_mcore_to_hf(get_mcore_tensor, arch, where=where, spec=spec))


def _iter_mcore_to_hf(
    get_mcore_tensor: Callable[[str], torch.Tensor], arch: ModelArch, *, where: str, spec: str
) -> Iterator[tuple[str, torch.Tensor]]:
    shapes = hf_shapes(arch)
    for rule, layer in _active_rules(arch):
        mname = rule.name(spec).format(i=layer)
        t = get_mcore_tensor(mname)
        _check_mcore_shape(rule, layer, t, arch, mname, where)
        outs = TRANSFORMS[rule.transform][1](t, arch)
        for pat, out in zip(rule.hf, outs, strict=True):
            name = pat.format(i=layer)
            _check_shape(name, out, shapes[name], where)
            yield name, out


def _check_mcore_shape(
    rule: Rule, layer: int | None, t: torch.Tensor, arch: ModelArch, mname: str, where: str
) -> None:
    """Check the megatron tensor's shape before re-arranging it (a wrong shape would fail inside a reshape)."""
    if rule.transform == "vocab_pad":
        if t.dim() != 2 or t.shape[0] < arch.vocab_size or t.shape[1] != arch.hidden_size:
            raise UserError(
                f"tensor {mname!r} has shape {list(t.shape)}; expected [>= {arch.vocab_size}, {arch.hidden_size}]",
                where=where,
            )
        return
    shape = mcore_rows([hf_shape(p.format(i=layer), arch) for p in rule.hf])
    _check_shape(mname, t, shape[::-1] if rule.transform in TRANSPOSED else shape, where)


def hf_to_mcore_state(
    hf_state: Mapping[str, torch.Tensor], arch: ModelArch, *, padded_vocab: int, spec: str = "local"
) -> dict[str, torch.Tensor]:
    """Full (unsharded) megatron tensors, named for `spec`, from full HF tensors."""
    return dict(
        iter_hf_to_mcore(hf_state.keys(), hf_state.__getitem__, arch, padded_vocab=padded_vocab, spec=spec)
    )


def mcore_to_hf_state(
    mcore_state: Mapping[str, torch.Tensor], arch: ModelArch, *, spec: str | None = None
) -> dict[str, torch.Tensor]:
    """Full HF tensors from full megatron tensors (weights or gradients); padded vocabulary rows are dropped.
    `spec` None = detected from the names (TE's fused norm weights); TE's `_extra_state` entries are ignored."""
    spec = spec or detect_spec(mcore_state.keys())
    missing = [n for n in mcore_names(arch, spec) if n not in mcore_state]
    if missing:
        raise UserError(f"megatron state lacks tensor {missing[0]!r}")
    return dict(iter_mcore_to_hf(mcore_state.__getitem__, arch, spec=spec))
