"""Decoding once: every image of a run decoded into memory at the start, where they fit, as 8-bit pixels in one
tensor, so that an epoch only crops and flips them."""

import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch

from dataset.images import decoded_size, load_rgb
from machine import cores_per_process, memory_limit


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


def decode_once(sets: list, gigabytes: float | None, processes_here: int = 1) -> str:
    """Decode every image of `sets` (MyDataSets) once into memory (DecodedImages), if all of them fit in
    `gigabytes` (None: a quarter of the memory this run may use, memory_budget; 0: none), so that an epoch only
    crops and flips them. Returns the line saying what it did, and within what budget.

    The sizes come first, from the files' headers (decoded_size), to know whether they fit before decoding any.
    This process's share of the cores decode them, in threads (PIL decodes without holding the GIL), a chunk of
    images to a task (in_chunks)."""
    budget, why = memory_budget(gigabytes, processes_here)
    if budget is None:
        return f"Images: decoded from their files every epoch: {why} (--image-cache-gb)"
    if not budget:
        return "Images: decoded from their files every epoch (--image-cache-gb 0)"
    start, threads = time.perf_counter(), cores_per_process(processes_here)
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
    return (
        f"Images: {images} decoded once into memory ({needed / 1e9:.2f} GB, {time.perf_counter() - start:.1f} s, "
        f"{threads} threads): every epoch crops and flips them there; they fit in {why}"
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
