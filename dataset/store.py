"""The image store: a data folder's images decoded once into a file in a cache folder, mapped by every later run's
processes: one copy in the page cache however many read it (docs/performance.md, The image store)."""

import contextlib
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from filelock import FileLock, Timeout

from dataset.folders import read_split_data
from dataset.images import capped, decoded_size, write_decoded
from dataset.transforms import decode_sides
from machine import available_cores, cache_folder
from utils import Parser, UserError, entry_point, positive_int, printable, warn

MAGIC, VERSION, ALIGN = b"FLWSTORE", 1, 4096
STATE_TODO, STATE_DONE, STATE_UNREADABLE = 0, 1, 2
TASK_IMAGES = 32  # images a building process decodes between two notes of its progress


class DecodedImages:
    """Images as 8-bit pixels (height x width x 3 each) in `pixels`: image i from `offsets[i]` (-1: read from its file),
    `shapes[i]` its (height, width). Mapped from a store file, it pickles as the file, not its bytes."""

    def __init__(self, pixels: torch.Tensor, offsets, shapes, mapped: tuple | None = None):
        self.pixels, self.offsets, self.shapes, self.mapped = pixels, np.asarray(offsets), np.asarray(shapes), mapped

    def __getitem__(self, index: int) -> torch.Tensor | None:
        offset = int(self.offsets[index])
        if offset < 0:
            return None
        height, width = (int(side) for side in self.shapes[index])
        return self.pixels[offset : offset + height * width * 3].view(height, width, 3).permute(2, 0, 1)

    def __reduce__(self):
        if self.mapped is None:
            return DecodedImages, (self.pixels, self.offsets, self.shapes)
        return DecodedImages.remapped, (*self.mapped, self.offsets, self.shapes)

    @staticmethod
    def remapped(path, start: int, size: int, offsets, shapes) -> "DecodedImages":
        pixels = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)[start:]
        return DecodedImages(pixels, offsets, shapes, (path, start, size))

    @property
    def bytes(self) -> int:
        return int((3 * self.shapes.prod(axis=1) * (self.offsets >= 0)).sum())


class Store:
    """A store file mapped: rows by path; per image and min_side, an offset (-1: unreadable) and a shape."""

    def __init__(self, path: Path):
        header, offsets, self.shapes, state, _, self.start = read_index(path)
        self.path, self.paths, self.min_sides = path, header["paths"], header["min_sides"]
        self.offsets = np.where(state[:, None] == STATE_DONE, offsets, -1)
        self.rows = {name: row for row, name in enumerate(self.paths)}
        self.size = self.start + header["bytes"]
        self.pixels = torch.from_file(str(path), shared=False, size=self.size, dtype=torch.uint8)[self.start :]

    def unreadable(self) -> list[str]:
        return [name for name, offset in zip(self.paths, self.offsets[:, 0], strict=True) if offset < 0]

    def images(self, paths: list[str], min_side: int) -> DecodedImages:
        """The images of `paths` (all of them stored here) at decode size `min_side` (one of min_sides)."""
        rows = np.array([self.rows[os.path.abspath(path)] for path in paths], dtype=np.int64)
        entry, mapped = self.min_sides.index(min_side), (self.path, self.start, self.size)
        return DecodedImages(self.pixels, self.offsets[rows, entry], self.shapes[rows, entry], mapped)


