"""The one rule for writing outputs, shared by every command (grad, convert, train, bench, plan, ...).

1. Validate before any work: a command calls `check_output_file` / `check_output_dir` for every output right
   after parsing its arguments (before loading a model), so a bad output path costs nothing. Writability is
   tried, not guessed: an empty file is created and removed in the target's folder (`probe_writable`).
2. Missing parent folders are REFUSED, never created: a typo in `--out` should not silently grow a tree of
   folders somewhere (the same for every command; `mkdir -p` first when that is what you mean).
3. An existing output is refused unless the command was given `--overwrite` (`add_overwrite_argument`, the same
   flag everywhere). An existing EMPTY folder counts as absent. Even with `--overwrite`, a folder output replaces
   only a folder of the same kind (one holding the kind's `marker` file, e.g. `megatron_branch.json` for a
   megatron checkpoint): `--out ~ --overwrite` never deletes a home folder. A file where a folder is expected (or
   the reverse) is always refused.
4. Outputs are written under a temporary name BESIDE the target (same filesystem) and renamed into place at the
   end; on any failure the temporary is removed and the target is untouched: never a half-written output.
5. Permissions follow the umask (files 0666 & ~umask, folders 0777 & ~umask), whatever the writing library used
   (safetensors writes 0600 files, `tempfile.mkdtemp` makes 0700 folders).
Under torchrun one rank writes a file (parallel/agree.py `write_on_rank0`); its failure is raised on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from megatron_branch.errors import UserError, one_line

T = TypeVar("T")

OVERWRITE_HELP = "replace existing outputs (without it an existing output is refused before any work)"


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """The `--overwrite` flag, with the same name and meaning in every command."""
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


# --- validation (before any work) -------------------------------------------------------------------------------
def check_parent(target: Path, what: str) -> None:
    parent = target.parent
    if not parent.is_dir():
        if parent.exists():
            raise UserError(f"{what} {str(target)!r}: {str(parent)!r} is a file, not a folder")
        raise UserError(
            f"{what} {str(target)!r}: folder {str(parent)!r} does not exist (missing folders are not created)"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{what} {str(target)!r}: cannot write in folder {str(parent)!r} (permission denied)")
    probe_writable(target, what)


def probe_writable(target: Path, what: str) -> None:
    """Create and remove an empty file beside `target`: `os.access` says yes for root, on /proc and on some
    network filesystems where creating a file then fails; a model's worth of work must not come first (issue 35:
    `grad --out /proc/o.safetensors` failed with safetensors' traceback after 35 s)."""
    probe = temp_path_beside(target, "probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError as e:
        raise UserError(
            f"{what} {str(target)!r}: cannot create a file in folder {str(target.parent)!r} "
            f"({e.strerror or one_line(e)})"
        ) from None
    with contextlib.suppress(FileNotFoundError):
        probe.unlink()


def check_output_file(path: str | os.PathLike, *, overwrite: bool, what: str = "output") -> Path:
    """Refuse a file output that cannot or may not be written. Returns the path."""
    target = Path(path)
    check_parent(target, what)
    if target.is_dir():
        raise UserError(f"{what} {str(target)!r} is a folder; give a file name")
    if target.exists() and not overwrite:
        raise UserError(f"{what} {str(target)!r} already exists; pass --overwrite to replace it")
    return target


def _is_empty_dir(d: Path) -> bool:
    return d.is_dir() and not any(d.iterdir())


def check_output_dir(
    path: str | os.PathLike, *, overwrite: bool, marker: str, what: str = "output folder"
) -> Path:
    """Refuse a folder output that cannot or may not be written. `marker` is a file every output of this kind
    holds: `--overwrite` replaces only a folder that has it. Returns the path."""
    target = Path(path)
    check_parent(target, what)
    if target.exists() and not target.is_dir():
        raise UserError(f"{what} {str(target)!r} is a file, not a folder")
    if target.is_dir() and not _is_empty_dir(target):
        if not overwrite:
            raise UserError(
                f"{what} {str(target)!r} already exists and is not empty; pass --overwrite to replace it"
            )
        if not (target / marker).is_file():
            raise UserError(
                f"{what} {str(target)!r} is not empty and has no {marker}: it is not an output of this kind; "
                "refusing to replace it even with --overwrite"
            )
    return target


# --- writing ----------------------------------------------------------------------------------------------------
def _umask() -> int:
    try:  # Linux >= 4.7 reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give `path` (and, for a folder, everything in it) the permissions the umask implies."""
    mask = _umask()
    p = Path(path)
    if p.is_dir():
        for root, dirs, files in os.walk(p):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(root, f), 0o666 & ~mask)
        os.chmod(p, 0o777 & ~mask)
    else:
        os.chmod(p, 0o666 & ~mask)


