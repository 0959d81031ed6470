"""The one declarative map between Hugging Face (Llama/Qwen2) and megatron-core parameter names.

Each `Rule` pairs a megatron name with the HF names it is made from and a named transform. Every transform is a
pure, linear re-arrangement of rows (concatenation, interleaving, zero padding), so the same map converts weights
and gradients, in both directions, bit-exactly.

Layouts (verified against megatron-core 0.16.1 source):
- linear_qkv (transformer/attention.py, get_query_key_value_tensors): rows grouped per query group g:
  [the n/ng query heads of g, the k head of g, the v head of g], each head `head_dim` rows. Bias alike.
- linear_fc1 with gated_linear_unit (transformer/mlp.py): the full weight is [gate; up] (SwiGLU chunks the output
  in two halves). Under TP each rank holds [gate_r; up_r]; tp.py handles that, this file sees full tensors only.
- word_embeddings / output_layer: `padded_vocab` rows; rows past the tokenizer's vocabulary are zeros here and
  are dropped on export.
- Two megatron layer specs, one map: the local spec (`get_gpt_layer_local_spec`) names the norms
  `input_layernorm` / `pre_mlp_layernorm`; the TransformerEngine spec (`get_gpt_layer_with_transformer_engine_spec`)
  leaves those slots IdentityOp and fuses each norm into the next projection (TELayerNormColumnParallelLinear), whose
  norm weight is `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`. A rule's `te` field is its TE
  name when it differs; every tensor and transform is the same.

Streaming: `iter_hf_to_mcore` / `iter_mcore_to_hf` ask for the source tensors of one rule at a time, so a caller
that reads lazily (hf_io) holds about one layer in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch

# Buffers some older HF checkpoints carry; recomputed from the config, never converted.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
TRANSFORM_NAMES = ("identity", "qkv_interleave", "qkv_bias_interleave", "fused_gate_up", "vocab_pad")
SPECS = ("local", "te")
"""megatron layer specs the map names tensors for: megatron-core's local spec and its TransformerEngine spec."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One megatron tensor <-> one or more HF tensors. `{i}` in a name is the layer index."""

    mcore: str
    hf: tuple[str, ...]
    transform: str
    """identity | qkv_interleave | qkv_bias_interleave | fused_gate_up | vocab_pad"""
    when: str | None = None
    """None (always), "qkv_bias" (arch.qkv_bias) or "untied" (not arch.tie_word_embeddings)."""
    te: str | None = None
    """The megatron name under the TransformerEngine layer spec, when it differs from `mcore`."""

    def __post_init__(self) -> None:
        assert self.transform in TRANSFORM_NAMES, self.transform
        assert self.when in (None, "qkv_bias", "untied"), self.when

    def name(self, spec: str = "local") -> str:
        """The megatron name (with `{i}`) under `spec` ("local" or "te")."""
        assert spec in SPECS, spec
        return self.te if spec == "te" and self.te else self.mcore

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.mcore


