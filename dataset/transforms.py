"""The transform presets on 8-bit images, for training and validation, and ImageNet's normalisation on the device."""

import functools
import math

import torch
from torchvision.transforms import v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MEAN_PIXEL = [round(255 * mean) for mean in IMAGENET_MEAN]  # the mean colour in 8 bits: what erasing fills with
RESIZE_RATIO = 256 / 224  # validation resizes to 256 for a centre crop of 224, as for ImageNet
AUTO_AUGMENT = {"trivialaugment": v2.TrivialAugmentWide, "randaugment": v2.RandAugment}  # --auto-augment's choices


class Preset(v2.Compose):
    """A transform, and the shortest image side it needs at full resolution: load_rgb's `min_side`."""

    def __init__(self, transforms: list, min_side: int):
        super().__init__(transforms)
        self.min_side = min_side


def train_transform(img_size: int, auto_augment: str = "none", random_erase: float = 0.0) -> Preset:
    """Random crop and flip, as for ImageNet training, then if asked --auto-augment and random erasing; 8-bit."""
    crop = v2.RandomResizedCrop(img_size, antialias=True)
    # The smallest crop spans sqrt(scale * aspect) of the shorter side, and should still hold img_size pixels
    narrowest = min(crop.ratio[0], 1 / crop.ratio[1])
    min_side = math.ceil(img_size / math.sqrt(crop.scale[0] * narrowest))
    augment = [AUTO_AUGMENT[auto_augment]()] if auto_augment != "none" else []
    erase = [v2.RandomErasing(random_erase, value=MEAN_PIXEL)] if random_erase > 0 else []
    return Preset([v2.ToImage(), crop, v2.RandomHorizontalFlip(), *augment, *erase], min_side)


def val_transform(img_size: int) -> Preset:
    """Resize to img_size * RESIZE_RATIO and take the centre img_size, as for ImageNet validation (8-bit)."""
    resize = round(img_size * RESIZE_RATIO)
    return Preset([v2.ToImage(), v2.Resize(resize, antialias=True), v2.CenterCrop(img_size)], resize)


def decode_sides(img_size: int) -> list[int]:
    """The shorter sides a training image and a validation image are decoded at, at least: the image store's sizes
    (the training crop's, whatever augmentation follows it)."""
    return [train_transform(img_size).min_side, val_transform(img_size).min_side]


def normalise(images: torch.Tensor) -> torch.Tensor:
    """8-bit images normalised by ImageNet's mean and deviation into float32 (any other type is taken as normalised),
    the constants made on each device once: copying them each batch would make the host wait for the device."""
    if images.dtype != torch.uint8:
        return images
    scale, shift = normalising_constants(images.device)
    return torch.addcmul(shift, images, scale)


def normalise_pixels(pixels: torch.Tensor, memory_format=torch.contiguous_format) -> torch.Tensor:
    """A batch of pixel values 0-255 of any type normalised as by `normalise`, into float32 in `memory_format`."""
    scale, shift = normalising_constants(pixels.device)
    out = torch.empty(pixels.shape, dtype=torch.float32, device=pixels.device, memory_format=memory_format)
    return torch.addcmul(shift, pixels, scale, out=out)


@functools.cache
def normalising_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) of shape (3, 1, 1) on `device`: (pixel / 255 - mean) / std as pixel * scale + shift."""
    scale = [1 / (255 * std) for std in IMAGENET_STD]
    shift = [-mean / std for mean, std in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)]
    return torch.tensor(scale, device=device).view(3, 1, 1), torch.tensor(shift, device=device).view(3, 1, 1)
