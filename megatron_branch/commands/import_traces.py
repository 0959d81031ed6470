"""`megatron-branch import-traces --traces T.jsonl --tokenizer DIR --out rollouts.jsonl`: agent traces -> rollouts.

Each line of T.jsonl is one chat transcript (OpenAI-style messages with roles system / user / assistant / tool and
tool calls, optional `tools`, `advantage`, `pair`, `chosen`). It is tokenised with the chat template of the
tokenizer in DIR (a transformers folder, loaded locally) into one rollout whose loss_mask is 1 on the assistant
turns' tokens only (data/traces.py); the rollouts file trains through `megatron-branch grad` as usual, and
sharing across traces (the system prompt, the tools, common turns) is found by the prefix tree. A trace the
template re-tokenises differently once later turns are added is refused in one line naming file:line and the turn.
Every trace is checked before anything is written. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_import_traces_command(sub: Any) -> None:
    from megatron_branch.outputs import add_overwrite_argument

    p = sub.add_parser(
        "import-traces",
        help="agent traces (chat messages) -> rollouts with loss masks, by the model's chat template",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--traces", required=True, help="JSONL of chat transcripts (one per line)")
    p.add_argument("--tokenizer", required=True, help="a transformers tokenizer folder with a chat template")
    p.add_argument("--out", required=True, help="the rollouts JSONL to write")
    add_overwrite_argument(p)
    p.set_defaults(func=run_import_traces)


def run_import_traces(args: argparse.Namespace) -> int:
    from megatron_branch.data import PrefixTree, write_rollouts_jsonl
    from megatron_branch.data.traces import read_traces_jsonl
    from megatron_branch.errors import UserError
    from megatron_branch.outputs import check_output_file
    from megatron_branch.tokenizer.hf import HFTokenizer

    check_output_file(args.out, overwrite=args.overwrite, what="rollouts file")
    tokenizer = HFTokenizer(args.tokenizer)
    if not getattr(tokenizer.transformers, "chat_template", None):
        raise UserError("the tokenizer has no chat template", where=str(args.tokenizer))
    rollouts = read_traces_jsonl(args.traces, tokenizer.transformers)
    write_rollouts_jsonl(args.out, rollouts, overwrite=args.overwrite)
    tree = PrefixTree.build(rollouts)
    trained = sum(r.num_trained for r in rollouts)
    print(
        json.dumps(
            {
                "rollouts": len(rollouts),
                "out": str(args.out),
                "response_tokens": tree.num_response_tokens_logical(),
                "trained_token_fraction": trained / tree.num_response_tokens_logical(),
                "positions_logical": tree.positions_logical,
                "positions_computed": tree.positions_computed,
            }
        )
    )
    return 0
