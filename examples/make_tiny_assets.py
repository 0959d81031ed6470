"""Write a tiny random Hugging Face model and a rollout file to try every command on, offline.

    python examples/make_tiny_assets.py --out /tmp/mb        # -> /tmp/mb/hf/ and /tmp/mb/rollouts.jsonl
    megatron-branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/rollouts.jsonl --out /tmp/mb/grads.safetensors
    torchrun --nproc_per_node 2 -m megatron_branch grad --hf /tmp/mb/hf --rollouts /tmp/mb/rollouts.jsonl \\
        --out /tmp/mb/grads_cp2.safetensors --cp 2
    megatron-branch convert hf-to-mcore --hf /tmp/mb/hf --out /tmp/mb/mcore

The model is random (nothing is downloaded); the rollouts share a prompt per group and response beginnings.
"""

from __future__ import annotations

import argparse
from pathlib import Path


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
    write_rollouts_jsonl(out / "rollouts.jsonl", rollouts)
    print(f"wrote {out / 'hf'} ({args.family}) and {out / 'rollouts.jsonl'} ({len(rollouts)} rollouts)")


if __name__ == "__main__":
    main()
