"""The dataset the scripts train and validate on: images and their class labels (MyDataSet), and the training
and validation sets of a split, built as every script builds them (datasets).

Its parts live in dataset/: the data folder read and split (folders.py), an image file read (images.py), the
transform presets (transforms.py), the images decoded once into memory (in_memory.py), seeded sampling
(sampling.py), the demo data (demo.py), the start-up check of every image (image_check.py), and the batches made
on the device (on_device.py, with each image's crop box drawn in crop_boxes.py).
"""

import sys

import torch
from PIL import Image
from torch.utils.data import Dataset

from dataset.ahead import EpochsAhead  # noqa: F401 (the scripts' loaders)
from dataset.folders import DataSplit
from dataset.images import load_rgb
from dataset.in_memory import ONE_PROCESS, DecodedImages, decode_once
from dataset.on_device import SKIPPED, TrainingBatches, ValidationBatches  # noqa: F401 (the scripts' batches)
from dataset.sampling import SeededSamples
from dataset.transforms import train_transform, val_transform
from multi_train_utils.distributed_utils import Process
from multi_train_utils.stop_and_resume import ignore_stop_signals


class MyDataSet(Dataset):
    """Images and their class labels; items are (image tensor, label).

    A transform that is a Preset also says how small a large JPEG may be decoded (see load_rgb). With
    `decoded` (set by decode_once), an image is taken from memory, decoded there once as load_rgb decodes it,
    instead of from its file. An image that cannot be read when its turn comes (it vanished or broke after the
    start-up check) is skipped with a warning naming it: its item is a blank image, transformed as any other (so
    the batch keeps its shape), labelled SKIPPED.
    """

    def __init__(self, images_path, images_class, transform=None):
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path = list(images_path)
        self.images_class = list(images_class)
        self.transform = transform
        self.min_side = getattr(transform, "min_side", None)
        self.decoded: DecodedImages | None = None

    def __len__(self):
        return len(self.images_path)

    def __getitem__(self, index):
        path, label = self.images_path[index], self.images_class[index]
        image = None if self.decoded is None else self.decoded[index]
        if image is None:
            try:
                image = load_rgb(path, self.min_side)
            except Exception as error:  # PIL raises many types for a file that is gone or no longer an image
                print(f"warning: skipped unreadable image {path} ({type(error).__name__}: {error})", file=sys.stderr)
                image, label = Image.new("RGB", (self.min_side or 1,) * 2), SKIPPED
        if self.transform is not None:
            image = self.transform(image)
        return image, label


def datasets(split: DataSplit, config, process: Process = ONE_PROCESS) -> tuple["SeededSamples", MyDataSet, str]:
    """The training set (augmented, each image seeded by SeededBatchSampler) and the validation set of a split,
    at `config`'s image size and augmentation (a Config: img_size, auto_augment, random_erase), their images
    decoded once into memory where --image-cache-gb allows (decode_once; DDP: once for the processes of this
    machine, `process` saying this one's place among them); and the line saying whether they were."""
    augment = train_transform(config.img_size, auto_augment=config.auto_augment, random_erase=config.random_erase)
    train_set = MyDataSet(split.train_images, split.train_labels, augment)
    val_set = MyDataSet(split.val_images, split.val_labels, val_transform(config.img_size))
    decoded = decode_once([train_set, val_set], config.image_cache_gb, process)
    return SeededSamples(train_set), val_set, decoded


def loader_options(workers: int, config, device: torch.device) -> dict:
    """The DataLoader settings of the training scripts' loaders: `workers` loader processes, kept between epochs
    (unless --no-persistent-workers, as the original scripts did), which leave a stop signal to the training
    process to act on, at a step (ignore_stop_signals); on a GPU, batches in pinned memory, so that their copies to
    it overlap with its work."""
    loading = {"num_workers": workers, "persistent_workers": workers > 0 and config.persistent_workers}
    return loading | {"pin_memory": device.type == "cuda", "worker_init_fn": ignore_stop_signals}
