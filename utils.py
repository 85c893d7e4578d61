"""Small helpers every script uses: the user-error type and entry point, argparse types that report in one line,
the safe torch.load, files read back checked (JSON of the shape expected, else a UserError naming the file), and
atomic file writes."""

import argparse
import contextlib
import errno
import functools
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input: shown as one line on stderr, exit status 2, never a traceback."""


# A file's name as the filesystem gives it (on Linux and macOS any bytes but "/" and NUL: a zip file from Windows or
# an old Mac, a NAS copy) is a str in which each byte that is not UTF-8 is a lone surrogate (os.fsdecode); written
# with this error handler those are the same bytes again. The project's output, and the text files it writes that
# hold names (predict.py's results), are written so; the JSON files escape them (\udcff) and read them back alike.
NAMES = "surrogateescape"


def readable(name: str) -> str:
    """`name` for what takes text alone (a figure's label, a tracker's tag): each byte of it that is not UTF-8 shown
    as U+FFFD."""
    return name.encode("utf-8", NAMES).decode("utf-8", "replace")


def entry_point(function):
    """Decorate a script's main (or a spawned worker): a UserError becomes one line on stderr and exit status 2,
    Ctrl-C a short note and status 130. Bugs stay tracebacks. Its output carries file names as they are (NAMES)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):  # (not a StringIO a test prints into)
                stream.reconfigure(errors=NAMES)
        try:
            return function(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted: the last checkpoint (if any) is intact; --resume continues from it", file=sys.stderr)
            sys.exit(130)

    return wrapper


def warn(message: str) -> None:
    """One warning line on stderr: something the run does without (a damaged cache, an unreadable image)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def in_brief(text: str, width: int = 240) -> str:
    """`text` on one line of at most `width` characters: its start and its end (where a library's message often
    names the cause: "... [Errno 111] Connection refused")."""
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


def safe_load(path, what: str, if_damaged: str = "copy it again from where it came from, or use another copy"):
    """torch.load(weights_only=True) of a file the user named, with any failure as a UserError; `if_damaged`
    says what to do with a file whose bytes changed since it was saved.

    weights_only=True unpickles tensors and plain containers only: a file whose pickle would run code is refused
    before any of it runs. A file of torch.save's format, a zip archive, is first checked against the CRC-32 it
    keeps of each record (torch.load checks none): a byte changed in a tensor is refused, not loaded as another
    number. A file that is no PyTorch file (a text file, an image) is named as such.
    """
    import torch  # here, so that the data helpers above do not need torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} {'is a folder' if path.is_dir() else 'does not exist'}")
    try:
        with open(path, "rb") as f:
            start = f.read(TAR_MAGIC_END)
        damage = damaged_record(path) if start.startswith(ZIP_MAGIC) else None
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if damage is not None:
        raise UserError(f"{what} {path} is damaged ({damage}): {if_damaged}")
    other = other_kind(start)
    if other is not None:
        raise UserError(f"{what} {path} is not a PyTorch file ({other})")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("WeightsUnpickler error:")[-1].strip().split(". ")[0].split("\n")[0]
        if reason.startswith("Unsupported operand"):  # not a pickle from there on: a damaged file, not a refusal
            raise UserError(f"{what} {path} cannot be read as a PyTorch file (a damaged pickle: {reason})") from None
        raise UserError(f"{what} {path} was refused by the safe loader (weights_only=True): {reason}") from None
    except Exception as error:  # torch.load raises many types for a file that is not a (whole) torch file
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise UserError(
            f"{what} {path} cannot be read as a PyTorch file ({type(error).__name__}: {first_line})"
        ) from None


# How a PyTorch file begins: torch.save's zip archive (since torch 1.6), its older format (a pickle of protocol 2
# or later), or the oldest (a tar archive, "ustar" at bytes 257-261)
ZIP_MAGIC, PICKLE_MAGIC, TAR_MAGIC_END = b"PK\x03\x04", b"\x80", 262
MS_DOS_FOLDER = 0x10  # a zip record's external attribute: the record is a folder


def damaged_record(path: Path) -> str | None:
    """Which record of the zip archive `path` fails the CRC-32 the archive keeps of it, and how; None when every
    record passes, or when the archive's directory cannot be read (a file cut short: torch.load then says so).

    A record with a CRC of 0 is not checked: torch.save writes 0 for every record when it is told to compute none
    (torch.serialization.set_crc32_options(False)). Reads the whole file once more: 0.05 s for a ResNet-34
    checkpoint of 170 MB on a 2-core Zen 4 EPYC (docs/resuming-and-failures.md)."""
    try:
        archive = zipfile.ZipFile(path)
    except OSError:
        raise  # the file could not be read: not damage
    except Exception:  # BadZipFile, NotImplementedError, ValueError ...: no directory, or a damaged one
        return None
    with archive:
        for record in archive.infolist():
            if record.external_attr & MS_DOS_FOLDER:  # torch writes none; torch.load leaves its tensor unfilled
                return f"its record {record.filename!r} is marked as a folder"
            if record.CRC == 0:
                continue
            try:
                with archive.open(record) as data:
                    while data.read(1 << 24):  # zipfile compares the CRC-32 at the record's end
                        pass
            except OSError:
                raise  # the file could not be read: not damage
            except Exception as error:  # BadZipFile for a CRC; EOFError, NotImplementedError, ... for a damaged header
                reason = " ".join(str(error).split()) or type(error).__name__
                return f"its record {record.filename!r} fails zipfile's check: {reason}"
    return None


def other_kind(start: bytes) -> str | None:
    """What a file that begins with the bytes `start` seems to be, if it is no PyTorch file; None if it may be one."""
    if start.startswith(ZIP_MAGIC):
        return None
    if start[8:9] == b"{":  # 8 bytes, the length of a JSON header, then the header (its length may start with 0x80)
        return "a safetensors file, it seems: --weights reads one when its name ends in .safetensors"
    if start.startswith(PICKLE_MAGIC) or start[TAR_MAGIC_END - 5 :] == b"ustar":
        return None
    if not start:
        return "it is empty"
    if start.startswith(b"\xff\xd8\xff"):
        return "a JPEG image"
    if start.startswith(b"\x89PNG"):
        return "a PNG image"
    try:
        text = start.decode("utf-8")
    except UnicodeDecodeError as error:  # maybe a character cut at the end of `start`
        text = start[: error.start].decode("utf-8") if error.start >= len(start) - 3 else ""
    if text and all(character.isprintable() or character in "\t\r\n" for character in text):
        return f"a text file, beginning {text.lstrip()[:24]!r}"
    return f"it begins {start[:8]!r}"


def read_text(path, what: str) -> str:
    """A text file the project wrote, read back; UserError naming it (`what` it is, and where) if it cannot be read
    or is not text."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not a text file") from None


