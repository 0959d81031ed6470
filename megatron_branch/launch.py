"""torchrun that keeps the exit status of a user error:

    python -m megatron_branch.launch --nproc_per_node 2 -m megatron_branch grad --hf ... --out ...

Plain torchrun (torch.distributed.run, torch 2.13) turns ANY worker exit status other than 0 into its own
report: an `E... failed (exitcode: 2) local_rank: 0 ...` log line, a Python traceback ending in
`torch.distributed.elastic.multiprocessing.errors.ChildFailedError` with a table of the failed ranks (each
`exitcode : 2`), and exit status 1. It has no option to do otherwise. megatron-branch's own part under plain
torchrun: the error line is printed once (rank 0) and every rank exits with status 2 (docs/errors.md).

This launcher takes exactly torchrun's arguments and runs torchrun's own `run`; when the first worker to fail
exited with status 2 (a user error, already printed by rank 0) it exits with status 2 and adds nothing. Every
other failure (a crash, a signal, an exit status other than 2) is reported by torchrun exactly as usual.
"""

from __future__ import annotations

import logging
import sys

USER_ERROR_STATUS = 2


class _DropUserErrorNotes(logging.Filter):
    """Drop torchrun's `failed (exitcode: 2) ...` line (the worker has said what went wrong) and its `Sending
    process N closing signal SIGTERM` notes (they follow every failure; any failure other than a user error still
    gets torchrun's full report, which lists each rank's fate)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("failed (exitcode:") and args and args[0] == USER_ERROR_STATUS:
            return False
        return not msg.startswith("Sending process")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_launch)(argv) or 0  # record: torchrun's own error-file handling for the other failures


def _launch(argv: list[str] | None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropUserErrorNotes())
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode == USER_ERROR_STATUS:
            return USER_ERROR_STATUS
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