_L = "model.layers.{i}."
_M = "decoder.layers.{i}."
# Llama and Qwen2 share names; Qwen2 adds the QKV bias (arch.qkv_bias), so one list serves both families.
DECODER_RULES: tuple[Rule, ...] = (
    Rule(mcore="embedding.word_embeddings.weight", hf=("model.embed_tokens.weight",), transform="vocab_pad"),
    Rule(
        mcore=_M + "input_layernorm.weight",
        hf=(_L + "input_layernorm.weight",),
        transform="identity",
        te=_M + "self_attention.linear_qkv.layer_norm_weight",
    ),
    Rule(
        mcore=_M + "self_attention.linear_qkv.weight",
        hf=tuple(_L + f"self_attn.{p}_proj.weight" for p in "qkv"),
        transform="qkv_interleave",
    ),
    Rule(
        mcore=_M + "self_attention.linear_qkv.bias",
        hf=tuple(_L + f"self_attn.{p}_proj.bias" for p in "qkv"),
        transform="qkv_bias_interleave",
        when="qkv_bias",
    ),
    Rule(
        mcore=_M + "self_attention.linear_proj.weight",
        hf=(_L + "self_attn.o_proj.weight",),
        transform="identity",
    ),
    Rule(
        mcore=_M + "pre_mlp_layernorm.weight",
        hf=(_L + "post_attention_layernorm.weight",),
        transform="identity",
        te=_M + "mlp.linear_fc1.layer_norm_weight",
    ),
    Rule(
        mcore=_M + "mlp.linear_fc1.weight",
        hf=(_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
        transform="fused_gate_up",
    ),
    Rule(mcore=_M + "mlp.linear_fc2.weight", hf=(_L + "mlp.down_proj.weight",), transform="identity"),
    Rule(mcore="decoder.final_layernorm.weight", hf=("model.norm.weight",), transform="identity"),
    Rule(mcore="output_layer.weight", hf=("lm_head.weight",), transform="vocab_pad", when="untied"),
)
PARAM_MAPS: dict[str, tuple[Rule, ...]] = {"llama": DECODER_RULES, "qwen2": DECODER_RULES}


# --- transforms: (hf tensors) -> mcore tensor, and back ------------------------------------------------------------
def _qkv_to_mcore(ts: list[torch.Tensor], arch: ModelArch, padded_vocab: int) -> torch.Tensor:
    q, k, v = ts
    ng, hd = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    return torch.cat(
        [q.reshape(ng, per * hd, *rest), k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1
    ).reshape(-1, *rest)


def _qkv_to_hf(t: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    ng, hd = arch.num_query_groups, arch.head_dim
    per = arch.num_attention_heads // ng
    rest = t.shape[1:]
    q, k, v = t.reshape(ng, (per + 2) * hd, *rest).split([per * hd, hd, hd], dim=1)
    return [q.reshape(-1, *rest).clone(), k.reshape(-1, *rest).clone(), v.reshape(-1, *rest).clone()]


def _vocab_pad(ts: list[torch.Tensor], arch: ModelArch, padded_vocab: int) -> torch.Tensor:
    (t,) = ts
    if padded_vocab == t.shape[0]:
        return t
    out = t.new_zeros(padded_vocab, *t.shape[1:])
    out[: t.shape[0]] = t
    return out


_TRANSFORMS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., list[torch.Tensor]]]] = {
    "identity": (lambda ts, arch, pv: ts[0], lambda t, arch: [t]),
    "qkv_interleave": (_qkv_to_mcore, _qkv_to_hf),
    "qkv_bias_interleave": (_qkv_to_mcore, _qkv_to_hf),
    "fused_gate_up": (
        lambda ts, arch, pv: torch.cat(ts, dim=0),
        lambda t, arch: [c.clone() for c in t.chunk(2)],
    ),
    "vocab_pad": (_vocab_pad, lambda t, arch: [t[: arch.vocab_size]]),
}
assert set(_TRANSFORMS) == set(TRANSFORM_NAMES)


# --- expected shapes ------------------------------------------------------------------------------------------------
def hf_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of `arch` with the shape its config implies (the order of the rules)."""
    h, hd, f, v = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size, arch.vocab_size
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    by_suffix = {
        "embed_tokens.weight": (v, h),
        "lm_head.weight": (v, h),
        "layernorm.weight": (h,),
        "norm.weight": (h,),
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
    }
    out = {}
    for rule, layer in _active_rules(arch):
        for name in rule.hf:
            name = name.format(i=layer)
            out[name] = next(s for suf, s in by_suffix.items() if name.endswith(suf))
    return out


def _rules(arch: ModelArch) -> tuple[Rule, ...]:
    if arch.family not in PARAM_MAPS:
        raise UserError(
            f"no parameter map for model family {arch.family!r}; supported: {', '.join(PARAM_MAPS)}"
        )
    return PARAM_MAPS[arch.family]


def _active_rules(arch: ModelArch) -> Iterator[tuple[Rule, int | None]]:
    """(rule, layer) in file order: embedding, then layer by layer, then the head (one layer resident at a time)."""
    rules = [r for r in _rules(arch) if _applies(r, arch)]
    for r in rules:
        if not r.per_layer and r.mcore.startswith("embedding."):
            yield r, None
    for i in range(arch.num_layers):
        for r in rules:
            if r.per_layer:
                yield r, i
    for r in rules:
        if not r.per_layer and not r.mcore.startswith("embedding."):
            yield r, None


def _applies(rule: Rule, arch: ModelArch) -> bool:
    if rule.when == "qkv_bias":
        return arch.qkv_bias
    if rule.when == "untied":
        return not arch.tie_word_embeddings
    return True


def mcore_names(arch: ModelArch, spec: str = "local") -> list[str]:
    return [r.name(spec).format(i=i) for r, i in _active_rules(arch)]


def sharded_keys(arch: ModelArch) -> list[str]:
    """The tensor keys of a megatron dist checkpoint of `arch`, under EITHER layer spec.

    megatron stacks the layers of one tensor into one sharded key (`decoder.layers.X`, the layer an offset), and
    names it as the TE spec's module tree does: the local spec's `sharded_state_dict_keys_map`
    (`input_layernorm.` -> `self_attention.linear_qkv.layer_norm_`, `pre_mlp_layernorm.` ->
    `mlp.linear_fc1.layer_norm_`, gpt_layer_specs.py) exists so that one checkpoint loads under both specs.
    Hence: the rules' TE names without the layer index.
    """
    return list(dict.fromkeys(r.name("te").replace("{i}.", "") for r, _ in _active_rules(arch)))


def detect_spec(names: Iterable[str]) -> str:
    """ "te" when the names are those of megatron's TransformerEngine layer spec (fused norm weights), else "local"."""
    return "te" if any(n.endswith("linear_qkv.layer_norm_weight") for n in names) else "local"


