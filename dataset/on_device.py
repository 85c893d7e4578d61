"""Batches made on the device (--batches device), in place of DataLoaders: the images held there, each batch cropped
with the loader's boxes, resized and flipped there (docs/performance.md, Batches made on the device)."""

import math
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torchvision.transforms import v2

from dataset.crop_boxes import draw
from dataset.images import SKIPPED, load_rgb
from dataset.in_memory import in_chunks
from dataset.transforms import normalise_pixels
from machine import cores_per_process


class HeldImages:
    """A MyDataSet's images on the device, each top-left in (height + taps, width + taps, 3) of zeros (`pixels`);
    `sizes` and `labels` (SKIPPED: unreadable) on the host."""

    def __init__(self, pixels: torch.Tensor, sizes: np.ndarray, labels: np.ndarray, taps: int):
        self.pixels, self.sizes, self.labels, self.taps = pixels, sizes, labels, taps


def resampling_taps(largest_side: int, size: int) -> int:
    """The most input pixels one output pixel of an antialiased resize to `size` reads, from sides to `largest_side`."""
    return math.ceil(2 * max(1.0, largest_side / size)) + 1


def held_size(data, size: int) -> tuple[int, int, int]:
    """(bytes, padded height, padded width) of `data`'s images held for crops of `size`."""
    shapes = data.decoded.shapes
    height, width = (int(side) for side in shapes.max(dim=0).values.tolist()) if len(shapes) else (1, 1)
    taps = resampling_taps(max(height, width), size)
    return len(shapes) * (height + taps) * (width + taps) * 3, height + taps, width + taps


def hold(data, size: int, device: torch.device, indices=None) -> HeldImages:
    """`data`'s images (or those of `indices`) held on `device`; one unreadable is black, SKIPPED, warned of."""
    _, padded_height, padded_width = held_size(data, size)
    taps = resampling_taps(int(data.decoded.shapes.max()) if len(data) else 1, size)
    indices = list(range(len(data))) if indices is None else list(indices)
    pixels = torch.zeros((len(indices), padded_height, padded_width, 3), dtype=torch.uint8, device=device)
    sizes = np.zeros((len(indices), 2), dtype=np.int64)
    labels = np.array([data.images_class[index] for index in indices], dtype=np.int64)
    chunk = 64
    for start in range(0, len(indices), chunk):
        part = torch.zeros((min(chunk, len(indices) - start), padded_height, padded_width, 3), dtype=torch.uint8)
        for row in range(len(part)):
            image = decoded_pixels(data, indices[start + row])
            if image is None:
                labels[start + row] = SKIPPED
                continue
            sizes[start + row] = image.shape[:2]
            part[row, : image.shape[0], : image.shape[1]] = image
        pixels[start : start + len(part)] = part.to(device)
    return HeldImages(pixels, sizes, labels, taps)


def decoded_pixels(data, index: int) -> torch.Tensor | None:
    """Image `index` of `data` as height x width x 3 bytes, from memory or its file; None if unreadable."""
    image = data.decoded[index]
    if image is not None:
        return image.permute(1, 2, 0)
    try:
        return torch.from_numpy(np.asarray(load_rgb(data.images_path[index], data.min_side)).copy())
    except Exception as error:  # PIL raises many types for a file that is gone or no longer an image
        print(f"warning: skipped unreadable image {data.images_path[index]} ({type(error).__name__}: {error})",
              file=sys.stderr)  # fmt: skip
        return None


