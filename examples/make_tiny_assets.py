"""Write a tiny random Hugging Face model and rollout files to try every command on, offline.

    python examples/make_tiny_assets.py --out /tmp/mb   # -> /tmp/mb/hf/, rollouts.jsonl, pairs.jsonl
    megatron-branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/rollouts.jsonl --out /tmp/mb/grads.safetensors
    megatron-branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/pairs.jsonl --out /tmp/mb/dpo.safetensors --objective dpo
    torchrun --nproc_per_node 2 -m megatron_branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/rollouts.jsonl \\
        --out /tmp/mb/grads_cp2.safetensors --cp 2
    megatron-branch convert hf-to-mcore --hf /tmp/mb/hf --out /tmp/mb/mcore

    python examples/make_tiny_assets.py --out /tmp/moe --family qwen3_moe   # any registered family
    megatron-branch grad --hf /tmp/moe/hf --rollouts /tmp/moe/rollouts.jsonl --out /tmp/moe/g.safetensors \\
        --routing-replay

The model is random (nothing is downloaded); the rollouts share a prompt per group and response beginnings, and
carry reference logprobs (`ref_logprobs`, for the KL terms); pairs.jsonl holds DPO preference pairs (`pair`,
`chosen`, `ref_logprobs`) over the same prompts. --family picks any registered model family (default qwen2); a
hybrid's tiny model has one gated-delta-net and one full-attention layer, and a mixture of experts' rollouts also
carry `routed_experts` (for each token of prompt + response, per MoE layer, the experts the HF model routes it to:
what a sampler records), so that `grad --routing-replay` can be tried.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch


def routed_experts(model: Any, tokens: list[int]) -> list[list[list[int]]]:
    """[token][MoE layer][k]: the experts the HF model routes each token of `tokens` to (the top-k of its routers'
    logits, transformers' `output_router_logits`: softmax and renormalisation keep the order). A DeepSeek-style
    router (GLM-4.5's: a correction bias and a group limit decide, not the logits' order) is asked for its own
    choice: its forward returns (logits, weights, indices)."""
    biased = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    chosen: dict[int, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, li=li: chosen.__setitem__(li, out[2].sort(dim=-1).values))
        for li, m in enumerate(biased)
    ]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), use_cache=False, output_router_logits=not biased)
    finally:
        for h in hooks:
            h.remove()
    if biased:
        picks = [chosen[li] for li in range(len(biased))]
    else:
        k = model.config.num_experts_per_tok
        picks = [logits.topk(k, dim=-1).indices for logits in out.router_logits]  # per MoE layer [tokens, k]
    return torch.stack(picks, dim=1).tolist()  # [tokens, layers, k]


def main(argv: list[str] | None = None) -> None:
    from megatron_branch.models.families import families, get_family

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to create (hf/ and rollouts.jsonl inside)")
    ap.add_argument("--family", default="qwen2", choices=families(), help="model family (default qwen2)")
    ap.add_argument("--groups", type=int, default=2, help="prompt groups")
    ap.add_argument("--prompt-len", type=int, default=24)
    args = ap.parse_args(argv)

    from megatron_branch.data import write_rollouts_jsonl
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = get_family(args.family)
    layers = ("linear_attention", "full_attention") if "gdn" in spec.layer_kinds else None  # both mechanisms
    model = tiny_hf_model(tiny_hf_config(args.family, layer_types=layers), seed=0).eval()
    model.save_pretrained(out / "hf")
    rollouts = random_tree_rollouts(
        groups=args.groups, prompt_len=args.prompt_len, branches=3, levels=2, seg_len=(3, 9)
    )
    g = torch.Generator().manual_seed(1)

    def ref(n: int) -> tuple[float, ...]:  # plausible reference logprobs: negative, seeded
        return tuple((-0.1 - 3 * torch.rand(n, generator=g, dtype=torch.float64)).tolist())

    rollouts = [dataclasses.replace(r, token_fields={**r.token_fields, "ref_logprobs": ref(len(r.response))})
                for r in rollouts]  # fmt: skip
    if spec.moe:
        rollouts = [
            dataclasses.replace(r, routed_experts=routed_experts(model, [*r.prompt, *r.response]))
            for r in rollouts
        ]
    write_rollouts_jsonl(out / "rollouts.jsonl", rollouts)
    pairs = []
    for k, prompt in enumerate(dict.fromkeys(r.prompt for r in rollouts)):  # the first two of each group
        two = [r for r in rollouts if r.prompt == prompt][:2]
        pairs += [dataclasses.replace(r, advantage=None, pair=k, chosen=j == 0) for j, r in enumerate(two)]
    write_rollouts_jsonl(out / "pairs.jsonl", pairs)
    records = ", with routed_experts" if spec.moe else ""
    print(
        f"wrote {out / 'hf'} ({args.family}), {out / 'rollouts.jsonl'} ({len(rollouts)} rollouts{records}) and "
        f"{out / 'pairs.jsonl'} ({len(pairs) // 2} DPO pairs)"
    )


if __name__ == "__main__":
    main()
