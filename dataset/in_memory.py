"""Decoding once: a run's images decoded into memory at the start, where they fit, so an epoch only crops them."""

import hashlib
import itertools
import os
import platform
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dataset.images import decoded_size, load_rgb
from machine import available_cores, cores_per_process, memory_limit

# Where the first process of a machine leaves the decoded images for the others: the first with room (share)
SHARED_FOLDERS = [Path("/dev/shm"), Path(tempfile.gettempdir())]


class DecodedImages:
    """A MyDataSet's images in one 8-bit tensor: image i, `shapes[i]` x 3 bytes at `pixels[offsets[i]]` (-1: none)."""

    def __init__(self, pixels: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor):
        self.pixels, self.offsets, self.shapes = pixels, offsets, shapes

    def __getitem__(self, index: int) -> torch.Tensor | None:
        offset = int(self.offsets[index])
        if offset < 0:
            return None
        height, width = self.shapes[index].tolist()
        return self.pixels[offset : offset + height * width * 3].view(height, width, 3).permute(2, 0, 1)


def decode_once(sets: list, gigabytes: float | None, process=None) -> str:
    """Decode every image of `sets` into memory if all fit in `gigabytes` (None: memory_budget); says what it did."""
    if process is None or process.local_world_size == 1:
        return decode_here(sets, gigabytes, 1, available_cores())
    return decode_on_this_machine(sets, gigabytes, process)


def decode_on_this_machine(sets: list, gigabytes: float | None, process) -> str:
    """The first process of this machine decodes, the others copy its file (share); if none, each decodes its own."""
    token = [uuid.uuid4().hex]
    dist.broadcast_object_list(token)  # one name for this start of the job, rank 0's
    name = f"decoded-images-{token[0]}-{hashlib.sha256(platform.node().encode()).hexdigest()[:8]}"  # by machine
    places, here = [folder / name for folder in SHARED_FOLDERS], process.local_world_size
    if process.local_rank == 0:
        line = share(sets, decode_here(sets, gigabytes, here, available_cores()), places)
    dist.barrier()
    if process.local_rank != 0:
        line = read_shared(sets, places) or decode_here(sets, gigabytes, here, cores_per_process(here))
    dist.barrier()
    if process.local_rank == 0:
        for path, suffix in itertools.product(places, (".pt", ".pixels")):
            path.with_suffix(suffix).unlink(missing_ok=True)
    return line


def share(sets: list, line: str, places: list[Path]) -> str:
    """Write `sets`' pixels, then their shapes and `line` (the sign all is there), where there is room; says why not."""
    decoded = [data.decoded for data in sets]
    needed = sum(images.pixels.numel() for images in decoded if images is not None)
    path = next((place for place in places if room(place.parent) > 1.25 * needed), places[-1])
    try:
        with open(path.with_suffix(".pixels"), "wb") as file:
            for images in decoded:
                if images is not None:
                    images.pixels.numpy().tofile(file)
        shapes = [None if images is None else (images.offsets, images.shapes) for images in decoded]
        with open(path.with_suffix(".partial"), "wb") as file:  # (a file object: failures to write are OSErrors)
            torch.save({"line": line, "shapes": shapes}, file)
        os.replace(path.with_suffix(".partial"), path.with_suffix(".pt"))
    except OSError as error:
        for suffix in (".pixels", ".partial"):
            path.with_suffix(suffix).unlink(missing_ok=True)
        return f"{line} (each process of this machine decodes its own: {path.parent}: {error.strerror})"
    return line


def room(folder: Path) -> int:
    """Bytes free in `folder` (0 where there is none)."""
    return shutil.disk_usage(folder).free if folder.is_dir() else 0


def read_shared(sets: list, places: list[Path]) -> str | None:
    """The line of the decoding this machine's first process left at `places` (or None), its images put on `sets`."""
    path = next((place for place in places if place.with_suffix(".pt").exists()), None)
    if path is None:
        return None
    shared = torch.load(path.with_suffix(".pt"), weights_only=True)
    sizes = [0 if shapes is None else 3 * int(shapes[1].prod(dim=1).sum()) for shapes in shared["shapes"]]
    # Mapped, then copied: the file is removed once every process has read it (Windows cannot remove it mapped)
    pixels = torch.empty(0, dtype=torch.uint8)  # (nothing to map where no image fitted the budget)
    if sum(sizes):
        pixels = torch.from_file(str(path.with_suffix(".pixels")), shared=False, size=sum(sizes), dtype=torch.uint8)
    for data, shapes, part in zip(sets, shared["shapes"], pixels.split(sizes), strict=True):
        data.decoded = None if shapes is None else DecodedImages(part.clone(), *shapes)
    return shared["line"]


