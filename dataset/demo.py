"""Drawn flowers in flower_photos' layout, so that everything runs without a download; photo-like ones for benchmarks.

python -m dataset.demo FOLDER [SCALE]   # photo-like JPEGs, flower_photos' counts times SCALE (1), every core
"""

import math
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from filelock import FileLock
from PIL import Image, ImageDraw, ImageFilter

from utils import writing

DEMO_DATA_PATH = Path(__file__).resolve().parents[1] / "data" / "demo_flower_photos"
FLOWER_PHOTOS = {"daisy": 633, "dandelion": 898, "roses": 641, "sunflowers": 699, "tulips": 799}  # images a class


def _jitter(rng: random.Random, rgb, amount: int = 30):
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)


def _draw_background(rng: random.Random, width: int, height: int) -> Image.Image:
    top = _jitter(rng, rng.choice([(70, 120, 60), (110, 150, 190), (90, 80, 60), (60, 90, 50)]), 40)
    bottom = _jitter(rng, rng.choice([(40, 80, 30), (120, 100, 70), (50, 110, 50)]), 40)
    image = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(image)
    for y in range(height):
        t = y / max(1, height - 1)
        draw.line([(0, y), (width, y)], fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom, strict=True)))
    for _ in range(rng.randint(3, 8)):  # leaves and stems as clutter
        x, y = rng.uniform(0, width), rng.uniform(0, height)
        w, h = rng.uniform(4, width / 4), rng.uniform(2, height / 8)
        draw.ellipse([x - w, y - h, x + w, y + h], fill=_jitter(rng, (50, 120, 40), 35))
    return image


def _petal_ring(draw, rng, cx, cy, count, length, width, colour):
    start = rng.uniform(0, 2 * math.pi)
    for k in range(count):
        angle = start + 2 * math.pi * k / count
        px, py = cx + math.cos(angle) * length * 0.6, cy + math.sin(angle) * length * 0.6
        dx, dy = math.cos(angle) * length * 0.5, math.sin(angle) * length * 0.5
        nx, ny = -math.sin(angle) * width, math.cos(angle) * width
        points = [(px - dx, py - dy), (px + nx, py + ny), (px + dx, py + dy), (px - nx, py - ny)]
        draw.polygon(points, fill=_jitter(rng, colour, 20))


def _draw_flower(draw, rng, kind, cx, cy, r):
    if kind == "daisy":  # many thin pale petals, small yellow centre
        colour = rng.choice([(245, 245, 245), (240, 225, 240), (250, 250, 215)])
        _petal_ring(draw, rng, cx, cy, rng.randint(14, 20), r, r * 0.09, colour)
        c = r * 0.22
        draw.ellipse([cx - c, cy - c, cx + c, cy + c], fill=_jitter(rng, (235, 190, 40)))
    elif kind == "dandelion":  # a spiky pom-pom of thin lines, no separate centre
        colour = rng.choice([(250, 215, 30), (245, 235, 200), (240, 200, 60)])
        for _ in range(rng.randint(40, 60)):
            angle, length = rng.uniform(0, 2 * math.pi), r * rng.uniform(0.5, 1.0)
            end = (cx + math.cos(angle) * length, cy + math.sin(angle) * length)
            draw.line([(cx, cy), end], fill=_jitter(rng, colour, 25), width=1)
    elif kind == "roses":  # concentric rings of rounded petals, no visible centre
        colour = rng.choice([(200, 30, 50), (235, 120, 160), (245, 240, 235), (220, 60, 90)])
        for ring in range(4):
            rr = r * (1.0 - ring * 0.22)
            fill, outline = _jitter(rng, colour, 25), _jitter(rng, tuple(int(c * 0.6) for c in colour), 10)
            draw.ellipse([cx - rr, cy - rr, cx + rr, cy + rr], fill=fill, outline=outline)
    elif kind == "sunflowers":  # a few broad yellow petals around a large dark centre
        colour = rng.choice([(250, 200, 20), (245, 170, 30), (250, 215, 60)])
        _petal_ring(draw, rng, cx, cy, rng.randint(9, 13), r, r * 0.2, colour)
        c = r * 0.45
        draw.ellipse([cx - c, cy - c, cx + c, cy + c], fill=_jitter(rng, (90, 55, 20), 20))
    else:  # tulips: a closed cup of three tall petals on a stem, any colour
        colour = rng.choice([(210, 40, 50), (240, 130, 170), (250, 210, 40), (150, 60, 160), (245, 245, 240)])
        stem = max(2, int(r * 0.12))
        draw.line([(cx, cy + r * 0.3), (cx, cy + r * 1.6)], fill=_jitter(rng, (40, 120, 40)), width=stem)
        for dx in (-0.35, 0.35, 0.0):
            x = cx + dx * r
            draw.ellipse([x - r * 0.35, cy - r * 0.8, x + r * 0.35, cy + r * 0.5], fill=_jitter(rng, colour, 20))


