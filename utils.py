"""Small helpers every script uses: the user-error type and entry point, argparse types that report in one line,
the safe torch.load, and atomic file writes."""

import argparse
import contextlib
import errno
import functools
import json
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input: shown as one line on stderr, exit status 2, never a traceback."""


def entry_point(function):
    """Decorate a script's main (or a spawned worker): a UserError becomes one line on stderr and exit status 2,
    Ctrl-C a short note and status 130. Bugs stay tracebacks."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted: the last checkpoint (if any) is intact; --resume continues from it", file=sys.stderr)
            sys.exit(130)

    return wrapper


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has one worth showing (not None, not an off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with errors in one line, like every other user error here."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


def number(kind, minimum, maximum=None, above_minimum=False):
    """An argparse type: a number of `kind` within [minimum, maximum] (or above minimum)."""

    def parse(text):
        value = kind(text)
        if value < minimum or (above_minimum and value == minimum) or (maximum is not None and value > maximum):
            bound = f"greater than {minimum}" if above_minimum else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and at most {maximum}" if maximum else ""))
        return value

    return parse


positive_int, positive_float = number(int, 1), number(float, 0, above_minimum=True)


def describe(paths: list[str], shown: int = 5) -> str:
    return ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def safe_load(path, what: str):
    """torch.load(weights_only=True) of a file the user named, with any failure as a UserError.

    weights_only=True unpickles tensors and plain containers only: a file whose pickle would run code is refused
    before any of it runs.
    """
    import torch  # here, so that the data helpers above do not need torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("WeightsUnpickler error:")[-1].strip().split(". ")[0].split("\n")[0]
        raise UserError(f"{what} {path} was refused by the safe loader (weights_only=True): {reason}") from None
    except Exception as error:  # torch.load raises many types for a file that is not a (whole) torch file
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise UserError(
            f"{what} {path} cannot be read as a PyTorch file ({type(error).__name__}: {first_line})"
        ) from None


class OutputError(UserError):
    """An output could not be written (no space, a quota, a permission, a vanished folder): the file it was to
    replace, and everything written before, are left as they were."""


def write_atomically(path, write, binary: bool = False, size: int | None = None) -> None:
    """Create or replace `path` with what write(file) writes, so that readers and crashes see either the old
    file or the whole new one: a temporary file in the same folder, fsync, rename, fsync of the folder
    (not on Windows, which has none).

    If the filesystem refuses (OSError, whatever layer re-raises it: torch.save turns it into a RuntimeError),
    raises OutputError naming the file, the reason and, when space ran out, the space free and needed (`size`
    bytes, if the caller knows it); the temporary file is removed and `path` is untouched.
    """
    with atomic_file(path, binary, size) as f:
        write(f)


@contextlib.contextmanager
def atomic_file(path, binary: bool = False, size: int | None = None):
    """write_atomically for a file written bit by bit: yields the temporary file, open (text in UTF-8, or
    `binary`), to write as the block goes on; it replaces `path` when the block ends. If the block ends by an
    exception (a failure, Ctrl-C, a SystemExit), the temporary file is removed and `path` is untouched. So
    predict.py streams its results into a file that appears whole, or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if os.name != "nt":  # Windows cannot open a folder with os.open, so it has no folder fsync to call
            folder = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(folder)  # make the rename itself durable
            finally:
                os.close(folder)
    except Exception as error:
        reason = os_error_in(error)
        if reason is None:
            raise
        raise OutputError(write_failure(path, reason, size)) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError that `error` is, or that it was raised while handling (its chain of causes), else None."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def write_failure(path: Path, error: OSError, size: int | None = None) -> str:
    """One line: which file could not be written and why, with the space free and needed when it ran out."""
    message = f"cannot write {path}: {error.strerror or error}"
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        existing = next((folder for folder in (path, *path.parents) if folder.exists()), Path("/"))
        free = shutil.disk_usage(existing).free
        needed = f", about {size / 2**20:.0f} MiB needed" if size else ""
        message += f" ({free / 2**20:.0f} MiB free on its filesystem{needed})"
    return message


def write_json(path, data) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(data, indent=2) + "\n"))


def check_writable(folder: Path) -> None:
    """UserError unless `folder` can be created (or exists) and written to; creates nothing."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".write-test-")).rmdir()
    except OSError as error:
        raise UserError(f"cannot write the output folder {folder}: {error.strerror} ({existing})") from None