def decode_here(sets: list, gigabytes: float | None, processes_here: int, threads: int) -> str:
    """decode_once here, by `threads` threads, within one of `processes_here` processes' budget."""
    budget, why = memory_budget(gigabytes, processes_here)
    if budget is None:
        return f"Images: decoded from their files every epoch: {why} (--image-cache-gb)"
    if not budget:
        return "Images: decoded from their files every epoch (--image-cache-gb 0)"
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        sizes = [in_chunks(pool, partial(decoded_size, min_side=data.min_side), data.images_path) for data in sets]
        # (0, 0) for a file PIL cannot open, which is not decoded
        shapes = [torch.tensor([size or (0, 0) for size in part], dtype=torch.int64).reshape(-1, 2) for part in sizes]
        needed = sum(3 * int(table.prod(dim=1).sum()) for table in shapes)
        if needed > budget:
            return (
                f"Images: decoded from their files every epoch: decoded, they would take {needed / 1e9:.1f} GB, "
                f"more than {why}"
            )
        for data, table in zip(sets, shapes, strict=True):
            data.decoded = decoded_images(data, table, pool)
    images = sum(int((data.decoded.offsets >= 0).sum()) for data in sets)
    where = f" on this machine for its {processes_here} processes, each holding a copy" if processes_here > 1 else ""
    return (
        f"Images: {images} decoded once into memory{where} ({needed / 1e9:.2f} GB, "
        f"{time.perf_counter() - start:.1f} s, {threads} threads): every epoch crops and flips them there; "
        f"they fit in {why}"
    )


def memory_budget(gigabytes: float | None, processes_here: int) -> tuple[float | None, str]:
    """(bytes this process may decode into, in words): `gigabytes`, or a quarter of this run's memory over its
    `processes_here` processes; (None, why) where the system does not say its memory."""
    if gigabytes is not None:
        return gigabytes * 1e9, f"the {gigabytes:.1f} GB of --image-cache-gb"
    limit, source = memory_limit()
    if limit is None:
        return None, source
    budget = limit / 4 / processes_here
    why = f"the {budget / 1e9:.1f} GB budget: a quarter of the {limit / 1e9:.1f} GB this run may use ({source})"
    return budget, why + (f", shared among {processes_here} processes" if processes_here > 1 else "")


def decoded_images(data, shapes: torch.Tensor, pool: ThreadPoolExecutor) -> DecodedImages:
    """The images of `data` decoded by `pool` into one tensor; one that fails, or differs in size, left to its file."""
    sizes = 3 * shapes.prod(dim=1)
    ends = sizes.cumsum(dim=0)
    offsets = ends - sizes
    pixels = torch.empty(int(ends[-1]) if len(ends) else 0, dtype=torch.uint8)
    # Plain Python numbers and a NumPy view for the threads: indexing a tensor costs microseconds an image
    flat, starts, stops, sides = pixels.numpy(), offsets.tolist(), ends.tolist(), shapes.tolist()

    def decode(index: int) -> bool:
        if starts[index] == stops[index]:
            return False
        try:
            image = np.asarray(load_rgb(data.images_path[index], data.min_side))
        except Exception:  # PIL raises many types for a file that is gone or no longer an image
            return False
        if image.shape != (*sides[index], 3):
            return False
        flat[starts[index] : stops[index]] = image.reshape(-1)
        return True

    decoded = torch.tensor(in_chunks(pool, decode, range(len(shapes))), dtype=torch.bool)
    offsets[~decoded] = -1
    return DecodedImages(pixels, offsets, shapes)


def in_chunks(pool: ThreadPoolExecutor, function, items, chunk: int = 64) -> list:
    """[function(item) for item in items] by `pool`'s threads, `chunk` items a task (one costs 0.1 ms)."""
    items = list(items)
    parts = [items[start : start + chunk] for start in range(0, len(items), chunk)]
    return [result for part in pool.map(lambda part: [function(item) for item in part], parts) for result in part]
