"""Ways to crop and resize a batch of images held on the device, against each other: time and fidelity.

    python tools/resample_candidates.py                 # on the GPU if there is one, else the CPU
    python tools/resample_candidates.py --device cpu --batch-size 32

Each candidate makes the same batch: `--batch-size` random crop boxes (RandomResizedCrop's range of areas and
aspects) of photo-like 8-bit images of 375 x 500 pixels (flower_photos' largest), resized to `--size` with
antialiasing, half of them flipped; its time is the best of 5 after one untimed call (the device synchronised), and
its fidelity the mean and 99th percentile of its absolute difference, in levels of 255, from torchvision's
resized_crop(antialias=True) of the same 8-bit image (the loader's).

- matrices: dataset/on_device.py's resampled_by_matrices, two batched matrix products with interpolate's antialiased
  weights (what the scripts use on a GPU);
- per image: torch's interpolate(mode="bilinear", antialias=True) on each crop, one call per image, in float32;
- per image, 8-bit: torchvision's resized_crop on each image's 8-bit pixels (the loader's call, and dataset/
  on_device.py's resized_crops on the CPU: the reference itself, so its difference is 0);
- roi_align: torchvision.ops.roi_align over the padded batch with adaptive sampling (sampling_ratio=-1, an average
  of bilinear samples in each output pixel's bin: another filter than the antialiased one), float32.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.ops import roi_align
from torchvision.transforms.v2 import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataset.on_device import resampled_by_matrices, resampling_taps, resized_crops  # noqa: E402

HEIGHT, WIDTH = 375, 500


def boxes(count: int, rng: np.random.Generator) -> np.ndarray:
    """(top, left, height, width) of `count` boxes as RandomResizedCrop draws them (areas 8-100 %, aspects 3/4-4/3)."""
    area = HEIGHT * WIDTH * rng.uniform(0.08, 1.0, count)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3), count))
    width = np.clip(np.round(np.sqrt(area * aspect)), 1, WIDTH).astype(int)
    height = np.clip(np.round(np.sqrt(area / aspect)), 1, HEIGHT).astype(int)
    top, left = rng.integers(0, HEIGHT - height + 1), rng.integers(0, WIDTH - width + 1)
    return np.stack([top, left, height, width], axis=1)


def candidates(images: torch.Tensor, held: torch.Tensor, taps: int, box: torch.Tensor, flips: torch.Tensor, size):
    """name: a function making the batch (pixel values 0-255, (batch, 3, size, size))."""
    index = torch.arange(len(box), device=held.device) % len(images)

    def matrices():
        return resampled_by_matrices(held, taps, index, *box.unbind(1), flips, size)

    def per_image():
        out = []
        for i, (top, left, height, width) in enumerate(box.tolist()):
            crop = images[i % len(images), :, top : top + height, left : left + width][None].float()
            resized = torch.nn.functional.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
            out.append(resized.flip(-1) if flips[i] else resized)
        return torch.cat(out)

    def per_image_8_bit():
        return resized_crops(held, taps, index, *box.unbind(1), flips, size)

    def aligned():
        top, left, height, width = box.float().unbind(1)
        rois = torch.stack([index.float(), left, top, left + width, top + height], dim=1)
        out = roi_align(images.float(), rois, (size, size), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
        return torch.where(flips[:, None, None, None], out.flip(-1), out)

    made = {"matrices": matrices, "per image": per_image, "roi_align": aligned}
    if held.device.type == "cpu":  # elsewhere resized_crops is the matrices
        made["per image, 8-bit"] = per_image_8_bit
    return made


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args(argv)
    device, rng = torch.device(args.device), np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    coarse = torch.rand(16, 3, HEIGHT // 8, WIDTH // 8, generator=generator) * 255
    smooth = torch.nn.functional.interpolate(coarse, size=(HEIGHT, WIDTH), mode="bicubic")
    images = (smooth + torch.randn(16, 3, HEIGHT, WIDTH, generator=generator) * 20).clamp(0, 255).round().byte()
    taps = resampling_taps(WIDTH, args.size)
    held = torch.zeros(16, HEIGHT + taps, WIDTH + taps, 3, dtype=torch.uint8)
    held[:, :HEIGHT, :WIDTH] = images.permute(0, 2, 3, 1)
    box_array = boxes(args.batch_size, rng)
    flips = torch.from_numpy(rng.random(args.batch_size) < 0.5)
    reference = torch.stack([
        F.horizontal_flip(crop) if flip else crop
        for crop, flip in ((F.resized_crop(images[i % 16], *map(int, b), [args.size, args.size]), flips[i])
                           for i, b in enumerate(box_array))
    ]).float()  # fmt: skip
    on = lambda tensor: tensor.to(device)  # noqa: E731
    made = candidates(on(images), on(held), taps, on(torch.from_numpy(box_array)), on(flips), args.size)
    print(f"{args.batch_size} crops of {HEIGHT} x {WIDTH} images to {args.size} px on {device}:")
    for name, make in made.items():
        out = make()
        seconds = []
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            make()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        difference = (out.float().cpu() - reference).abs().flatten()
        sample = difference[torch.randperm(len(difference), generator=generator)[:1_000_000]]
        print(
            f"  {name:16s} {min(seconds) * 1000 / args.batch_size:8.3f} ms an image; against resized_crop: mean "
            f"{difference.mean():.3f}, 99th percentile {sample.quantile(0.99):.3f} levels of 255"
        )


if __name__ == "__main__":
    main()
