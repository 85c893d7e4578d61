"""The transform presets on 8-bit images, each with the `min_side` load_rgb needs; normalisation on the device."""

import functools
import math

import torch
from torchvision.transforms import v2

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MEAN_PIXEL = [round(255 * mean) for mean in IMAGENET_MEAN]  # the mean colour in 8 bits: what erasing fills with
RESIZE_RATIO = 256 / 224  # validation resizes to 256 for a centre crop of 224, as for ImageNet
AUTO_AUGMENT = {"trivialaugment": v2.TrivialAugmentWide, "randaugment": v2.RandAugment}  # --auto-augment's choices


def train_transform(img_size: int, auto_augment: str = "none", random_erase: float = 0.0) -> v2.Compose:
    """Random crop and flip, as for ImageNet training, then if asked --auto-augment and random erasing; 8-bit."""
    crop = v2.RandomResizedCrop(img_size, antialias=True)
    augment = [AUTO_AUGMENT[auto_augment]()] if auto_augment != "none" else []
    erase = [v2.RandomErasing(random_erase, value=MEAN_PIXEL)] if random_erase > 0 else []
    transform = v2.Compose([v2.ToImage(), crop, v2.RandomHorizontalFlip(), *augment, *erase])
    # The smallest crop spans sqrt(scale * aspect) of the shorter side, and should still hold img_size pixels
    narrowest = min(crop.ratio[0], 1 / crop.ratio[1])
    transform.min_side = math.ceil(img_size / math.sqrt(crop.scale[0] * narrowest))
    return transform


def val_transform(img_size: int) -> v2.Compose:
    """Resize to img_size * RESIZE_RATIO and take the centre img_size, as for ImageNet validation (8-bit)."""
    resize = round(img_size * RESIZE_RATIO)
    transform = v2.Compose([v2.ToImage(), v2.Resize(resize, antialias=True), v2.CenterCrop(img_size)])
    transform.min_side = resize
    return transform


def decode_sides(img_size: int) -> list[int]:
    """The shorter sides training and validation images are decoded at, whatever the augmentation: the store's."""
    return [train_transform(img_size).min_side, val_transform(img_size).min_side]


def normalise(images: torch.Tensor) -> torch.Tensor:
    """8-bit images normalised by ImageNet's mean and deviation into float32; any other type is taken as normalised."""
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
    """(scale, shift) for pixel * scale + shift on `device`, made once: a copy each batch would make the host wait."""
    scale = [1 / (255 * std) for std in IMAGENET_STD]
    shift = [-mean / std for mean, std in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)]
    return torch.tensor(scale, device=device).view(3, 1, 1), torch.tensor(shift, device=device).view(3, 1, 1)
