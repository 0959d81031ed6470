"""The `megatron-branch` command (also `python -m megatron_branch`, and under torchrun).

User errors (UserError: bad rollouts, impossible parallel sizes, broken checkpoints) print ONE line
`megatron-branch: error: <what and where>` on stderr and exit with status 2; no traceback. Under torchrun rank 0
prints an error that every rank raised once; see docs/errors.md (also for what torchrun itself adds).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from megatron_branch import __version__
from megatron_branch.errors import UserError, one_line


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (usage + one error line, exit status 2), printed by rank 0 only under torchrun: every
    rank parses the same command line, so every rank fails alike."""

    def error(self, message: str):  # type: ignore[override]
        if os.environ.get("RANK") not in (None, "0"):
            sys.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    from megatron_branch.commands.bench import add_bench_command
    from megatron_branch.commands.grad import add_grad_command

    parser = ArgumentParser(
        prog="megatron-branch",
        description="Exact shared-prefix (branch replay) RL training for Megatron-Core.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-branch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_grad_command(sub)
    add_bench_command(sub)
    from megatron_branch.commands.plan import add_plan_command

    add_plan_command(sub)
    from megatron_branch.commands.train import add_train_command

    add_train_command(sub)
    try:
        from megatron_branch.checkpoint.cli import add_convert_commands
    except ImportError:  # pragma: no cover - only while the checkpoint tools are absent
        pass
    else:
        add_convert_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns at import about apex/TE being absent on CPU; that is expected here, not news.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if (
        extra
    ):  # `train` takes its overrides anywhere on the line (argparse stops collecting them at an option)
        if not getattr(args, "collect_extra", False) or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    import torch.distributed as dist

    owns_distributed = not dist.is_initialized()  # in-process callers (tests) keep their own process group
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        report_user_error(e)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if owns_distributed and dist.is_initialized():
            from megatron_branch.parallel.groups import shutdown_distributed

            shutdown_distributed()


def report_user_error(e: UserError) -> None:
    """Print `e` as ONE line on stderr: on rank 0 only when every rank raised it (`all_ranks`), else on the rank
    that raised it (prefixed with its rank, so that an error seen by one rank only is never lost)."""
    rank = os.environ.get("RANK")
    if rank not in (None, "0") and getattr(e, "all_ranks", False):
        return
    prefix = "megatron-branch: error: " if rank in (None, "0") else f"megatron-branch[rank {rank}]: error: "
    print(prefix + one_line(e), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
