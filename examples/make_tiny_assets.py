"""Write a tiny random Hugging Face model and rollout files to try every command on, offline.

    python examples/make_tiny_assets.py --out /tmp/mb   # -> /tmp/mb/hf/, rollouts.jsonl, pairs.jsonl
    megatron-branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/rollouts.jsonl --out /tmp/mb/grads.safetensors
    megatron-branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/pairs.jsonl --out /tmp/mb/dpo.safetensors --objective dpo
    torchrun --nproc_per_node 2 -m megatron_branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/rollouts.jsonl \\
        --out /tmp/mb/grads_cp2.safetensors --cp 2
    megatron-branch convert hf-to-mcore --hf /tmp/mb/hf --out /tmp/mb/mcore

The model is random (nothing is downloaded); the rollouts share a prompt per group and response beginnings, and
carry reference logprobs (`ref_logprobs`, for the KL terms); pairs.jsonl holds DPO preference pairs (`pair`,
`chosen`, `ref_logprobs`) over the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder to create (hf/ and rollouts.jsonl inside)")
    ap.add_argument("--family", default="qwen2", choices=["llama", "qwen2"])
    ap.add_argument("--groups", type=int, default=2, help="prompt groups")
    ap.add_argument("--prompt-len", type=int, default=24)
    args = ap.parse_args(argv)

    from megatron_branch.data import write_rollouts_jsonl
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(tiny_hf_config(args.family), seed=0).save_pretrained(out / "hf")
    rollouts = random_tree_rollouts(
        groups=args.groups, prompt_len=args.prompt_len, branches=3, levels=2, seg_len=(3, 9)
    )
    g = torch.Generator().manual_seed(1)

    def ref(n: int) -> tuple[float, ...]:  # plausible reference logprobs: negative, seeded
        return tuple((-0.1 - 3 * torch.rand(n, generator=g, dtype=torch.float64)).tolist())

    rollouts = [dataclasses.replace(r, token_fields={**r.token_fields, "ref_logprobs": ref(len(r.response))})
                for r in rollouts]  # fmt: skip
    write_rollouts_jsonl(out / "rollouts.jsonl", rollouts)
    pairs = []
    for k, prompt in enumerate(dict.fromkeys(r.prompt for r in rollouts)):  # the first two of each group
        two = [r for r in rollouts if r.prompt == prompt][:2]
        pairs += [dataclasses.replace(r, advantage=None, pair=k, chosen=j == 0) for j, r in enumerate(two)]
    write_rollouts_jsonl(out / "pairs.jsonl", pairs)
    print(
        f"wrote {out / 'hf'} ({args.family}), {out / 'rollouts.jsonl'} ({len(rollouts)} rollouts) and "
        f"{out / 'pairs.jsonl'} ({len(pairs) // 2} DPO pairs)"
    )


if __name__ == "__main__":
    main()
