"""gpt-oss's experts as HF stores them: four 3-D tensors per layer, the expert index first, split into one
tensor per expert for the parameter map's per-expert rules and stacked back on the way out.

    model.layers.{i}.mlp.experts.gate_up_proj       [E, h, 2e]  x @ W: columns INTERLEAVED gate, up, gate, up, ..
    model.layers.{i}.mlp.experts.gate_up_proj_bias  [E, 2e]     interleaved alike
    model.layers.{i}.mlp.experts.down_proj          [E, e, h]
    model.layers.{i}.mlp.experts.down_proj_bias     [E, h]

(transformers' GptOssExperts; save_pretrained writes them as they are: gpt_oss has no weight conversion.) The map's
per-expert names are `model.layers.{i}.mlp.experts.{j}.gate_up_proj` and so on, row j of each tensor
(models/families/param_rules.py GPT_OSS_RULES; the de-interleaving is checkpoint/layouts.py's). Other families'
fused experts (Qwen3.5-MoE's [E, 2e, h] [gate; up]) are hf_io.py's: told apart by the bias tensors only gpt-oss has.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from megatron_branch.errors import UserError

KINDS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
"""gpt-oss's four fused expert tensors (the name after `mlp.experts.`)."""
_FUSED = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<kind>" + "|".join(KINDS) + r")$")
_SPLIT = re.compile(r"^(?P<stem>.*\.mlp\.experts)\.(?P<j>\d+)\.(?P<kind>" + "|".join(KINDS) + r")$")


def is_fused(names: Iterable[str]) -> bool:
    """True when `names` hold gpt-oss's fused experts (their bias tensors: no other family stores those)."""
    return any(n.endswith(".mlp.experts.gate_up_proj_bias") for n in names)


def split_views(
    names: Iterable[str], get: Callable[[str], torch.Tensor], num_experts: int, *, where: str = "checkpoint"
) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """(names with every fused tensor replaced by its `num_experts` per-expert names, a getter for both kinds). The
    last fused tensor read is kept, so reading a layer's experts in order reads each fused tensor once."""
    names = list(names)
    if not is_fused(names):
        return names, get
    views: dict[str, tuple[str, int]] = {}
    out = []
    for n in names:
        m = _FUSED.match(n)
        if m is None:
            out.append(n)
            continue
        for j in range(num_experts):
            views[f"{m['stem']}.{j}.{m['kind']}"] = (n, j)
        out.extend(v for v, (src, _) in views.items() if src == n)
    held: dict[str, torch.Tensor] = {}

    def get_view(name: str) -> torch.Tensor:
        if name not in views:
            return get(name)
        src, j = views[name]
        if src not in held:
            held.clear()
            held[src] = get(src)
            if held[src].dim() < 2 or held[src].shape[0] != num_experts:
                raise UserError(
                    f"fused experts {src!r} have shape {list(held[src].shape)}; expected {num_experts} experts "
                    "first",
                    where=where,
                )
        return held[src][j].clone()

    return out, get_view


def fuse_stream(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in map order with per-expert gpt-oss names -> the same with each layer's experts stacked into
    the fused tensors, yielded once the layer's next tensor (or the end) shows its experts are complete."""
    pending: dict[str, list[torch.Tensor]] = {}

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        for fused, parts in pending.items():
            yield fused, torch.stack(parts)
        pending.clear()

    for name, t in items:
        m = _SPLIT.match(name)
        if m is None:
            yield from flush()
            yield name, t
            continue
        parts = pending.setdefault(f"{m['stem']}.{m['kind']}", [])
        assert int(m["j"]) == len(parts), f"experts out of order at {name}"
        parts.append(t)
    yield from flush()
