"""Small helpers every script uses: user errors, the entry point, argparse types, atomic writes, output path checks."""

import argparse
import atexit
import contextlib
import errno
import functools
import gc
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

# What asks a run to stop: SIGTERM (SLURM, Kubernetes, torchrun, before a kill), SIGUSR1 (SLURM's --signal)
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))

# Written with this error handler, a name's bytes that are not UTF-8 (lone surrogates in its str) are the same again
NAMES = "surrogateescape"

# The files a training run writes in its folder, caches and lock aside: no other command may replace them
RUN_FILES = ("args.json", "class_indices.json", "metrics.jsonl", "checkpoint.pth", "weights/*.pth", "tb/*",
             "tracked_run.json")  # fmt: skip


class UserError(Exception):
    """A problem with the user's input: shown as one line on stderr, exit status 2, never a traceback."""


def printable(name: str) -> str:
    """`name` for what takes text alone (a figure's label, a tracker's tag): bytes not UTF-8 shown as U+FFFD."""
    return name.encode("utf-8", NAMES).decode("utf-8", "replace")


def entry_point(function):
    """Decorate a script's main (or a spawned worker): a UserError becomes one line on stderr and exit status 2,
    Ctrl-C a short note and status 130. Bugs stay tracebacks. Its output carries file names as they are (NAMES)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        # At exit, frozen objects are left to the OS instead of freed one by one (once, though tests call main often)
        atexit.unregister(gc.freeze)
        atexit.register(gc.freeze)
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):  # (not a StringIO a test prints into)
                stream.reconfigure(errors=NAMES)
        try:
            return function(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt as interrupt:  # a training run says what it saved and how to go on (RunLog)
            print(f"interrupted: {interrupt}" if str(interrupt) else "interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def in_brief(text: str, width: int = 240) -> str:
    """`text` on one line of at most `width` characters: its start and its end (where the cause often is)."""
    text = " ".join(text.split())
    half = (width - len(" [...] ")) // 2
    return text if len(text) <= width else f"{text[:half]} [...] {text[-half:]}"


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
        if not math.isfinite(value):  # float("nan") and float("inf") parse, and nan passes every comparison
            raise argparse.ArgumentTypeError("must be a finite number")
        if value < minimum or (above_minimum and value == minimum) or (maximum is not None and value > maximum):
            bound = f"greater than {minimum}" if above_minimum else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and at most {maximum}" if maximum else ""))
        return value

    parse.__name__ = kind.__name__  # argparse's word for text that is not a number: "invalid int value: 'x'"
    return parse


positive_int, positive_float = number(int, 1), number(float, 0, above_minimum=True)


def describe(paths: list[str], shown: int = 5) -> str:
    return ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


class OutputError(UserError):
    """An output could not be written: the file it was to replace, and everything written before, are as they were."""


@contextlib.contextmanager
def writing(place, size: int | None = None):
    """Inside, a refusal of the filesystem (an OSError, or an error raised while handling one, as torch.save and
    TensorBoard's writer re-raise it) is an OutputError naming `place` (a file or folder) and the cause, with the
    space free and needed (`size`) when it ran out: every write of the program goes through one."""
    try:
        yield
    except OutputError:
        raise
    except Exception as error:
        reason = error
        while reason is not None and not isinstance(reason, OSError):
            reason = reason.__cause__ or reason.__context__
        if reason is None:
            raise
        path = Path(place)
        message = f"cannot write {path}: {reason.strerror or reason}"
        if reason.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            existing = next((folder for folder in (path, *path.parents) if folder.exists()), Path("/"))
            needed = f", about {size / 2**20:.0f} MiB needed" if size else ""
            message += f" ({shutil.disk_usage(existing).free / 2**20:.0f} MiB free on its filesystem{needed})"
        raise OutputError(message) from None


def write_atomically(path, write, binary: bool = False, size: int | None = None) -> None:
    """Replace `path` atomically with what write(file) writes; OutputError naming the file if the filesystem refuses."""
    with atomic_file(path, binary, size) as f:
        write(f)


@contextlib.contextmanager
def atomic_file(path, binary: bool = False, size: int | None = None):
    """write_atomically, bit by bit: yields the temporary file, which replaces `path` if no exception ends the block."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with writing(path, size):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8", errors=NAMES) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            sync_folder(path.parent)  # make the rename itself durable
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def sync_folder(folder) -> None:
    """fsync `folder`, so that the names just made in it survive a power cut (Windows cannot open a folder)."""
    if os.name != "nt":
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def write_json(path, data) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(data, indent=2) + "\n"))


def run_files_in(folder: Path) -> list[str]:
    return [pattern for pattern in RUN_FILES if next(folder.glob(pattern), None) is not None]


def check_new_file(path: Path, flag: str, force: bool) -> None:
    """UserError, before anything is computed, unless `path` (given as `flag`) may be written: not a folder, not
    an existing file unless `force`, never one of a run's RUN_FILES, in a folder that can be written to."""
    if path.is_dir():
        raise UserError(f"{flag} {path} is a folder: name a file")
    run = next((folder for folder in path.parents[:2] if (folder / "args.json").is_file()), None)
    if run is not None and any(path.relative_to(run).match(pattern) for pattern in RUN_FILES):
        raise UserError(f"{flag} {path} is a file of the run in {run}, which no other command replaces: name another")
    if path.exists() and not force:
        raise UserError(f"{path} exists: name another {flag}, or pass --force to replace it")
    check_writable(path.parent)


def check_writable(folder: Path) -> None:
    """UserError unless `folder` can be created (or exists) and written to; creates nothing."""
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists())
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".write-test-")).rmdir()
    except OSError as error:
        raise UserError(f"cannot write the output folder {folder}: {error.strerror} ({existing})") from None
