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


COMMANDS: dict[str, tuple[str, str, str]] = {
    "grad": (
        "megatron_branch.commands.grad", "add_grad_command",
        "gradient of a policy loss (default --objective pg) over a rollout file (parity checks from outside)",
    ),
    "bench": (
        "megatron_branch.commands.bench", "add_bench_command",
        "fair round-robin benchmark of the schedules against unshared baselines",
    ),
    "plan": (
        "megatron_branch.commands.plan", "add_plan_command",
        "per-rank memory, FLOPs, step time and a layout for a rollout batch",
    ),
    "train": (
        "megatron_branch.commands.train", "add_train_command",
        "RL post-training (GRPO / PPO / DPO) with exact shared-prefix replay",
    ),
    "import-traces": (
        "megatron_branch.commands.import_traces", "add_import_traces_command",
        "agent traces (chat messages) -> rollouts with loss masks, by the model's chat template",
    ),
    "convert": (
        "megatron_branch.checkpoint.cli", "add_convert_commands",
        "convert checkpoints between Hugging Face and megatron-core",
    ),
    "verify-conversion": (
        "megatron_branch.checkpoint.cli", "add_convert_commands",
        "compare logits of a HF model and its megatron conversion",
    ),
}  # fmt: skip
"""command -> (module, the function that adds its parser, its one-line help). The top-level help lists the
one-line helps without importing any command's module (they import torch and megatron-core: seconds); only the
command on the line is built in full. tests/unit/test_cli_startup.py checks the lines against the commands' own."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser (`command` None), or every command a stub but `command` (`main`: the one on the line)."""
    parser = ArgumentParser(
        prog="megatron-branch",
        description="Exact shared-prefix (branch replay) RL training for Megatron-Core.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-branch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    added: set[str] = set()
    for name, (module, adder, help_line) in COMMANDS.items():
        if name in added:
            continue
        if command is None or name == command or COMMANDS.get(command, ("",))[0] == module:
            import importlib

            before = set(sub.choices)
            getattr(importlib.import_module(module), adder)(sub)
            added |= set(sub.choices) - before
        else:
            sub.add_parser(name, help=help_line)
            added.add(name)
    return parser


def command_on_line(argv: list[str]) -> str | None:
    """The command `argv` names (its first word that is not an option), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    # megatron-core warns at import about apex/TE being absent on CPU; that is expected here, not news.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|apex).*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(command_on_line(argv) or "")
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
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit (`plan | head`)
        return rc
    except UserError as e:
        report_user_error(e)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return closed_pipe()
    finally:
        if owns_distributed and dist.is_initialized():
            from megatron_branch.parallel.groups import shutdown_distributed

            shutdown_distributed()


CLOSED_PIPE = 141
"""Exit status when the reader of stdout went away (`... | head`): 128 + SIGPIPE, as `yes | head` reports."""


def closed_pipe() -> int:
    """stdout's reader closed the pipe: stop quietly (no traceback, nothing more written). Python's recipe
    (docs.python.org/3/library/signal.html#note-on-sigpipe): point stdout at /dev/null so that the interpreter's
    own flush at exit does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_PIPE


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
