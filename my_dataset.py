"""The dataset over a list of image paths and labels, its transforms, and per-sample seeding of augmentation."""

import math

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset, Sampler
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def train_transform(img_size: int):
    """Random crop and flip, as for ImageNet training.

    The image becomes a uint8 tensor first: cropping, resizing and flipping 8-bit pixels is cheaper than on
    PIL images or floats (measured 1.33 against 1.63 ms an image at 224 px), and only the final crop is
    converted to float and normalised.
    """
    return v2.Compose(
        [
            v2.ToImage(),
            v2.RandomResizedCrop(img_size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def val_transform(img_size: int):
    """Resize to img_size*256/224 (256 for 224) and take the centre, as for ImageNet validation."""
    return v2.Compose(
        [
            v2.ToImage(),
            v2.Resize(round(img_size * 256 / 224), antialias=True),
            v2.CenterCrop(img_size),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def train_min_side(img_size: int) -> int:
    """The shortest image side that training at img_size needs: RandomResizedCrop's smallest crop (8 % of the
    area, aspect 3:4) spans 0.245 of that side, and should still hold img_size pixels."""
    return math.ceil(img_size / math.sqrt(0.08 * 3 / 4))


def val_min_side(img_size: int) -> int:
    """The shortest image side validation at img_size needs: it resizes that side to img_size*256/224."""
    return round(img_size * 256 / 224)


def load_rgb(path, min_side: int | None = None) -> Image.Image:
    """Open any image PIL reads as 8-bit RGB: grey, palette, alpha, CMYK and 16-bit or float images included.

    With `min_side`, a JPEG much larger than needed is decoded at 1/2, 1/4 or 1/8 scale (JPEG's own cheap
    reduced decoding), keeping its shorter side at least `min_side`: a 4000x3000 phone photo validated at
    224 px decodes 64 times fewer pixels. Smaller images, and other formats, are decoded in full.
    """
    with Image.open(path) as image:
        if min_side is not None and min(image.size) > 2 * min_side:
            scale = min_side / min(image.size)
            image.draft("RGB", (math.ceil(image.width * scale), math.ceil(image.height * scale)))
        image = ImageOps.exif_transpose(image)  # phone photos are often stored sideways with a rotation tag
        if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
            # 16-bit and float pixels: scale to 0..255 instead of clipping everything above 255 to white.
            pixels = np.asarray(image, dtype=np.float64)
            peak = 65535.0 if image.mode != "F" or pixels.max() > 255 else 255.0
            image = Image.fromarray(np.clip(np.rint(pixels * (255.0 / peak)), 0, 255).astype(np.uint8), mode="L")
        elif "A" in image.mode or "transparency" in image.info:
            image = image.convert("RGBA")
        return image.convert("RGB")


class MyDataSet(Dataset):
    """Images and their class labels; items are (image tensor, label).

    An item may be asked for by index, or by (index, seed) as SeededBatchSampler does: then the random
    augmentation of that sample is drawn from `seed` alone, so it does not depend on which loader worker (or
    how many) loads it.
    """

    def __init__(self, images_path, images_class, transform=None, min_side: int | None = None):
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} images but {len(images_class)} labels")
        self.images_path = list(images_path)
        self.images_class = list(images_class)
        self.transform = transform
        self.min_side = min_side  # see load_rgb: large JPEGs are decoded at reduced scale down to this side

    def __len__(self):
        return len(self.images_path)

    def __getitem__(self, item):
        index, seed = item if isinstance(item, tuple) else (item, None)
        image = load_rgb(self.images_path[index], self.min_side)
        if self.transform is not None:
            if seed is None:
                image = self.transform(image)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    image = self.transform(image)
        return image, self.images_class[index]


class SeededBatchSampler(Sampler):
    """Wraps a batch sampler: each index goes out as (index, seed), the seed a function of (seed, epoch, index).

    `set_epoch` is passed on to the wrapped sampler (a DistributedSampler), which reshuffles by epoch.
    """

    def __init__(self, batch_sampler, seed: int):
        self.batch_sampler = batch_sampler
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_sampler.sampler.set_epoch(epoch)

    def __iter__(self):
        for batch in self.batch_sampler:
            yield [(index, sample_seed(self.seed, self.epoch, index)) for index in batch]

    def __len__(self):
        return len(self.batch_sampler)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch; distinct (seed, epoch, index) give unrelated streams."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)