def read_json(path, what: str, expected: type = dict):
    """The JSON a file holds, read back: a JSON object (or an `expected` of another type); UserError naming the file
    if it cannot be read, is not JSON (truncated, say) or holds another kind of value."""
    try:
        data = json.loads(read_text(path, what))
    except ValueError as error:
        raise UserError(f"{what} {path} is not valid JSON ({error})") from None
    if not isinstance(data, expected):
        raise UserError(f"{what} {path} holds {json_name(data)}, not {json_name(expected)}")
    return data


def read_json_lines(path, what: str, numbers: tuple = ()) -> list[dict]:
    """The records of a JSON Lines file (one JSON object a line; blank lines are skipped), each with a number for
    each key in `numbers`; UserError naming the file and the line for anything else."""
    records = []
    for number, line in enumerate(read_text(path, what).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(f"{what} {path} line {number} is not JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise UserError(f"{what} {path} line {number} is not a JSON object")
        missing = [key for key in numbers if misfits(record.get(key), NUMBER)]
        if missing:
            raise UserError(f"{what} {path} line {number} has no number for {', '.join(missing)}")
        records.append(record)
    return records


@contextlib.contextmanager
def advice(what_to_do: str):
    """A UserError raised inside (a file read back is damaged, say) ends with what to do about it: "...: what_to_do"."""
    try:
        yield
    except UserError as error:
        raise UserError(f"{error}: {what_to_do}") from None


NUMBER = (int, float)  # a shape for misfits: either (JSON's numbers; true and false are not)


def misfits(value, shape, name: str = "") -> list[str]:
    """Where `value`, data read back from a file, differs from `shape`, in words; [] if it fits. A shape is a type
    (bool is not taken for a number), a tuple of shapes (any one of them), a one-item list [shape] (a list of such
    items) or a dict of shapes by key (a mapping holding each key; one whose shape admits None may be absent)."""
    if isinstance(shape, tuple):
        found = [misfits(value, option, name) for option in shape]
        if not all(found):
            return []
        # a list or a mapping where one is expected: say what inside it does not fit
        inside = [problems for option, problems in zip(shape, found, strict=True) if is_container_of(option, value)]
        return inside[0] if inside else [mismatch(name, value, shape_name(shape))]
    if not isinstance(value, python_type(shape)) or (isinstance(value, bool) and shape is not bool):
        return [mismatch(name, value, shape_name(shape))]
    if isinstance(shape, list):
        return [problem for i, item in enumerate(value) for problem in misfits(item, shape[0], f"{name}[{i}]")][:1]
    problems = []
    for key, part in shape.items() if isinstance(shape, dict) else ():
        label = f"{name}.{key}" if name else key
        found = misfits(value.get(key), part, label)
        problems += [f"{label} is missing"] if found and key not in value else found
    return problems


def is_container_of(shape, value) -> bool:
    """Whether `shape` is a list's or a mapping's, and `value` is one."""
    return isinstance(shape, list | dict) and isinstance(value, python_type(shape))


def python_type(shape) -> type:
    """The Python type a value of `shape` has."""
    return list if isinstance(shape, list) else dict if isinstance(shape, dict) else shape


def mismatch(name: str, value, expected: str) -> str:
    return f"{name or 'it'} is {json_name(value)}, not {expected}"


def shape_name(shape) -> str:
    if isinstance(shape, tuple):
        return "a number" if shape == NUMBER else " or ".join(map(shape_name, shape))
    return json_name(python_type(shape))


# JSON's words for what a value is (bool before int: True is an int to Python)
JSON_NAMES = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string",
              list: "a list", dict: "an object"}  # fmt: skip


def json_name(value) -> str:
    """What `value` (or a value of type `value`) is, in JSON's words where it is JSON's: "a list", "null", ..."""
    of = value if isinstance(value, type) else type(value)
    return next((name for base, name in JSON_NAMES.items() if issubclass(of, base)), f"a {of.__name__}")


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
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8", errors=NAMES) as f:
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


# What makes a folder a run's: the files a training run writes (run/run_log.py, multi_train_utils/checkpoint.py,
# run/tracking.py), as patterns of their paths in its folder, its caches and lock aside. No other command may
# replace them.
RUN_FILES = ("args.json", "class_indices.json", "metrics.jsonl", "checkpoint.pth", "weights/*.pth", "tb/*",
             "tracked_run.json")  # fmt: skip


def run_files_in(folder: Path) -> list[str]:
    """The patterns of RUN_FILES that files in `folder` match: none where it holds no run."""
    return [pattern for pattern in RUN_FILES if next(folder.glob(pattern), None) is not None]


def check_new_file(path: Path, flag: str, force: bool) -> None:
    """UserError, before anything is computed, unless `path` (given as `flag`) may be written: not a folder, not
    an existing file (unless `force`: nothing is replaced unasked), never a file of a run (RUN_FILES, in a folder
    that holds a run's args.json: a run's folder belongs to its run), in a folder that can be made or written to."""
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
    existing = folder
    while not existing.exists():
        existing = existing.parent
    try:
        Path(tempfile.mkdtemp(dir=existing, prefix=".write-test-")).rmdir()
    except OSError as error:
        raise UserError(f"cannot write the output folder {folder}: {error.strerror} ({existing})") from None
