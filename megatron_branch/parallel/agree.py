"""One verdict on every rank: a user error seen by any rank is raised by all of them, the same way.

Under torchrun an error must reach every rank, or the ranks that did not see it wait in the next collective until
the process-group timeout. Two ways give that:
- `agree_on_error(err)` after distributed set-up: every rank passes its own verdict (None or a message), every
  rank raises the same error, marked `all_ranks`;
- `check_on_every_rank(check)` for the validation a command runs before any work: each rank runs the same checks,
  then the verdicts are shared (a world of one just raises).
An error marked `all_ranks` is printed by rank 0 only (cli.py); any other error by the rank that raised it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from megatron_branch.errors import UserError, launched_world_size, one_line
from megatron_branch.parallel.groups import init_distributed

T = TypeVar("T")


def agree_on_error(err: str | None, *, error: type[Exception] = UserError) -> None:
    """Every rank passes its own error (or None); if any rank has one, every rank raises the first of them
    (as `error`, marked `all_ranks` so that the CLI prints it on rank 0 only). A collective: all ranks of the
    world must call it.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        errs: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errs, err)
        bad = [(r, e) for r, e in enumerate(errs) if e]
        if bad:
            rank, msg = bad[0]
            exc = error(f"rank {rank}: {msg}" if len(bad) < len(errs) else msg)
            exc.all_ranks = True  # type: ignore[attr-defined]  # every rank raises it: rank 0 alone prints it
            raise exc
    elif err:
        exc = error(err)
        exc.all_ranks = True  # type: ignore[attr-defined]
        raise exc


def check_on_every_rank(check: Callable[[], T]) -> T:
    """Run a command's up-front validation on every rank and share the verdict.

    Single process: `check()` as is. Under torchrun: every rank runs `check()`, the process group is set up and
    the verdicts are exchanged, so a failure on any rank is the same `UserError` (marked `all_ranks`) on every
    rank, printed once by rank 0, and no rank walks on into a collective that the others never reach.
    """
    if launched_world_size() <= 1:
        return check()
    result, err = None, None
    try:
        result = check()
    except UserError as e:
        err = str(e)
    init_distributed()
    agree_on_error(err, error=UserError)
    return result  # type: ignore[return-value]


def write_on_rank0(write: Callable[[], T]) -> T | None:
    """Rank 0 runs `write()` (a collective: every rank calls this); a UserError or OSError there is raised on
    every rank as the same UserError, so no rank waits for a rank that gave up. Returns write()'s value on rank 0.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out: T | None = None
    err = None
    if rank == 0:
        try:
            out = write()
        except UserError as e:
            err = str(e)
        except OSError as e:
            err = f"cannot write: {e.strerror or one_line(e)}" + (f" ({e.filename})" if e.filename else "")
    agree_on_error(err, error=UserError)
    return out
