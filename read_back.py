"""Reading back what a run or a user saved: a damaged or foreign file refused in one line naming it, no traceback."""

import contextlib
import json
import pickle
import zipfile
from pathlib import Path

from utils import UserError


def safe_load(path, what: str, if_damaged: str = "copy it again from where it came from, or use another copy"):
    """torch.load(weights_only=True: a pickle that would run code is refused) of a file the user named, any failure
    a UserError. A zip archive is first checked against its CRC-32s (torch.load checks none), so a changed byte is
    refused, not loaded as another number; `if_damaged` says what to do then."""
    import torch  # here, so that the JSON readers do not need torch

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
        line = (str(error).strip().splitlines() or [""])[0]
        raise UserError(f"{what} {path} cannot be read as a PyTorch file ({type(error).__name__}: {line})") from None


# A checkpoint's part kept in a weights file of its own (multi_train_utils/checkpoint.py, save_epoch): {WEIGHTS_FILE:
# its path from the checkpoint's folder, "prefix": put back before its names, and the part's other entries}
WEIGHTS_FILE = "weights_file"


def with_weights(state: dict, path) -> dict:
    """A checkpoint read from `path` with each part kept in a weights file of its own read back into it; an earlier
    checkpoint, which holds its weights, as it is. The files sit beside the checkpoint's own (a link's target)."""
    return {part: followed(value, path) for part, value in state.items()}


def followed(part, path):
    """`part` of the checkpoint at `path`, read from its own weights file where it names one."""
    if not isinstance(part, dict) or not isinstance(part.get(WEIGHTS_FILE), str):
        return part
    rest = dict(part)
    name, prefix = rest.pop(WEIGHTS_FILE), rest.pop("prefix", "")
    weights = safe_load(Path(path).resolve().parent / name, f"weights file of checkpoint {path}:")
    if not isinstance(weights, dict):
        raise UserError(f"weights file {name} of checkpoint {path} does not hold a state dict")
    return {prefix + key: tensor for key, tensor in weights.items()} | rest


# How a PyTorch file begins: torch.save's zip archive (since torch 1.6), its older format (a pickle of protocol 2
# or later), or the oldest (a tar archive, "ustar" at bytes 257-261)
ZIP_MAGIC, PICKLE_MAGIC, TAR_MAGIC_END = b"PK\x03\x04", b"\x80", 262


def damaged_record(path: Path) -> str | None:
    """Which record of the zip `path` fails its CRC-32, and how; None if all pass or its directory cannot be read."""
    try:
        archive = zipfile.ZipFile(path)
    except OSError:
        raise  # the file could not be read: not damage
    except Exception:  # BadZipFile, NotImplementedError, ValueError ...: no directory, or a damaged one
        return None
    with archive:
        for record in archive.infolist():
            if record.external_attr & 0x10:  # MS-DOS's folder bit: torch writes none; torch.load leaves it unfilled
                return f"its record {record.filename!r} is marked as a folder"
            if record.CRC == 0:  # torch.serialization.set_crc32_options(False) writes 0 for every record
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
    for magic, kind in ((b"\xff\xd8\xff", "a JPEG image"), (b"\x89PNG", "a PNG image")):
        if start.startswith(magic):
            return kind
    try:
        text = start.decode("utf-8")
    except UnicodeDecodeError as error:  # maybe a character cut at the end of `start`
        text = start[: error.start].decode("utf-8") if error.start >= len(start) - 3 else ""
    if text and all(character.isprintable() or character in "\t\r\n" for character in text):
        return f"a text file, beginning {text.lstrip()[:24]!r}"
    return f"it begins {start[:8]!r}"


def read_text(path, what: str) -> str:
    """A text file the project wrote, read back; UserError naming it if it cannot be read or is not text."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not a text file") from None


def read_json(path, what: str, expected: type = dict):
    """The JSON a file holds, of the `expected` type; UserError naming the file otherwise."""
    try:
        data = json.loads(read_text(path, what))
    except ValueError as error:
        raise UserError(f"{what} {path} is not valid JSON ({error})") from None
    if not isinstance(data, expected):
        raise UserError(f"{what} {path} holds {json_name(data)}, not {json_name(expected)}")
    return data


def read_json_lines(path, what: str, numbers: tuple = ()) -> list[dict]:
    """The records of a JSON Lines file, each with a number for each key in `numbers`; else a UserError."""
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
    """A UserError raised inside ends with what to do about it: "...: what_to_do"."""
    try:
        yield
    except UserError as error:
        raise UserError(f"{error}: {what_to_do}") from None


NUMBER = (int, float)  # a shape for misfits: either (JSON's numbers; true and false are not)


def misfits(value, shape, name: str = "") -> list[str]:
    """Where `value`, data read back from a file, differs from `shape`, in words; [] if it fits. A shape is a type
    (bool is no number), a tuple of shapes (any one), [shape] (a list of such) or a dict of shapes by key (a key
    whose shape admits None may be absent)."""
    if isinstance(shape, tuple):
        found = [misfits(value, option, name) for option in shape]
        if not all(found):
            return []
        # a list or a mapping where one is expected: say what inside it does not fit
        inside = [problems for option, problems in zip(shape, found, strict=True)
                  if isinstance(option, list | dict) and isinstance(value, python_type(option))]  # fmt: skip
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


def python_type(shape) -> type:
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
