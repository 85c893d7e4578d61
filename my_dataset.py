"""The scripts' dataset (MyDataSet), a split's two sets (datasets) and their batches (loaders); parts in dataset/."""

import atexit
import multiprocessing
import signal
import sys

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from dataset.images import SKIPPED, load_rgb
from dataset.on_device import TrainingBatches, ValidationBatches
from dataset.store import DecodedImages, Store
from dataset.transforms import train_transform, val_transform
from utils import STOP_SIGNALS


class MyDataSet(Dataset):
    """Images and their labels; an item (index, seed) is augmented from that seed alone, the same on any worker. An
    image that cannot be read is a blank one labelled SKIPPED, with a warning."""

    def __init__(self, images_path, images_class, transform=None):
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path, self.images_class, self.transform = list(images_path), list(images_class), transform
        self.min_side = getattr(transform, "min_side", None)  # how small a large JPEG may be decoded (load_rgb)
        self.decoded: DecodedImages | None = None

    def __len__(self):
        return len(self.images_path)

    def __getitem__(self, item):
        if isinstance(item, tuple):  # (index, seed): the transforms draw from the CPU's generator, seeded alone
            index, seed = item
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                return self[index]
        path, label = self.images_path[item], self.images_class[item]
        image = None if self.decoded is None else self.decoded[item]
        if image is None:
            try:
                image = load_rgb(path, self.min_side)
            except Exception as error:  # PIL raises many types for a file that is gone or no longer an image
                print(f"warning: skipped unreadable image {path} ({type(error).__name__}: {error})", file=sys.stderr)
                image, label = Image.new("RGB", (self.min_side or 1,) * 2), SKIPPED
        return (image if self.transform is None else self.transform(image)), label


def datasets(plan, config) -> tuple[MyDataSet, MyDataSet]:
    """The plan's training and validation sets, mapped from its image store if any."""
    split = plan.split
    augment = train_transform(config.img_size, auto_augment=config.auto_augment, random_erase=config.random_erase)
    preset = val_transform(config.img_size)
    train_set = MyDataSet(split.train_images, split.train_labels, augment)
    val_set = MyDataSet(split.val_images, split.val_labels, preset)
    if plan.store is not None:
        store = Store(plan.store)
        for data in (train_set, val_set):
            data.decoded = store.images(data.images_path, data.min_side)
    return train_set, val_set


def loaders(train_set, val_set, batches, val_sampler, config, choice, device: torch.device):
    """The training and validation batches, made where auto chose: on the device, or by loader workers (EpochsAhead)."""
    if not choice.on_device:
        loading = dict(num_workers=choice.workers, persistent_workers=choice.workers > 0 and config.persistent_workers,
                       pin_memory=device.type == "cuda", worker_init_fn=ignore_stop_signals)  # fmt: skip
        training = DataLoader(train_set, batch_sampler=batches, **loading)
        validation = DataLoader(val_set, batch_size=config.batch_size, sampler=val_sampler, **loading)
        return EpochsAhead(training, config.epochs), EpochsAhead(validation)
    return (TrainingBatches(train_set, batches, device, choice.memory_format, choice.batches == "stream"),
            ValidationBatches(val_set, val_sampler, config.batch_size, device))  # fmt: skip


class EpochsAhead:
    """A DataLoader whose workers load the next epoch while this process validates; another epoch starts anew."""

    def __init__(self, loader: DataLoader, epochs: int | None = None):
        self.loader, self.epochs = loader, epochs
        self.dataset, self.batch_sampler = loader.dataset, loader.batch_sampler
        self.started = None  # (the epoch of the pass started ahead, its iterator)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        epoch = getattr(self.batch_sampler, "epoch", None)  # a validation loader's passes are all alike: None
        started, self.started = self.started, None
        yield from started[1] if started is not None and started[0] == epoch else iter(self.loader)
        if self.loader.persistent_workers and (epoch is None or self.epochs is None or epoch + 1 < self.epochs):
            if epoch is not None:
                self.batch_sampler.set_epoch(epoch + 1)
            self.started = (None if epoch is None else epoch + 1, iter(self.loader))


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A loader process's worker_init_fn: SLURM signals every process of a job; the training process decides when."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@atexit.register  # after multiprocessing's own exit handler, so that it runs first (atexit runs the last first)
def end_loader_processes() -> None:
    """At exit, SIGKILL the loader processes still running: multiprocessing's SIGTERM, ignored, would wait for ever."""
    for child in multiprocessing.active_children():
        if child.daemon:  # a DataLoader's workers are; the spawn script's training processes are not
            child.kill()
            child.join()
