"""Batches made on the device (dataset/on_device.py, --batches device) are the loader's batches: the same crop boxes
and flips, drawn from the same seeds (the same integers); the same resampling, to rounding on a GPU (its matrices,
run here on the CPU) and bitwise on the CPU; the same validation pixels; and on N ranks the shards of one process's
global batch. On the CPU (the same code runs on a GPU: the host-sync tests run it on fake CUDA, tests/test_gpu.py on
a real one)."""

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F
from wiring import loaders

import dataset.on_device as on_device
from autotune.choose import choose_batches, device_batches_room
from dataset.crop_boxes import draw, drawn_by_the_transforms
from dataset.folders import read_split_data
from dataset.on_device import STAGING, gather_boxes, held_bytes, resampled_by_matrices, resampling_taps
from dataset.sampling import sample_seed, sample_seeds
from dataset.store import store_for
from dataset.transforms import train_transform
from multi_train_utils.train_eval_utils import Choice
from my_dataset import MyDataSet
from run.config import Config

pytestmark = pytest.mark.fast
EXAMPLES = settings(max_examples=25, derandomize=True, deadline=None, database=None)
ON_DEVICE, STREAMED, BY_LOADER = Choice(batches="device"), Choice(batches="stream"), Choice()
SEEDS = st.integers(0, 2**63 - 1)


@EXAMPLES
@given(
    st.lists(st.tuples(SEEDS, st.integers(1, 1200), st.integers(1, 1200)), min_size=1, max_size=60),
    st.sampled_from([8, 32, 224, 384]),
)
def test_the_boxes_and_flips_are_the_transforms_own_for_any_seed_and_image_size(images, size):
    crop, flip = v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()
    seeds, heights, widths = zip(*images, strict=True)
    boxes, flips = draw(crop, flip, seeds, heights, widths)
    for i, (seed, height, width) in enumerate(images):
        assert (list(boxes[i]), bool(flips[i])) == drawn_by_the_transforms(crop, flip, seed, height, width)


def test_images_too_elongated_for_any_try_take_the_central_crop_as_the_transform_does():
    crop, flip = v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip()
    sizes = [(1, 900), (900, 1), (3, 40), (40, 3), (1, 1)]
    boxes, flips = draw(crop, flip, range(5), *zip(*sizes, strict=True))
    for i, (height, width) in enumerate(sizes):
        assert (list(boxes[i]), bool(flips[i])) == drawn_by_the_transforms(crop, flip, i, height, width)


@EXAMPLES
@given(st.integers(0, 2**70), st.integers(0, 2**40), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
def test_an_epochs_seeds_are_sample_seed_for_every_index(seed, epoch, indices):
    assert sample_seeds(seed, epoch, indices).tolist() == [sample_seed(seed, epoch, i) for i in indices]


def recorded_boxes(monkeypatch, train_loader, epoch: int) -> list[tuple]:
    """(top, left, height, width, flipped) of every image of an epoch of `train_loader`, in order, as the
    transforms drew them (the loader's) or as dataset/crop_boxes.py's draw did (batches made on the device)."""
    seen = []
    make_params = v2.RandomResizedCrop.make_params

    def crop_params(self, flat_inputs):
        params = make_params(self, flat_inputs)
        seen.append([params["top"], params["left"], params["height"], params["width"], False])
        return params

    def flip_params(self, flat_inputs):  # called only for an image that is flipped
        seen[-1][-1] = True
        return {}

    def drawn(*args):
        boxes, flips = draw(*args)
        seen.extend([*box, bool(flipped)] for box, flipped in zip(boxes.tolist(), flips, strict=True))
        return boxes, flips

    monkeypatch.setattr(v2.RandomResizedCrop, "make_params", crop_params)
    monkeypatch.setattr(v2.RandomHorizontalFlip, "make_params", flip_params, raising=False)
    monkeypatch.setattr(on_device, "draw", drawn)
    train_loader.batch_sampler.set_epoch(epoch)
    for _ in train_loader:
        pass
    return [tuple(box) for box in seen]


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_epochs_boxes_and_flips_on_the_device_are_the_loaders_integers(tiny_data, monkeypatch, world_size):
    split = read_split_data(tiny_data)
    for rank in range(world_size):
        made = {}
        for name, compute in (("loader", BY_LOADER), ("device", ON_DEVICE), ("stream", STREAMED)):
            train_loader, _ = loaders(split, 32, 4, seed=3, world_size=world_size, rank=rank, choice=compute)
            with monkeypatch.context() as patches:
                made[name] = [recorded_boxes(patches, train_loader, epoch) for epoch in (0, 1)]
        assert made["device"] == made["stream"] == made["loader"] and len(made["loader"][0]) == len(train_loader) * 4
        assert made["loader"][0] != made["loader"][1]  # a new epoch, new boxes


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_cpus_training_batches_held_or_streamed_are_the_loaders_bitwise(tiny_data, world_size):
    """On the CPU each image is cropped by the loader's own call: its 8-bit batches, made from the images held or
    streamed from the store, normalised by the loop in either layout, are the loader's bit for bit, from the store
    or from the files (so a run's batches depend neither on --batches nor on the store there)."""
    split = read_split_data(tiny_data)
    for rank in range(world_size):
        made = [loaders(split, 32, 4, 3, world_size=world_size, rank=rank, choice=c)[0]
                for c in (BY_LOADER, ON_DEVICE, STREAMED)]  # fmt: skip
        made.append(loaders(split, 32, 4, 3, world_size=world_size, rank=rank, stored=False)[0])
        assert made[0].dataset.decoded is not None and made[-1].dataset.decoded is None
        for epoch in (0, 1):
            for loader in made:
                loader.batch_sampler.set_epoch(epoch)
            for (a, labels_a), *others in zip(*made, strict=True):
                for b, labels_b in others:
                    assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b) and torch.equal(labels_a, labels_b)
                for layout in (Choice(), Choice(channels_last=True)):
                    assert torch.equal(layout.batch_to(a, "cpu"), layout.batch_to(others[0][0], "cpu"))