def _write_image(task: tuple) -> None:
    """Image `i` of class `kind`, drawn from a generator seeded by (seed, class, i), into `folder`/`kind`/."""
    folder, kind, i, seed, size, photo_like = task
    rng = random.Random(f"{seed}:{kind}:{i}")
    width, height = (rng.randint(320, 500), rng.randint(240, 375)) if photo_like else size  # flower_photos' sizes
    image = _draw_background(rng, width, height)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        r = rng.uniform(0.22, 0.42) * min(width, height)
        _draw_flower(draw, rng, kind, rng.uniform(r * 0.6, width - r * 0.6), rng.uniform(r * 0.6, height - r * 0.6), r)
    image, quality = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.8))), 90
    if photo_like:  # blurred and grained as photos are, so that decoding them costs what photos cost
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.8)))
        grain = np.random.default_rng(rng.getrandbits(64)).normal(0.0, rng.uniform(3.0, 8.0), (height, width, 1))
        image = Image.fromarray(np.clip(np.asarray(image) + grain, 0, 255).astype(np.uint8))
        quality = rng.randint(80, 95)
    image.save(Path(folder) / kind / f"{kind}_{i:04d}.jpg", quality=quality)


def make_demo_data(
    root=DEMO_DATA_PATH, images_per_class=150, size=(96, 72), seed: int = 0, photo_like: bool = False, workers: int = 1
) -> Path:
    """The folder of JPEGs (`images_per_class`: a number or {class: number}), made once by `workers` processes,
    whole or not at all, safe from several processes at once; `photo_like`: flower_photos' sizes, blur and grain."""
    root = Path(root)
    counts = dict.fromkeys(FLOWER_PHOTOS, images_per_class) if isinstance(images_per_class, int) else images_per_class
    if root.is_dir():
        return root
    with writing(root):  # a data folder that cannot be written: one line
        root.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(root.parent / f".{root.name}.lock"):
            if root.is_dir():  # another process made it while we waited
                return root
            staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
            try:
                for kind in counts:
                    (staging / kind).mkdir()
                tasks = [(staging, kind, i, seed, size, photo_like) for kind, n in counts.items() for i in range(n)]
                if workers > 1:
                    with multiprocessing.Pool(workers) as pool:
                        pool.map(_write_image, tasks, chunksize=16)
                else:
                    for task in tasks:
                        _write_image(task)
                os.rename(staging, root)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return root


if __name__ == "__main__":  # flower_photos' stand-in
    start, scale = time.perf_counter(), float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    counts = {kind: max(1, round(n * scale)) for kind, n in FLOWER_PHOTOS.items()}
    folder = make_demo_data(sys.argv[1], counts, photo_like=True, workers=os.cpu_count() or 1)
    print(f"{folder}: {sum(1 for _ in folder.rglob('*.jpg'))} JPEGs, {time.perf_counter() - start:.1f} s")
