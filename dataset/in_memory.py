"""Decoding once: every image of a run decoded into memory at the start, where they fit, as 8-bit pixels in one
tensor, so that an epoch only crops and flips them."""

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

# Where the first process of a machine leaves the decoded images for the others, the first with room (share)
SHARED_FOLDERS = [Path("/dev/shm"), Path(tempfile.gettempdir())]


class DecodedImages:
    """The images of a MyDataSet decoded once, as load_rgb decodes them, and kept as 8-bit pixels in one tensor:
    image i is `shapes[i]` (height, width) x 3 bytes from `pixels[offsets[i]]`, given out as the 3 x height x
    width tensor v2.ToImage makes of load_rgb's image, so every transform computes exactly what it would on the
    file's image. An offset of -1: the image was not decoded (its file could not be), and is read from its file.

    Loader workers share the tensor, not copies of it: those started by fork (Linux) inherit it, those started by
    spawn (Windows, macOS) receive it in shared memory, as torch hands tensors to other processes."""

    def __init__(self, pixels: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor):
        self.pixels, self.offsets, self.shapes = pixels, offsets, shapes

    def __getitem__(self, index: int) -> torch.Tensor | None:
        offset = int(self.offsets[index])
        if offset < 0:
            return None
        height, width = self.shapes[index].tolist()
        return self.pixels[offset : offset + height * width * 3].view(height, width, 3).permute(2, 0, 1)


def decode_once(sets: list, gigabytes: float | None, process=None) -> str:
    """Decode every image of `sets` (MyDataSets) once into memory (DecodedImages), if all of them fit in
    `gigabytes` (None: a quarter of the memory this run may use, memory_budget; 0: none), so that an epoch only
    crops and flips them. Returns the line saying what it did, and within what budget.

    DDP: the processes of one machine (`process` says this one's place among them) share one decoding
    (decode_on_this_machine), instead of each decoding every image on its share of the cores."""
    if process is None or process.local_world_size == 1:
        return decode_here(sets, gigabytes, 1, available_cores())
    return decode_on_this_machine(sets, gigabytes, process)


def decode_on_this_machine(sets: list, gigabytes: float | None, process) -> str:
    """DDP: the first process of this machine decodes the images with all of its cores (the others wait: their
    cores would idle otherwise) and writes their pixels to a file (in memory where the system has room there:
    share); the others map that file and copy it into memory of their own; then the file is removed. Each process
    of the job meets the others twice here (a barrier each), so every machine's processes go on together. Where
    the file cannot be written (a full or read-only folder), the others decode their own, and the line says why."""
    token = [uuid.uuid4().hex]
    dist.broadcast_object_list(token)  # one name for this start of the job, rank 0's
    name = f"decoded-images-{token[0]}-{host_tag()}"
    places = [folder / name for folder in SHARED_FOLDERS]
    if process.local_rank == 0:
        line = decode_here(sets, gigabytes, process.local_world_size, available_cores())
        line = share(sets, line, places)
    dist.barrier()
    if process.local_rank != 0:
        line = read_shared(sets, places) or decode_here(
            sets, gigabytes, process.local_world_size, cores_per_process(process.local_world_size)
        )
    dist.barrier()
    if process.local_rank == 0:
        for path, suffix in itertools.product(places, (".pt", ".pixels")):
            path.with_suffix(suffix).unlink(missing_ok=True)
    return line


def share(sets: list, line: str, places: list[Path]) -> str:
    """Write `sets`' decoded pixels, one after another, to <place>.pixels, then their offsets and shapes and
    decode_here's `line` to <place>.pt (torch.save; the sign that all is written) for the other processes of this
    machine (read_shared). The place is the first of `places` whose folder has room for them with a quarter to
    spare: /dev/shm (memory, on Linux) before the temporary folder, as a container's /dev/shm is often 64 MB;
    writing 1.4 GB took 0.7 s there on the 2-core test machine, 5.8 s to its disk. Returns `line`, with why the
    others decode their own where nothing could be written."""
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
    """Bytes free in `folder`; 0 where there is no such folder."""
    return shutil.disk_usage(folder).free if folder.is_dir() else 0


def read_shared(sets: list, places: list[Path]) -> str | None:
    """The line of the decoding that the first process of this machine left at one of `places` (share), its
    images set on `sets`, each a copy in this process's memory; None where it left none."""
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


def host_tag() -> str:
    """A short tag of this machine's name: machines that share a temporary folder keep their files apart."""
    return hashlib.sha256(platform.node().encode()).hexdigest()[:8]


def decode_here(sets: list, gigabytes: float | None, processes_here: int, threads: int) -> str:
    """decode_once in this process, with `threads` threads, within the budget of one of `processes_here`
    processes on this machine.

    The sizes come first, from the files' headers (decoded_size), to know whether they fit before decoding any.
    The threads decode them (PIL decodes without holding the GIL), a chunk of images to a task (in_chunks)."""
    budget, why = memory_budget(gigabytes, processes_here)
    if budget is None:
        return f"Images: decoded from their files every epoch: {why} (--image-cache-gb)"
    if not budget:
        return "Images: decoded from their files every epoch (--image-cache-gb 0)"
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        # Each set's (height, width) per image; (0, 0) for a file PIL cannot open, which is not decoded
        shapes = [
            torch.tensor(
                [
                    size or (0, 0)
                    for size in in_chunks(pool, partial(decoded_size, min_side=data.min_side), data.images_path)
                ],
                dtype=torch.int64,
            ).reshape(-1, 2)
            for data in sets
        ]
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
    """(the bytes of decoded images this process may hold; that budget in words, with where it comes from, for
    decode_once's line): `gigabytes` (--image-cache-gb), or where it is None, a quarter of the memory this run may
    use (the least of its cgroup's limit, SLURM's allocation and the machine's memory: machine.memory_limit),
    shared among the `processes_here` training processes on this machine, each of which holds its own; (None,
    why) where the system does not say its memory."""
    if gigabytes is not None:
        return gigabytes * 1e9, f"the {gigabytes:.1f} GB of --image-cache-gb"
    limit, source = memory_limit()
    if limit is None:
        return None, source
    budget = limit / 4 / processes_here
    shared = f", shared among {processes_here} processes" if processes_here > 1 else ""
    return (
        budget,
        f"the {budget / 1e9:.1f} GB budget: a quarter of the {limit / 1e9:.1f} GB this run may use ({source}){shared}",
    )


def decoded_images(data, shapes: torch.Tensor, pool: ThreadPoolExecutor) -> DecodedImages:
    """The images of `data` (a MyDataSet) decoded by `pool`'s threads into one tensor, image i where `shapes[i]`
    (its height and width, from decoded_size) says it fits; one whose file cannot be decoded, or decodes to another
    size than its header said, is left to be read from its file (offset -1)."""
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
    """[function(item) for item in items], computed by `pool`'s threads `chunk` items to a task: a task per item
    costs the pool about 0.1 ms in locking and switching between threads, more than a small image takes to decode."""
    items = list(items)
    parts = [items[start : start + chunk] for start in range(0, len(items), chunk)]
    return [result for part in pool.map(lambda part: [function(item) for item in part], parts) for result in part]