def photo_like(count: int, height: int, width: int, generator) -> torch.Tensor:
    """`count` 8-bit images with the smooth shapes and the grain of photos (what resampling meets)."""
    coarse = torch.rand(count, 3, height // 8 + 1, width // 8 + 1, generator=generator) * 255
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)
    return (smooth + torch.randn(count, 3, height, width, generator=generator) * 20).clamp(0, 255).round().byte()


def test_crops_resampled_by_a_gpus_matrices_are_torchvisions_resized_crop_to_rounding(capsys):
    """The same boxes, through torchvision's resized_crop(antialias=True) on 8-bit images (the loader's) and gathered
    from the images one after another (gather_boxes) through resampled_by_matrices (a GPU's way): shrinking,
    enlarging and flipping, to within rounding of the 8-bit result."""
    generator, size, height, width = torch.Generator().manual_seed(0), 48, 75, 100
    images = photo_like(12, height, width, generator)
    taps = resampling_taps(max(height, width), size)
    pixels = torch.cat([images.permute(0, 2, 3, 1).reshape(-1), torch.zeros(3 * (width + taps), dtype=torch.uint8)])
    # (one after another, as in the store, and zeros past the last, as there)
    offsets, widths = np.arange(len(images)) * height * width * 3, np.full(len(images), width)
    rng = np.random.default_rng(0)
    box_h, box_w = rng.integers(5, height + 1, 48), rng.integers(5, width + 1, 48)
    top, left = rng.integers(0, height - box_h + 1), rng.integers(0, width - box_w + 1)
    flipped, index = rng.random(48) < 0.5, np.arange(48) % len(images)
    rows = np.stack([index, top, left, box_h, box_w], axis=1).astype(np.int64)
    boxes = gather_boxes(pixels, offsets, widths, rows, taps)
    table = torch.from_numpy(np.stack([box_h, box_w, flipped, np.ones(48)], axis=1).astype(np.int64))
    ours = resampled_by_matrices(boxes, taps, table, size)
    differences = []
    for i in range(48):
        theirs = F.resized_crop(images[index[i]], *map(int, (top[i], left[i], box_h[i], box_w[i])), [size, size])
        theirs = F.horizontal_flip(theirs) if flipped[i] else theirs
        differences.append((ours[i] - theirs.float()).abs().flatten())
    difference = torch.cat(differences)
    mean, p99, most = difference.mean().item(), difference.quantile(0.99).item(), difference.max().item()
    with capsys.disabled():
        print(f"\nthe matrices against resized_crop, in levels of 255: mean {mean:.3f}, 99th percentile {p99:.3f}")
    assert mean <= 0.5 and p99 <= 1.0 and most <= 1.5  # the 8-bit result's own rounding is up to 0.5


def test_validation_batches_held_on_the_device_are_the_loaders_pixel_for_pixel(tiny_data):
    split = read_split_data(tiny_data)
    for rank in range(2):
        made = [loaders(split, 32, 4, 0, world_size=2, rank=rank, choice=c)[1] for c in (BY_LOADER, ON_DEVICE)]
        loader, held = ([(images.clone(), labels.clone()) for images, labels in batches] for batches in made)
        assert len(loader) == len(held) == len(made[1])
        for (a, labels_a), (b, labels_b) in zip(loader, held, strict=True):
            assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b) and torch.equal(labels_a, labels_b)


def test_the_ranks_batches_made_on_the_device_are_the_shards_of_one_processs_global_batch(tiny_data):
    """DDP on 2 x B images a step and one process on 2B: each step's images, image by image, bitwise."""
    split = read_split_data(tiny_data)
    single = loaders(split, 32, 8, 5, choice=ON_DEVICE)[0]
    ranks = [loaders(split, 32, 4, 5, world_size=2, rank=rank, choice=ON_DEVICE)[0] for rank in range(2)]
    for loader in (single, *ranks):
        loader.batch_sampler.set_epoch(1)
    for (whole, labels), *shards in zip(single, *ranks, strict=True):
        parts = torch.cat([images for images, _ in shards])
        part_labels = torch.cat([part_labels for _, part_labels in shards])
        # DistributedSampler deals the shuffle out in turn: rank r takes its images r, r + 2, ...
        order = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
        assert torch.equal(parts, whole[order]) and torch.equal(part_labels, labels[order])