def temp_path_beside(target: str | os.PathLike, tag: str = "tmp") -> Path:
    """A fresh hidden name next to `target` (same folder, so the final rename is atomic)."""
    t = Path(target)
    return t.with_name(f".{t.name}.{tag}-{secrets.token_hex(4)}")


def discard(tmp: str | os.PathLike) -> None:
    """Remove a temporary file or folder (missing is fine)."""
    p = Path(tmp)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def make_temp_dir(
    target: str | os.PathLike, *, overwrite: bool, marker: str, what: str = "output folder"
) -> Path:
    """Check `target` (as `check_output_dir`) and create an empty temporary folder beside it.

    For outputs written by several ranks: one rank calls this and hands the path to the others."""
    check_output_dir(target, overwrite=overwrite, marker=marker, what=what)
    tmp = temp_path_beside(target)
    try:
        os.mkdir(tmp)
    except OSError as e:
        raise UserError(
            f"cannot create a folder beside {str(target)!r}: {e.strerror or one_line(e)}"
        ) from None
    return tmp


def commit_dir(
    tmp: str | os.PathLike,
    target: str | os.PathLike,
    *,
    overwrite: bool,
    marker: str,
    what: str = "output folder",
) -> Path:
    """Rename the finished temporary folder `tmp` to `target` (re-checked now), replacing it when allowed."""
    tmp, target = Path(tmp), Path(target)
    try:
        check_output_dir(
            target, overwrite=overwrite, marker=marker, what=what
        )  # it may have appeared meanwhile
    except UserError:
        discard(tmp)
        raise
    apply_umask(tmp)
    if target.is_dir() and not _is_empty_dir(target):
        old = temp_path_beside(target, "old")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except BaseException:
            os.rename(old, target)
            raise
        discard(old)
    else:
        os.replace(tmp, target)  # POSIX rename replaces an empty folder atomically
    return target


def commit_file(
    tmp: str | os.PathLike, target: str | os.PathLike, *, overwrite: bool, what: str = "output"
) -> Path:
    """Rename the finished temporary file `tmp` to `target` (re-checked now)."""
    tmp, target = Path(tmp), Path(target)
    try:
        check_output_file(target, overwrite=overwrite, what=what)
    except UserError:
        discard(tmp)
        raise
    apply_umask(tmp)
    os.replace(tmp, target)
    return target


def _write_error(target: Path, e: OSError) -> UserError:
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return UserError(f"cannot write {str(target)!r}: {e.strerror or one_line(e)}{where}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, *, overwrite: bool, what: str = "output") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on success it is renamed to `path`, on failure removed.

    with atomic_file(args.out, overwrite=args.overwrite) as tmp:
        save_file(tensors, str(tmp))
    """
    target = check_output_file(path, overwrite=overwrite, what=what)
    tmp = temp_path_beside(target)
    try:
        yield tmp
        commit_file(tmp, target, overwrite=overwrite, what=what)
    except OSError as e:
        raise _write_error(target, e) from None
    finally:
        discard(tmp)  # a no-op after the rename


@contextlib.contextmanager
def atomic_dir(
    path: str | os.PathLike, *, overwrite: bool, marker: str, what: str = "output folder"
) -> Iterator[Path]:
    """Yield an empty temporary folder beside `path`; on success it replaces `path`, on failure it is removed."""
    target = Path(path)
    tmp = make_temp_dir(target, overwrite=overwrite, marker=marker, what=what)
    try:
        yield tmp
        commit_dir(tmp, target, overwrite=overwrite, marker=marker, what=what)
    except OSError as e:
        raise _write_error(target, e) from None
    finally:
        discard(tmp)


def write_text(path: str | os.PathLike, text: str, *, overwrite: bool, what: str = "output") -> Path:
    """Write a small text output (JSON, JSONL, a report) by the same rule."""
    with atomic_file(path, overwrite=overwrite, what=what) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
