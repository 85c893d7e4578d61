"""The start-up check of a run's images, its verdicts kept for a restart (docs/resuming-and-failures.md)."""

import contextlib
import json
import os
from pathlib import Path

from filelock import FileLock

import dataset.images
from dataset.folders import relative_posix
from read_back import misfits, read_json
from utils import UserError, warn, write_atomically

CHECKED_IMAGES = "checked_images.json"  # in a run's folder
CHECK_LOCK = ".checked_images.lock"  # in a run's folder: held by the rank checking images
FORMAT = 1


class ImageCheck:
    """read_split_data's verify_images for a run, its verdicts kept in `folder` (None: not known yet). `shared`: the
    other ranks check the same images, so one decodes under a lock and writes at once; otherwise save() writes."""

    def __init__(self, root, folder: Path | None, shared: bool = False):
        self.root, self.folder, self.shared = Path(root), folder, shared and folder is not None
        self.verdicts: dict[str, list] = {}  # relative path: [size, mtime_ns, problem or None]
        self.unsaved, self.decoded = False, 0  # decoded: by this process (the rest had a verdict)

    def __call__(self, images: list[str]) -> list[str]:
        names = relative_posix(images, self.root)
        now = {name: (path, file_key(path)) for name, path in zip(names, images, strict=True)}
        self.verdicts = self.remembered(self.folder, quietly=self.shared)  # shared: read again under the lock
        stale = self.stale(now)
        if stale and self.shared:
            self.folder.mkdir(parents=True, exist_ok=True)
            with check_lock(self.folder):  # the other ranks wait here while one decodes
                self.verdicts = self.remembered(self.folder)  # those a rank that held the lock before wrote
                if self.stale(now):
                    self.decode(now)
                    self.save(self.folder)
        elif stale:
            self.decode(now)
        self.keep_listed(now)
        return [path for name, (path, key) in now.items() if key is None or self.verdicts[name][2] is not None]

    def remembered(self, folder: Path | None, quietly: bool = False) -> dict[str, list]:
        """The verdicts kept in `folder`; none from a damaged file (warned of unless `quietly`)."""
        try:
            return read_verdicts(folder)
        except UserError as damage:
            if not quietly:
                warn(f"{damage}: its images are checked again, and it is replaced")
            return {}

    def stale(self, now: dict) -> list[str]:
        """The images in `now` (name: (path, key)) without a verdict for the file as it is (a vanished one: none)."""
        return [
            name for name, (_, key) in now.items() if key is not None and tuple(self.verdicts.get(name, ())[:2]) != key
        ]

    def decode(self, now: dict) -> None:
        for name in self.stale(now):
            path, (size, mtime_ns) = now[name]
            self.verdicts[name] = [size, mtime_ns, dataset.images.image_problem(path)]
            self.decoded, self.unsaved = self.decoded + 1, True
        self.keep_listed(now)

    def keep_listed(self, now: dict) -> None:
        """Forget the verdicts of images no longer listed (deleted, or moved out of the data folder)."""
        listed = {name: verdict for name, verdict in self.verdicts.items() if name in now}
        self.unsaved = self.unsaved or len(listed) != len(self.verdicts)
        self.verdicts = listed

    def save(self, folder: Path, merge: bool = False) -> None:
        """Write the verdicts, if any changed, into `folder` (atomically); `merge`: with those there (evaluate.py)."""
        if not self.unsaved:
            return
        # Merged: a run refused (another holds the folder) must not take that run's verdicts away, nor an evaluation
        verdicts = self.remembered(folder, quietly=True) | self.verdicts if self.shared or merge else self.verdicts
        text = json.dumps({"format": FORMAT, "root": str(self.root), "images": verdicts}, separators=(",", ":"))
        write_atomically(folder / CHECKED_IMAGES, lambda f: f.write(text))
        self.unsaved = False


@contextlib.contextmanager
def check_lock(folder: Path):
    """Hold the lock in `folder` that a run's ranks take in turn to check its images; UserError if it cannot."""
    try:
        held = FileLock(folder / CHECK_LOCK).acquire()
    except OSError as error:
        raise UserError(f"cannot take the lock {folder / CHECK_LOCK}: {error.strerror or error} (the lock the "
                        "processes of a run take in turn to check its images is a file this user can open): remove "
                        "it and run again") from None  # fmt: skip
    with held:
        yield


def file_key(path: str) -> tuple[int, int] | None:
    """(size, modification time in ns) of `path`, or None if it vanished since it was listed."""
    with contextlib.suppress(OSError):
        stat = os.stat(path)
        return stat.st_size, stat.st_mtime_ns
    return None


def read_verdicts(folder: Path | None) -> dict[str, list]:
    """The verdicts kept in `folder` (none without the file); UserError if the file is not one this code wrote."""
    if folder is None or not (path := folder / CHECKED_IMAGES).exists():
        return {}
    record = read_json(path, "image check cache")
    if record.get("format") != FORMAT:
        raise UserError(f"image check cache {path} is of another format ({record.get('format')!r}, not {FORMAT})")
    damage = misfits(record, {"images": dict}) or [
        f"{name}'s verdict is {json.dumps(verdict)[:40]}, not [size, mtime_ns, problem or null]"
        for name, verdict in record["images"].items()
        if not is_verdict(verdict)
    ]
    if damage:
        raise UserError(f"image check cache {path} is damaged ({damage[0]})")
    return record["images"]


def is_verdict(verdict) -> bool:
    """Whether `verdict` is [size, mtime_ns, problem or None], as decode() keeps it."""
    three = isinstance(verdict, list) and len(verdict) == 3
    return three and not misfits(verdict[:2], [int]) and not misfits(verdict[2], (str, type(None)))