def test_auto_makes_batches_where_an_image_costs_least_counting_an_epochs_wait_for_its_first_batch():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    # a GPU step of 0.11 ms an image, a worker's 0.95 ms, 11 steps an epoch: the loader keeps pace within an epoch
    # but every epoch starts by waiting for a worker's batch; making a batch on the GPU costs 0.005 ms an image
    chosen, why = choose_batches(gpu, 0.11e-3, 0.005e-3, 0.95e-3, 8, 16, 11)
    assert chosen and why.startswith("batches made on the device: there 0.115 ms an image") and "loader 0.205" in why
    # the CPU: making a batch costs 6 ms an image there, loading 0.7 ms on a core beside a 40 ms step
    chosen, why = choose_batches(cpu, 40e-3, 6e-3, 0.7e-3, 0, 2, 100)
    assert (
        not chosen and why.startswith("batches made by the loader: there 46.000 ms an image") and "loader 40.700" in why
    )


def test_images_held_take_what_they_need_whatever_their_shapes_and_the_budget_counts_the_peak(tmp_path, monkeypatch):
    """A panorama and a portrait strip among small photos (and an unreadable file): the store and the images held on
    the device take their pixels, one after another, and a tail of 9 bytes per pixel of the longest side, not a slot
    each sized by the set's tallest and widest; copied a chunk at a time; and the room the device must have for them
    is that, and one chunk more, exactly."""
    rng = np.random.default_rng(0)
    shapes = [(30, 40), (40, 30), (36, 48), (12, 900), (900, 12)]  # (height, width): photos, a panorama, a strip
    paths = []
    for index, (height, width) in enumerate(shapes):
        paths.append(str(tmp_path / f"{index}.png"))
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(paths[-1])
    paths.append(str(tmp_path / "broken.png"))
    (tmp_path / "broken.png").write_bytes(b"no image")
    transform = train_transform(8)
    store, _ = store_for(paths, tmp_path / "stores", [transform.min_side])
    images = MyDataSet(paths, [0] * len(paths), transform)
    images.decoded = store.images(paths, transform.min_side)
    needed = sum(3 * height * width for height, width in shapes)
    tail = 3 * (3 * 900 + 2)
    assert images.decoded.bytes == needed and held_bytes(images.decoded) == needed + tail
    assert os.path.getsize(store.path) - store.start == needed + tail  # the store: the same, with its index before
    assert needed + tail < 0.1 * len(shapes) * 3 * 900 * 900  # (a slot of the tallest and widest each: 12 MB)
    monkeypatch.setattr(on_device, "STAGING", 5000)  # several chunks, none more than one image over
    pixels, offsets = on_device.held_on(torch.device("cpu"), images.decoded)
    assert pixels.numel() == needed + tail
    for index, (height, width) in enumerate(shapes):
        held = pixels[offsets[index] : offsets[index] + 3 * height * width].view(height, width, 3).permute(2, 0, 1)
        assert torch.equal(held, images.decoded[index])
    for room, where in ((needed + tail + STAGING - 1, "stream"), (needed + tail + STAGING, "device")):
        config = Config(batches="device", device_images_gb=room / 1e9)
        assert device_batches_room(config, images, torch.device("cpu"))[0] == where


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc (Linux)")
def test_gathering_boxes_from_the_host_in_a_thread_of_its_own_starts_no_compute_threads(monkeypatch):
    """The stream's thread gathers each batch's boxes from the store, on the host: a torch operation there would
    start a team of OpenMP threads for that thread, and with more of them than cores the step's own team stops
    spinning at its barriers (docs/performance.md, the background writer's story). Two compute threads, as on a
    2-core machine; boxes large enough that a torch copy of them would run in parallel."""

    def started_in_a_thread(work) -> set[str]:  # the threads that appeared while `work` ran in a thread of its own
        started = []

        def count():
            before = set(os.listdir("/proc/self/task"))
            work()
            started.append(set(os.listdir("/proc/self/task")) - before)

        thread = threading.Thread(target=count)
        thread.start()
        thread.join()
        return started[0]

    threads = torch.get_num_threads()
    pixels, rows = torch.zeros(1 << 24, dtype=torch.uint8), np.array([[0, 0, 0, 400, 400]] * 16)
    try:
        torch.set_num_threads(2)
        assert started_in_a_thread(lambda: torch.ones(1 << 22).div_(255)), "a torch operation in a thread starts none"
        gathered = started_in_a_thread(lambda: gather_boxes(pixels, np.array([0]), np.array([2000]), rows, 5))
    finally:
        torch.set_num_threads(threads)
    assert gathered == set()
