"""Where a run's training batches are made (--batches): on the device, from images held there
(dataset/on_device.py), or by the loader's processes, each image cropped and flipped on a CPU core; what is
possible, what each costs, and auto's choice between them (run/autotune.py asks)."""

import time

import numpy as np
import torch

from dataset.in_memory import memory_budget
from dataset.on_device import TrainingBatches, crop_and_flip, held_size, hold
from dataset.sampling import sample_seeds

DEVICE_SHARE = 0.5  # of a GPU's free memory, at most, for the images held there: the rest is the training's


def device_batches_possible(config, train_set, device: torch.device, processes_here: int) -> tuple[bool, str]:
    """Whether this run's training batches can be made on `device` (`train_set`: a SeededSamples), and the line
    saying why not, or how much room the images take there. They can where the training transform is a plain crop
    and flip (no --auto-augment or --random-erase, which have no batched form here), the images were decoded once
    into memory, and they fit on the device: within DEVICE_SHARE of a GPU's free memory, or beside the decoded
    images within the memory budget on the CPU."""
    if config.batches == "loader":
        return False, "Batches: made by the loader (--batches loader)"
    data = train_set.dataset
    if device.type not in ("cuda", "cpu"):
        return False, f"Batches: made by the loader: on {device.type}, making them on the device is not measured here"
    try:
        crop_and_flip(data.transform)
    except ValueError:
        switch = "--auto-augment" if config.auto_augment != "none" else "--random-erase"
        return False, f"Batches: made by the loader: {switch} has no batched form on the device"
    if data.decoded is None:
        return False, "Batches: made by the loader: the images were not decoded into memory (see the Images line)"
    needed, height, width = held_size(data, config.img_size)
    if device.type == "cuda":
        room = DEVICE_SHARE * torch.cuda.mem_get_info(device)[0]
        where = f"half of the {room / DEVICE_SHARE / 1e9:.1f} GB free on {device}"
    else:
        budget, why = memory_budget(config.image_cache_gb, processes_here)
        room = (budget or 0) - data.decoded.pixels.numel()
        where = f"what the decoded images leave of {why}"
    sizes = f"{len(data)} images padded to {height} x {width} px: {needed / 1e9:.2f} GB"
    if needed > room:
        return False, f"Batches: made by the loader: held on {device.type}, {sizes}, more than {where}"
    return True, f"{sizes}, within {where}"


def device_seconds_per_image(train_set, batch_size: int, device: torch.device, memory_format) -> float:
    """Seconds the device takes to make a training batch (crop boxes drawn on the host, then gathered, resampled,
    flipped and normalised on the device), per image: a batch of `batch_size` of the first images, each
    repeated as needed, held on the device, made once untimed and then timed (the device synchronised)."""
    data = train_set.dataset
    sample = list(range(min(batch_size, len(data))))
    held = hold(data, crop_and_flip(data.transform)[0].size[0], device, sample)
    batches = TrainingBatches(train_set, [], device, memory_format, held=held)
    index = np.resize(np.arange(len(sample)), batch_size)
    seeds = sample_seeds(0, 0, index)

    def make() -> float:
        start = time.perf_counter()
        batches.make(index, seeds)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    make()
    return min(make() for _ in range(2)) / batch_size


def choose_batches(device, step: float, on_device: float, load: float, workers: int, share: int, steps: int):
    """(whether to make batches on the device, why), from seconds per image: a training step's (`step`), making a
    batch on the device (`on_device`), and loading an image on one core (`load`); `workers` loader workers
    (chosen or given), `share` this process's cores, `steps` an epoch's steps.

    On the device, a batch is made before its step, on the same device: step + on_device an image. By the loader,
    the faster of loading on the workers' cores and training on the rest (on a GPU, the cores only load), and each
    epoch starts by waiting for a worker's first batch (a batch's worth of loading, over the epoch's images)."""
    if workers == 0:
        loader = load + step
    elif device.type == "cpu":
        loader = max(load / workers, step * share / max(share - workers, 1)) + load / steps
    else:
        loader = max(load / workers, step) + load / steps
    device_time = step + on_device
    chosen = device_time < loader
    where = "on the device" if chosen else "by the loader"  # ("there": on the device)
    start = ", and each epoch's start" if workers else ""
    return chosen, (
        f"batches made {where}: there {device_time * 1000:.3f} ms an image (the step, and making its batch "
        f"{on_device * 1000:.3f}); by the loader {loader * 1000:.3f} ({workers} workers at "
        f"{load * 1000:.2f} ms an image each{start})"
    )


def held_bytes(train_set, img_size: int) -> int:
    """The bytes the training images of `train_set` (a SeededSamples) take held on the device for crops of
    `img_size` (what the micro-batch search leaves room for)."""
    return held_size(train_set.dataset, img_size)[0]


def steps_per_epoch(config, plan, world_size: int) -> int:
    return max(1, len(plan.split.train_images) // (config.batch_size * world_size))
