"""Batches made on the device (--batches device or stream) in place of DataLoaders, from images held there or streamed
from the store; on the CPU, the loader's bitwise (docs/performance.md, Batches made on the device)."""

import math
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torchvision.transforms import v2

from dataset.crop_boxes import draw
from dataset.images import SKIPPED
from dataset.transforms import normalise_pixels
from machine import cores_per_process

AHEAD = 3  # batches a stream gathers ahead of the step
STAGING = 1 << 26  # bytes copied to the device at a time as the images are held there


def resampling_taps(largest_side: int, size: int) -> int:
    """The most input pixels one output pixel of an antialiased resize to `size` reads, from sides to `largest_side`."""
    return math.ceil(2 * max(1.0, largest_side / size)) + 1


class TrainingBatches:
    """`batch_sampler`'s batches of `dataset` (its images in dataset.decoded) made on `device` as its transform makes
    them (8-bit on the CPU, else normalised in `memory_format`), from images held there or, `streamed`, the store."""

    def __init__(self, dataset, batch_sampler, device, memory_format=torch.contiguous_format, streamed=False):
        self.dataset, self.batch_sampler, self.memory_format = dataset, batch_sampler, memory_format
        self.device, self.streamed = torch.device(device), streamed
        self.crop, self.flip = crop_and_flip(dataset.transform)
        images, self.size = dataset.decoded, self.crop.size[0]
        self.readable = readable = images.offsets >= 0
        self.sizes = np.where(readable[:, None], images.shapes, 1)  # an unreadable image: 1 x 1, and black
        self.labels = np.where(readable, np.asarray(dataset.images_class, dtype=np.int64), SKIPPED)
        self.taps = resampling_taps(int(self.sizes.max(initial=1)), self.size)
        if streamed or self.device.type == "cpu":
            self.pixels, self.offsets = images.pixels, np.where(readable, images.offsets, 0)
        else:
            self.pixels, self.offsets = held_on(self.device, images)

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        batches = list(self.batch_sampler)  # this epoch's (from where start_at says), each index with its seed
        pairs = [pair for batch in batches for pair in batch]
        if not pairs:
            return
        rows = self.plan(np.array([i for i, _ in pairs]), np.array([seed for _, seed in pairs], dtype=np.uint64))
        parts = np.split(rows, np.cumsum([len(batch) for batch in batches])[:-1])
        if self.streamed:
            yield from self.stream(parts)
            return
        for part in parts:
            yield self.crops(self.gather(part), part), torch.from_numpy(self.labels[part[:, 0]])

    def plan(self, index: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Each image's row (index, top, left, height, width, flip), its box and flip as the loader draws them."""
        sizes = self.sizes[index]
        boxes, flips = draw(self.crop, self.flip, seeds, sizes[:, 0], sizes[:, 1])
        return np.concatenate([index[:, None], boxes, flips[:, None]], axis=1).astype(np.int64)

    def make(self, index: np.ndarray, seeds: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of images `index` with augmentation `seeds` (auto times this)."""
        rows = self.plan(index, seeds)
        return self.crops(self.gather(rows).to(self.device), rows), torch.from_numpy(self.labels[index])

    def gather(self, rows: np.ndarray, pin: bool = False) -> torch.Tensor:
        return gather_boxes(self.pixels, self.offsets, self.sizes[:, 1], rows, self.taps, pin)

    def crops(self, boxes: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """The batch of `rows` from their `boxes`: on the CPU resized as the loader does, else resampled_by_matrices."""
        readable = self.readable[rows[:, 0]]
        if boxes.device.type == "cpu":
            crops = []
            for box, (_, _, _, height, width, flip), keep in zip(boxes, rows.tolist(), readable, strict=True):
                crop = v2.functional.resize(box[:height, :width].permute(2, 0, 1), [self.size] * 2, antialias=True)
                crop = crop.flip(-1) if flip else crop
                crops.append(crop if keep else torch.zeros_like(crop))
            return torch.stack(crops) if crops else torch.zeros((0, 3, self.size, self.size), dtype=torch.uint8)
        table = torch.from_numpy(np.concatenate([rows[:, 3:6], readable[:, None]], axis=1))
        table = table.pin_memory().to(boxes.device, non_blocking=True)  # pinned: the host waits for nothing
        return normalise_pixels(resampled_by_matrices(boxes, self.taps, table, self.size), self.memory_format)

    def stream(self, parts: list[np.ndarray]):
        """`parts`' batches, gathered by a thread AHEAD ahead, copied on a side stream: the step waits for neither."""
        cuda = self.device.type == "cuda"
        pin = cuda and torch.cuda.is_available()
        copies = torch.cuda.Stream(self.device) if cuda else None
        pending = copied = None
        for boxes, rows in ahead(lambda rows: (self.gather(rows, pin), rows), parts):
            if cuda:
                with torch.cuda.stream(copies):
                    boxes = boxes.to(self.device, non_blocking=True)
                    copied = copies.record_event()
            if pending is not None:
                yield self.arrived(*pending)
            pending = boxes, rows, copied
        if pending is not None:
            yield self.arrived(*pending)

    def arrived(self, boxes: torch.Tensor, rows: np.ndarray, copied):
        """A streamed batch, its crops queued once its copy has arrived (the device waits for it, not the host)."""
        if copied is not None:
            torch.cuda.current_stream(self.device).wait_event(copied)
            boxes.record_stream(torch.cuda.current_stream(self.device))
        return self.crops(boxes, rows), torch.from_numpy(self.labels[rows[:, 0]])


def held_bytes(images) -> int:
    """The bytes held_on takes for `images`, gather_boxes' tail included (and while they are copied, a STAGING more)."""
    return images.bytes + 3 * (3 * int(images.shapes.max(initial=1)) + 2)


def held_on(device: torch.device, images) -> tuple[torch.Tensor, np.ndarray]:
    """The readable images one after another on `device`, and their offsets there: copied STAGING bytes at a time."""
    sizes = 3 * images.shapes.prod(axis=1) * (images.offsets >= 0)
    offsets = np.cumsum(sizes) - sizes
    pixels = torch.zeros(held_bytes(images), dtype=torch.uint8, device=device)
    start = 0
    while start < len(sizes):
        stop = start + 1
        while stop < len(sizes) and offsets[stop] + sizes[stop] - offsets[start] <= STAGING:
            stop += 1
        parts = [images.pixels[images.offsets[i] : images.offsets[i] + sizes[i]] for i in range(start, stop)]
        pixels[offsets[start] : offsets[stop - 1] + sizes[stop - 1]] = torch.cat(parts).to(device)
        start = stop
    return pixels, offsets


def gather_boxes(pixels, offsets, widths, rows: np.ndarray, margin: int, pin: bool = False) -> torch.Tensor:
    """(images, tallest box + margin, widest box + margin, 3): each row's box (index, top, left, height, width) of
    image index (from offsets[index], widths[index] wide) at its top left; below a box its last row again, right of it
    the bytes that follow (the resampling weighs both 0; past the last image, the zeros a store keeps there)."""
    index, top, left, height, width = rows[:, :5].T
    tall, wide = int(height.max()) + margin, int(width.max()) + margin
    lines = top[:, None] + np.minimum(np.arange(tall), height[:, None] - 1)  # each row's line of its image
    starts = offsets[index, None] + (lines * widths[index, None] + left[:, None]) * 3
    if int(starts.max()) + wide * 3 > len(pixels):
        raise ValueError(f"boxes read {int(starts.max()) + wide * 3} bytes, past the {len(pixels)} of the images")
    if pixels.device.type == "cpu":  # numpy: torch in this thread would start an OpenMP team (docs/performance.md)
        source = pixels.numpy()
        windows = np.lib.stride_tricks.as_strided(source, (len(source) - wide * 3 + 1, wide * 3), (1, 1))
        out = torch.from_numpy(windows[starts.reshape(-1)])  # (indexing copies the rows it picks, np.take the view)
        if pin:  # copied by numpy into pinned memory, which torch's caching allocator reuses
            pinned = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
            pinned.numpy()[...] = out.numpy()
            out = pinned
        return out.view(len(rows), tall, wide, 3)
    windows = pixels.unfold(0, wide * 3, 1)  # every run of wide x 3 bytes, a view
    starts = torch.from_numpy(starts.reshape(-1)).pin_memory().to(pixels.device, non_blocking=True)
    return torch.index_select(windows, 0, starts).view(len(rows), tall, wide, 3)


def crop_and_flip(transform: v2.Compose) -> tuple[v2.RandomResizedCrop, v2.RandomHorizontalFlip]:
    """The RandomResizedCrop and RandomHorizontalFlip of a training transform with nothing else; ValueError if not."""
    steps = [step for step in transform.transforms if not isinstance(step, v2.ToImage)]
    plain = len(steps) == 2 and isinstance(steps[0], v2.RandomResizedCrop)
    if not plain or type(steps[1]) is not v2.RandomHorizontalFlip:
        raise ValueError(f"not a plain crop and flip: {transform}")
    return steps[0], steps[1]


def resampled_by_matrices(boxes: torch.Tensor, taps: int, table: torch.Tensor, size: int) -> torch.Tensor:
    """Each box (at the top left of `boxes`; `table`: height, width, flip, readable) resized to `size` as torchvision's
    antialiased resize does, to within rounding, by matrix products: 0-255 in float16 on a GPU, unreadable ones 0."""
    dtype = torch.float16 if boxes.device.type == "cuda" else torch.float32
    height, width, flipped, readable = table.unbind(1)
    batch, tall, wide = len(boxes), boxes.shape[1], boxes.shape[2]
    start = torch.zeros_like(height)
    by_rows = resampling_weights(start, height, size, tall, taps, None, dtype) * readable.to(dtype)[:, None, None]
    columns = resampling_weights(start, width, size, wide, taps, flipped.bool(), dtype)
    resized_rows = torch.bmm(by_rows, boxes.to(dtype).view(batch, tall, wide * 3))
    by_channel = resized_rows.view(batch, size, wide, 3).transpose(2, 3).reshape(batch, size * 3, wide)
    resized = torch.bmm(by_channel, columns.transpose(1, 2))  # (batch, row, channel, column)
    return resized.view(batch, size, 3, size).permute(0, 2, 1, 3)


def resampling_weights(start, length, size: int, padded: int, taps: int, flipped, dtype) -> torch.Tensor:
    """(len(start), size, padded): each output pixel's weights over its span's inputs, as aten's
    _compute_indices_min_size_weights_aa weighs them; flipped images' outputs in reverse."""
    device = start.device
    scale = length.double() / size  # input pixels per output pixel
    support = torch.clamp(scale, min=1.0)  # the filter's half-width, in input pixels
    outputs = torch.arange(size, device=device, dtype=torch.float64)
    if flipped is not None:
        outputs = torch.where(flipped[:, None], size - 1 - outputs, outputs)
    centre = scale[:, None] * (outputs + 0.5)  # (batch, size): in the span's coordinates
    first = torch.clamp(torch.floor(centre - support[:, None] + 0.5), min=0)
    position = first[:, :, None] + torch.arange(taps, device=device, dtype=torch.float64)  # (batch, size, taps)
    weight = torch.clamp(1 - torch.abs((position - centre[:, :, None] + 0.5) / support[:, None, None]), min=0)
    weight = weight * (position < length[:, None, None])  # inside the span
    weight = weight / weight.sum(dim=2, keepdim=True)
    columns = (position + start[:, None, None]).long()  # distinct, and below `padded` (the taps' margin)
    images = torch.arange(len(start), device=device)[:, None, None]
    dense = torch.zeros((len(start), size, padded), dtype=dtype, device=device)
    # index_put_ rather than scatter_: deterministic on a GPU too (torch.use_deterministic_algorithms)
    return dense.index_put_((images, torch.arange(size, device=device)[None, :, None], columns), weight.to(dtype))


def ahead(make, items):
    """make(item) for each of `items`, in order, made by a thread of its own AHEAD items ahead of the one asking."""
    made = queue.Queue(AHEAD)

    def work() -> None:
        try:
            for item in items:
                made.put((make(item), None))
        except BaseException as error:  # raised in the thread that asks for it
            made.put((None, error))

    threading.Thread(target=work, name="batches-ahead", daemon=True).start()
    for _ in items:
        result, error = made.get()
        if error is not None:
            raise error
        yield result


class ValidationBatches:
    """The validation batches of `indices` of `dataset`, each image transformed once and kept on `device`."""

    def __init__(self, dataset, indices, batch_size: int, device: torch.device, workers: int | None = None):
        self.dataset, self.indices, self.batch_size, self.batch_sampler = dataset, list(indices), batch_size, None
        chunks = [self.indices[i : i + 64] for i in range(0, len(self.indices), 64)]  # a task an image costs 0.1 ms
        with ThreadPoolExecutor(workers or cores_per_process(1)) as pool:
            items = [item for part in pool.map(lambda part: [dataset[i] for i in part], chunks) for item in part]
        side = dataset.transform.transforms[-1].size[0] if items == [] else items[0][0].shape[-1]
        pixels = torch.stack([image for image, _ in items]) if items else torch.zeros((0, 3, side, side), torch.uint8)
        self.pixels = pixels.to(device)
        self.labels = torch.tensor([label for _, label in items], dtype=torch.int64)

    def __len__(self):
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.indices), self.batch_size):
            yield self.pixels[start : start + self.batch_size], self.labels[start : start + self.batch_size]