# --- streaming conversion -------------------------------------------------------------------------------------------
def check_hf_names(hf_names: Iterable[str], arch: ModelArch, *, where: str = "checkpoint") -> None:
    """Refuse missing or unexpected HF tensors (a tied lm_head.weight copy is accepted and ignored)."""
    expected = set(hf_shapes(arch))
    given = {n for n in hf_names if not n.endswith(IGNORED_HF_SUFFIXES)}
    if arch.tie_word_embeddings:
        given.discard("lm_head.weight")
    missing = [n for n in hf_shapes(arch) if n not in given]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"missing tensor {missing[0]!r}{more} required by the config", where=where)
    unexpected = sorted(given - expected)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UserError(f"unexpected tensor {unexpected[0]!r}{more} not described by the config", where=where)


def _check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], where: str) -> None:
    if tuple(t.shape) != expected:
        raise UserError(
            f"tensor {name!r} has shape {list(t.shape)} but the config implies {list(expected)}", where=where
        )


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
    check_hf_names(hf_names, arch, where=where)
    shapes = hf_shapes(arch)
    for rule, layer in _active_rules(arch):
        srcs = []
        for pat in rule.hf:
            name = pat.format(i=layer)
            t = get_hf_tensor(name)
            _check_shape(name, t, shapes[name], where)
            srcs.append(t)
        yield rule.name(spec).format(i=layer), _TRANSFORMS[rule.transform][0](srcs, arch, padded_vocab)


def iter_mcore_to_hf(
    get_mcore_tensor: Callable[[str], torch.Tensor],
    arch: ModelArch,
    *,
    where: str = "megatron state",
    spec: str = "local",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) in HF file order; vocabulary padding is dropped. Works for weights and grads."""
    shapes = hf_shapes(arch)
    for rule, layer in _active_rules(arch):
        mname = rule.name(spec).format(i=layer)
        t = get_mcore_tensor(mname)
        _check_mcore_shape(rule, t, arch, mname, where)
        outs = _TRANSFORMS[rule.transform][1](t, arch)
        for pat, out in zip(rule.hf, outs, strict=True):
            name = pat.format(i=layer)
            _check_shape(name, out, shapes[name], where)
            yield name, out


def _check_mcore_shape(rule: Rule, t: torch.Tensor, arch: ModelArch, mname: str, where: str) -> None:
    """Check the megatron tensor's shape before re-arranging it (a wrong shape would fail inside a reshape)."""
    if rule.transform == "vocab_pad":
        if t.dim() != 2 or t.shape[0] < arch.vocab_size or t.shape[1] != arch.hidden_size:
            raise UserError(
                f"tensor {mname!r} has shape {list(t.shape)}; expected [>= {arch.vocab_size}, {arch.hidden_size}]",
                where=where,
            )
        return
    shapes = hf_shapes(arch)
    parts = [shapes[p.format(i=0 if rule.per_layer else None)] for p in rule.hf]
    expected = (sum(s[0] for s in parts), *parts[0][1:])
    _check_shape(mname, t, expected, where)


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
