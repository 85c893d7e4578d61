"""Write a folder shaped like flower_photos, for benchmarks: 5 class folders of photo-like JPEGs, 3,670 in all.

    python3 tools/make_flower_jpegs.py /tmp/flower_photos_synthetic          # 633/898/641/699/799 JPEGs
    python3 tools/make_flower_jpegs.py /tmp/flowers_small --scale 0.01       # 1 % of each class: a quick check

Landscape JPEGs of 320x240 to 500x375 with the texture of photos (blurred flowers on a shaded background, grain),
so that decoding and resizing cost what real photos cost. Self-contained (PIL and numpy, nothing from the project).
The folder appears whole or not at all; an existing one is left as it is.
"""

import argparse
import math
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

CLASSES = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}
MIN_SIZE, MAX_SIZE = (320, 240), (500, 375)
# Per class: petal colours (RGB), centre colour, petals per flower, petal length and width (fractions of radius)
LOOKS = {
    "daisy": ([(245, 245, 240), (235, 230, 245)], (230, 190, 40), (14, 22), (0.55, 0.18)),
    "dandelion": ([(250, 210, 30), (240, 190, 20)], (220, 170, 10), (30, 44), (0.5, 0.08)),
    "roses": ([(200, 20, 50), (230, 90, 120), (160, 10, 30)], (120, 10, 25), (8, 12), (0.45, 0.4)),
    "sunflowers": ([(250, 200, 20), (240, 170, 10)], (90, 55, 20), (16, 24), (0.45, 0.16)),
    "tulips": ([(220, 40, 60), (240, 120, 30), (150, 50, 160), (245, 200, 60)], (60, 60, 20), (5, 7), (0.6, 0.35)),
}
BACKGROUNDS = [((70, 120, 50), (30, 70, 25)), ((120, 160, 210), (60, 110, 50)), ((90, 90, 70), (40, 50, 30))]


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    return int(rng.integers(MIN_SIZE[0], MAX_SIZE[0] + 1)), int(rng.integers(MIN_SIZE[1], MAX_SIZE[1] + 1))


def background(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A vertical colour gradient with large soft blotches, HxWx3 float."""
    top, bottom = (np.array(c, dtype=np.float32) for c in BACKGROUNDS[rng.integers(len(BACKGROUNDS))])
    t = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    image = np.broadcast_to(top * (1 - t) + bottom * t, (height, width, 3)).copy()
    coarse = rng.normal(0.0, 28.0, size=(int(rng.integers(4, 9)), int(rng.integers(5, 11)), 3)).astype(np.float32)
    blotches = Image.fromarray(np.clip(coarse + 128, 0, 255).astype(np.uint8)).resize((width, height), Image.BICUBIC)
    return image + (np.asarray(blotches, dtype=np.float32) - 128)


def draw_flower(draw: ImageDraw.ImageDraw, rng: np.random.Generator, kind: str, x: float, y: float, r: float):
    colours, centre, petal_range, (length, breadth) = LOOKS[kind]
    petals = int(rng.integers(*petal_range))
    colour = np.array(colours[rng.integers(len(colours))]) + rng.integers(-25, 26, size=3)
    turn = rng.uniform(0, 2 * math.pi)
    for i in range(petals):
        angle = turn + 2 * math.pi * i / petals + rng.normal(0, 0.08)
        px, py = x + math.cos(angle) * r * (1 - length / 2), y + math.sin(angle) * r * (1 - length / 2)
        half_l, half_b = r * length / 2, r * breadth
        # a quadrilateral along its angle, softened later by the blur
        ca, sa = math.cos(angle), math.sin(angle)
        points = [
            (px - ca * half_l, py - sa * half_l),
            (px - sa * half_b, py + ca * half_b),
            (px + ca * half_l, py + sa * half_l),
            (px + sa * half_b, py - ca * half_b),
        ]
        shade = np.clip(colour + rng.integers(-20, 21, size=3), 0, 255)
        draw.polygon(points, fill=tuple(int(c) for c in shade))
    core = r * (0.35 if kind in ("sunflowers", "daisy") else 0.2)
    draw.ellipse((x - core, y - core, x + core, y + core), fill=tuple(int(c) for c in centre))


def make_image(task: tuple) -> int:
    """Draw one JPEG of `task` (folder, kind, class number, index, seed); returns its size in bytes."""
    folder, kind, class_number, index, seed = task
    rng = np.random.default_rng([seed, class_number, index])
    width, height = image_size(rng)
    image = Image.fromarray(np.clip(background(rng, width, height), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(1, 6))):  # a few flowers, the larger ones nearer the front
        r = rng.uniform(0.12, 0.35) * min(width, height)
        draw_flower(draw, rng, kind, rng.uniform(0, width), rng.uniform(0, height), r)
    image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.8)))
    grain = rng.normal(0.0, rng.uniform(3.0, 8.0), size=(height, width, 1)).astype(np.float32)
    pixels = np.clip(np.asarray(image, dtype=np.float32) + grain, 0, 255).astype(np.uint8)
    path = Path(folder) / kind / f"{kind}_{index:04d}.jpg"
    Image.fromarray(pixels).save(path, quality=int(rng.integers(80, 96)))
    return path.stat().st_size


def counts(scale: float) -> dict[str, int]:
    return {kind: max(1, round(n * scale)) for kind, n in CLASSES.items()}


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the folder to create (left as it is if it exists)")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same images")
    p.add_argument("--scale", type=positive_float, default=1.0, help="fraction of flower_photos' counts per class")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes drawing images")
    args = p.parse_args(argv)

    root = args.root
    if root.exists():
        print(f"{root} exists: left as it is")
        return 0
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.tmp-"))
    try:
        per_class = counts(args.scale)
        tasks = []
        for class_number, (kind, n) in enumerate(per_class.items()):
            (staging / kind).mkdir()
            tasks += [(str(staging), kind, class_number, i, args.seed) for i in range(n)]
        start = time.perf_counter()
        workers = max(1, min(args.workers, len(tasks)))
        with multiprocessing.Pool(workers) as pool:
            sizes = list(pool.imap_unordered(make_image, tasks, chunksize=8))
        seconds = time.perf_counter() - start
        try:
            os.rename(staging, root)
        except OSError:
            if root.exists():  # another process made it meanwhile: keep theirs
                print(f"{root} appeared while drawing: left as it is")
                return 0
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(
        f"Wrote {len(sizes)} JPEGs ({', '.join(f'{k} {n}' for k, n in per_class.items())}) to {root}: "
        f"{sum(sizes) / 2**20:.1f} MiB, {sum(sizes) / len(sizes) / 1024:.0f} KiB on average, "
        f"{seconds:.1f} s with {workers} processes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