def fingerprint(paths: list[str], min_sides: list[int]) -> str:
    """A name for these files (paths, sizes, modification times) at `min_sides`: any change names another store."""
    digest = hashlib.sha256(json.dumps([VERSION, min_sides]).encode())
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{printable(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def store_for(paths: list[str], folder: Path, min_sides: list[int], cap: int | None = None) -> tuple[Store, str]:
    """The store of `paths` in `folder` at each of `min_sides`, shorter sides at most `cap` (None: as the disk allows),
    built now if missing (under a lock: another process waits), and the line saying which; OSError if it cannot be."""
    paths = [os.path.abspath(path) for path in paths]  # (the same store from any working folder)
    name = fingerprint(paths, min_sides)
    folder.mkdir(parents=True, exist_ok=True)
    if found := whole_store(folder, name, cap):  # (no lock: a store is renamed into place whole)
        return found
    with locked(folder / f"{name}.lock"):
        if found := whole_store(folder, name, cap, damaged=True):
            return found
        start = time.perf_counter()
        path, processes, note = build(paths, folder, name, min_sides, cap)
        store, seconds = Store(path), time.perf_counter() - start
        gigabytes = (store.size - store.start) / 1e9
        return store, (f"Images: {len(paths)} decoded once into the store {path} ({gigabytes:.2f} GB{note}, "
                       f"{seconds:.1f} s, {processes} processes): every later run maps them")  # fmt: skip


def whole_store(folder: Path, name: str, cap: int | None, damaged=False) -> tuple[Store, str] | None:
    """The store `name` in `folder` (at `cap`; None: any) and its line, or None; `damaged`: unreadable ones removed."""
    for path in sorted(folder.glob(f"{name}-{cap or '*'}.store")):
        with contextlib.suppress(OSError, ValueError):
            store = Store(path)
            return store, f"Images: {len(store.paths)} from the store {path}, decoded once by an earlier run"
        if damaged:
            warn(f"the image store {path} is damaged: built again")
            path.unlink(missing_ok=True)
    return None


@contextlib.contextmanager
def locked(path: Path):
    """Hold the lock file `path`, saying so when another process holds it first (and is building the store)."""
    lock = FileLock(path)
    try:
        held = lock.acquire(timeout=0)
    except Timeout:
        print(f"Images: waiting for another process building the store ({path})", flush=True)
        held = lock.acquire()
    with held:
        yield


def build(paths: list[str], folder: Path, name: str, min_sides: list, cap: int | None) -> tuple[Path, int, str]:
    """Decode `paths` into a partial file (a killed build's resumed, one out of room removed), renamed into place."""
    processes = max(1, min(available_cores(), len(paths)))
    partial = None
    try:
        with multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool(processes) as pool:
            tasks = [(paths[i : i + TASK_IMAGES], min_sides) for i in range(0, len(paths), TASK_IMAGES)]
            sizes = [size for part in pool.imap(stored_sizes, tasks) for size in part]  # an image's at each side
            cap, note = cap_to_fit(sizes, folder, cap)
            if cap is not None:  # (the sizes the cap brings the images to)
                sizes = [None if size is None else [capped(side, cap) for side in size] for size in sizes]
            path = folder / f"{name}-{cap or 'full'}.store"
            partial = path.with_name(f".{path.name}.partial")
            for other in set(folder.glob(f".{name}-*.store.partial")) - {partial}:  # stopped at another cap
                other.unlink()
            state = resumed(partial, len(paths))
            if state is None:
                state = create(partial, paths, sizes, min_sides, cap)
            elif done := int((state != STATE_TODO).sum()):
                note += f"; {done} of them decoded by an earlier build that was stopped"
            decode_into(partial, paths, state, pool, (min_sides, cap))
    except OSError as error:
        if partial is not None and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            partial.unlink(missing_ok=True)  # the room back: a later build starts afresh
        raise
    os.replace(partial, path)
    return path, processes, note


def cap_to_fit(sizes: list, folder: Path, cap: int | None) -> tuple[int | None, str]:
    """(the cap, a note of it): `cap` as given, else none where the images fit in 90 % of the room free in `folder`,
    else the largest shorter side that fits; OSError (ENOSPC) where that is under 1/8 of the uncapped largest."""
    if cap is not None:
        return cap, f", at most {cap} px on the shorter side"
    room = 0.9 * shutil.disk_usage(folder).free
    sides = [one for size in sizes if size is not None for one in dict.fromkeys(size)]  # (the stored ones)
    needed = lambda side: sum(3 * np.prod(capped(size, side)) for size in sides)  # noqa: E731
    largest = max((min(size) for size in sides), default=0)
    if needed(largest) <= room:
        return None, ""
    cap = largest
    while cap > 1 and needed(cap) > room:
        cap = cap * 7 // 8
    if needed(cap) > room or cap < largest // 8:
        raise OSError(errno.ENOSPC, f"the images need {needed(largest) / 1e9:.1f} GB, {room / 1e9:.1f} are free")
    return cap, f", capped at {cap} px on the shorter side to fit the disk ({needed(largest) / 1e9:.1f} GB uncapped)"


def decode_into(partial: Path, paths: list[str], state: np.ndarray, pool, decoding: tuple) -> None:
    """Decode the images `state` marks to do into `partial` by `pool`, each image's state written after its pixels."""
    _, offsets, shapes, _, states_at, start = read_index(partial)
    offsets, shapes = offsets.tolist(), shapes.tolist()
    with open(partial, "r+b", buffering=0) as file:  # (each state to the system as it is written: a kill keeps it)
        todo = [(i, paths[i], offsets[i], shapes[i]) for i in np.flatnonzero(state == STATE_TODO).tolist()]
        tasks = [(str(partial), start, todo[i : i + TASK_IMAGES], *decoding) for i in range(0, len(todo), TASK_IMAGES)]
        for done in pool.imap_unordered(write_decoded, tasks):
            for index, ok in done:
                file.seek(states_at + index)
                file.write(bytes([STATE_DONE if ok else STATE_UNREADABLE]))
        os.fsync(file.fileno())


def stored_sizes(task) -> list:
    """Each image's decoded size at each of the task's min_sides (None: PIL cannot open it), for a pool's process."""
    paths, min_sides = task
    sizes = [[decoded_size(path, side) for side in min_sides] for path in paths]
    return [None if None in size else size for size in sizes]


def create(partial: Path, paths: list[str], sizes: list, min_sides: list, cap: int | None) -> np.ndarray:
    """A new partial store and its state (PIL's unopenable images unreadable), the room reserved where it can be."""
    count, sides = len(paths), len(min_sides)
    shapes = np.array([size or [(0, 0)] * sides for size in sizes], dtype=np.int64).reshape(count, sides, 2)
    offsets, end = np.zeros((count, sides), dtype=np.int64), 0
    for image, entries in enumerate(shapes.tolist()):
        for entry, shape in enumerate(entries):
            if (earlier := entries.index(shape)) < entry:
                offsets[image, entry] = offsets[image, earlier]
            else:
                offsets[image, entry], end = end, end + 3 * shape[0] * shape[1]
    state = np.where(shapes[:, 0].prod(axis=1) > 0, STATE_TODO, STATE_UNREADABLE).astype(np.uint8)
    tail = 3 * (3 * int(shapes.max(initial=0)) + 2)  # zeros past the last image: what gather_boxes may read there
    text = json.dumps({"version": VERSION, "count": count, "min_sides": list(min_sides), "cap": cap,
                       "bytes": end + tail, "paths": paths}, ensure_ascii=True).encode()  # fmt: skip
    start = pixels_start(len(MAGIC) + 8 + len(text) + (24 * sides + 1) * count)
    size = start + end + tail
    with open(partial, "wb") as file:
        file.write(MAGIC + len(text).to_bytes(8, "little") + text)
        for array in (offsets, shapes, state):
            file.write(array.tobytes())
        file.truncate(size)
        if hasattr(os, "posix_fallocate") and size > start:
            os.posix_fallocate(file.fileno(), start, size - start)
    return state


def resumed(partial: Path, count: int) -> np.ndarray | None:
    """The state of a partial store a build left (None: there is none, or not of these images)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        header, _, _, state, _, _ = read_index(partial)
        if header["count"] == count:
            return state
    return None


def read_index(path: Path) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(header, offsets, shapes, state, where the states and the pixels start); ValueError if not a whole store."""
    with open(path, "rb") as file:
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path} is not a store file")
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        if header.get("version") != VERSION:
            raise ValueError(f"{path} is a store of another version")
        count, sides = header["count"], len(header["min_sides"])
        offsets = np.fromfile(file, np.int64, count * sides).reshape(count, sides)
        shapes = np.fromfile(file, np.int64, count * sides * 2).reshape(count, sides, 2)
        states_at = file.tell()
        state = np.fromfile(file, np.uint8, count)
    start, size = pixels_start(states_at + count), os.path.getsize(path)
    if size != start + header["bytes"]:
        raise ValueError(f"{path} holds {size} bytes, not the {start + header['bytes']} of its header")
    return header, offsets, shapes, state, states_at, start


def pixels_start(index_end: int) -> int:
    """Where the pixels start: the first page after the header and the index."""
    return -(-index_end // ALIGN) * ALIGN


STORE_ENV = "FLOWERS_STORE_DIR"  # the store's folder, where --store-dir does not say: for tests, or a shared disk


def store_folder(flag: str | None) -> Path | None:
    """Where the image store is kept: --store-dir, else $FLOWERS_STORE_DIR, else the user's cache; None: off."""
    return None if flag == "off" else Path(flag or os.environ.get(STORE_ENV) or cache_folder() / "images")


class StoredImages:
    """read_split_data's verify_images for a run: the store in `folder` (else `fallback`, the run's ImageCheck) finds
    the unreadable images. Then `path` is the store's (None: none) and `line` says what became of them."""

    def __init__(self, folder: Path | None, min_sides: list[int], cap: int | None, fallback):
        self.folder, self.min_sides, self.cap, self.fallback = folder, min_sides, cap, fallback
        self.path, self.line = None, "Images: decoded from their files every epoch (--store-dir off)"

    def __call__(self, images: list[str]) -> list[str]:
        if self.folder is None:
            return self.fallback(images)
        try:
            store, self.line = store_for(images, self.folder, self.min_sides, self.cap)
        except OSError as error:
            why = f"{self.folder}: {error.strerror or error}"
            self.line = f"Images: decoded from their files every epoch: no image store could be made ({why})"
            return self.fallback(images)
        self.path, unreadable = store.path, set(store.unreadable())
        return [image for image in images if os.path.abspath(image) in unreadable]


@entry_point
def main(argv=None) -> None:
    """Build the store of a data folder as a run at --img-size would, before any run (python -m dataset.store)."""
    parser = Parser(description=main.__doc__)
    parser.add_argument("data_path", help="a class-per-folder dataset, or one of train/ and val/ folders")
    parser.add_argument("--img-size", type=positive_int, default=224, help="the runs' --img-size")
    parser.add_argument("--store-dir", help="the store's folder (default: the runs' default)")
    parser.add_argument("--store-side", type=positive_int, help="the runs' --store-side (default: auto)")
    args = parser.parse_args(argv)
    if (folder := store_folder(args.store_dir)) is None:
        raise UserError("--store-dir off: no store to build")
    stored = StoredImages(folder, decode_sides(args.img_size), args.store_side, fallback=lambda images: [])
    split = read_split_data(args.data_path, verify_images=stored)
    if stored.path is None:
        raise UserError(stored.line.removeprefix("Images: decoded from their files every epoch: "))
    print(stored.line + (f"; {len(split.unreadable)} unreadable, left out" if split.unreadable else ""))


if __name__ == "__main__":
    main()