class TrainingBatches:
    """`batch_sampler`'s batches made on `device` as `dataset`'s transform would (normalised on a GPU, 8-bit else)."""

    def __init__(self, dataset, batch_sampler, device, memory_format=torch.contiguous_format, held=None):
        self.dataset, self.batch_sampler, self.memory_format = dataset, batch_sampler, memory_format
        self.crop, self.flip = crop_and_flip(dataset.transform)
        self.size = self.crop.size[0]
        self.held = held if held is not None else hold(dataset, self.size, torch.device(device))

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        batches = list(self.batch_sampler)  # this epoch's (from where start_at says), each index with its seed
        pairs = [pair for batch in batches for pair in batch]
        if not pairs:
            return
        index = np.array([i for i, _ in pairs], dtype=np.int64)
        plan, labels = self.plan(index, np.array([seed for _, seed in pairs], dtype=np.uint64))
        start = 0
        for batch in batches:
            yield self.crops(plan[start : start + len(batch)]), labels[start : start + len(batch)]
            start += len(batch)

    def plan(self, index: np.ndarray, seeds: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Each image's row (index, top, left, height, width, flip) on the device, and the labels: one copy."""
        sizes = self.held.sizes[index]
        boxes, flips = draw(self.crop, self.flip, seeds, sizes[:, 0], sizes[:, 1])
        plan = torch.from_numpy(np.concatenate([index[:, None], boxes, flips[:, None]], axis=1))
        labels = torch.from_numpy(self.held.labels[index])
        device = self.held.pixels.device
        if device.type == "cuda":  # pinned, the copy is queued and the host waits for nothing
            plan, labels = plan.pin_memory(), labels.pin_memory()
        return plan.to(device, non_blocking=True), labels

    def make(self, index: np.ndarray, seeds: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of images `index` (of the held ones) with augmentation `seeds` (auto times this)."""
        plan, labels = self.plan(index, seeds)
        return self.crops(plan), labels

    def crops(self, rows: torch.Tensor) -> torch.Tensor:
        """The batch of `rows`: normalised on a GPU; 8-bit on the CPU, which the loop normalises as the loader's."""
        pixels = resized_crops(self.held.pixels, self.held.taps, rows, self.size)
        return pixels if pixels.dtype == torch.uint8 else normalise_pixels(pixels, self.memory_format)


def crop_and_flip(transform: v2.Compose) -> tuple[v2.RandomResizedCrop, v2.RandomHorizontalFlip]:
    """The RandomResizedCrop and RandomHorizontalFlip of a training transform with nothing else; ValueError if not."""
    steps = [step for step in transform.transforms if not isinstance(step, v2.ToImage)]
    plain = len(steps) == 2 and isinstance(steps[0], v2.RandomResizedCrop)
    if not plain or type(steps[1]) is not v2.RandomHorizontalFlip:
        raise ValueError(f"not a plain crop and flip: {transform}")
    return steps[0], steps[1]


def resized_crops(pixels, taps: int, rows: torch.Tensor, size: int) -> torch.Tensor:
    """The boxes `rows` name (index, top, left, height, width, flip) resized to `size` x `size`, flipped where 1."""
    if pixels.device.type != "cpu":
        return resampled_by_matrices(pixels, taps, rows, size)
    crops = []
    for image, *box, flip in rows.tolist():
        crop = v2.functional.resized_crop(pixels[image].permute(2, 0, 1), *box, [size, size], antialias=True)
        crops.append(crop.flip(-1) if flip else crop)
    return torch.stack(crops) if crops else torch.zeros((0, 3, size, size), dtype=torch.uint8)


def resampled_by_matrices(pixels, taps: int, rows: torch.Tensor, size: int) -> torch.Tensor:
    """resized_crops on a GPU, to within rounding, as 0-255 in float16: rows, then columns, by matrix products."""
    dtype = torch.float16 if pixels.device.type == "cuda" else torch.float32
    index, top, left, height, width, flipped = rows.unbind(1)
    batch, padded_height, padded_width = len(index), pixels.shape[1], pixels.shape[2]
    images = pixels[index].to(dtype)  # (batch, padded height, padded width, 3)
    by_rows = resampling_weights(top, height, size, padded_height, taps, None, dtype)
    columns = resampling_weights(left, width, size, padded_width, taps, flipped.bool(), dtype)
    resized_rows = torch.bmm(by_rows, images.view(batch, padded_height, padded_width * 3))
    by_channel = resized_rows.view(batch, size, padded_width, 3).transpose(2, 3).reshape(batch, size * 3, padded_width)
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
    columns = (position + start[:, None, None]).long()  # distinct, and below `padded`: HeldImages' padding
    images = torch.arange(len(start), device=device)[:, None, None]
    dense = torch.zeros((len(start), size, padded), dtype=dtype, device=device)
    # index_put_ rather than scatter_: deterministic on a GPU too (torch.use_deterministic_algorithms)
    return dense.index_put_((images, torch.arange(size, device=device)[None, :, None], columns), weight.to(dtype))


class ValidationBatches:
    """The validation batches of `indices` of `dataset`, each image transformed once and kept on `device`."""

    def __init__(self, dataset, indices, batch_size: int, device: torch.device, workers: int | None = None):
        self.dataset, self.indices, self.batch_size = dataset, list(indices), batch_size
        self.batch_sampler = None
        with ThreadPoolExecutor(workers or cores_per_process(1)) as pool:
            items = in_chunks(pool, dataset.__getitem__, self.indices)
        side = dataset.transform.transforms[-1].size[0] if items == [] else items[0][0].shape[-1]
        pixels = torch.stack([image for image, _ in items]) if items else torch.zeros((0, 3, side, side), torch.uint8)
        self.pixels = pixels.to(device)
        self.labels = torch.tensor([label for _, label in items], dtype=torch.int64)

    def __len__(self):
        return math.ceil(len(self.indices) / self.batch_size)

    def __iter__(self):
        for start in range(0, len(self.indices), self.batch_size):
            yield self.pixels[start : start + self.batch_size], self.labels[start : start + self.batch_size]
