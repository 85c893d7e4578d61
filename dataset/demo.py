"""Offline demo data: a small flower_photos-shaped folder of drawn flowers, so that everything runs without a download.

Colour alone does not tell the five classes apart (daisies and roses can both be white, tulips take any colour): a
network has to learn shapes too. Each image is drawn from a generator seeded by (seed, class, image number).
"""

import contextlib
import math
import os
import random
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock
from PIL import Image, ImageDraw, ImageFilter

DEMO_DATA_PATH = Path(__file__).resolve().parents[1] / "data" / "demo_flower_photos"
DEMO_CLASSES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")


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
        draw.polygon(
            [(px - dx, py - dy), (px + nx, py + ny), (px + dx, py + dy), (px - nx, py - ny)],
            fill=_jitter(rng, colour, 20),
        )


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
            draw.line(
                [(cx, cy), (cx + math.cos(angle) * length, cy + math.sin(angle) * length)],
                fill=_jitter(rng, colour, 25),
                width=1,
            )
    elif kind == "roses":  # concentric rings of rounded petals, no visible centre
        colour = rng.choice([(200, 30, 50), (235, 120, 160), (245, 240, 235), (220, 60, 90)])
        for ring in range(4):
            rr = r * (1.0 - ring * 0.22)
            draw.ellipse(
                [cx - rr, cy - rr, cx + rr, cy + rr],
                fill=_jitter(rng, colour, 25),
                outline=_jitter(rng, tuple(int(c * 0.6) for c in colour), 10),
            )
    elif kind == "sunflowers":  # a few broad yellow petals around a large dark centre
        colour = rng.choice([(250, 200, 20), (245, 170, 30), (250, 215, 60)])
        _petal_ring(draw, rng, cx, cy, rng.randint(9, 13), r, r * 0.2, colour)
        c = r * 0.45
        draw.ellipse([cx - c, cy - c, cx + c, cy + c], fill=_jitter(rng, (90, 55, 20), 20))
    else:  # tulips: a closed cup of three tall petals on a stem, any colour
        colour = rng.choice([(210, 40, 50), (240, 130, 170), (250, 210, 40), (150, 60, 160), (245, 245, 240)])
        draw.line(
            [(cx, cy + r * 0.3), (cx, cy + r * 1.6)], fill=_jitter(rng, (40, 120, 40)), width=max(2, int(r * 0.12))
        )
        for dx in (-0.35, 0.35, 0.0):
            x = cx + dx * r
            draw.ellipse([x - r * 0.35, cy - r * 0.8, x + r * 0.35, cy + r * 0.5], fill=_jitter(rng, colour, 20))


def _demo_image(kind: str, rng: random.Random, width: int, height: int) -> Image.Image:
    image = _draw_background(rng, width, height)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        r = rng.uniform(0.22, 0.42) * min(width, height)
        _draw_flower(draw, rng, kind, rng.uniform(r * 0.6, width - r * 0.6), rng.uniform(r * 0.6, height - r * 0.6), r)
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.8)))


def make_demo_data(root=DEMO_DATA_PATH, images_per_class: int = 150, size=(96, 72), seed: int = 0) -> Path:
    """Create the folder of JPEGs once (later calls find it); safe from several processes at once (a file lock),
    and a crash leaves no half-made folder (written to a temporary folder, renamed when complete)."""
    root = Path(root)
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(root.parent / f".{root.name}.lock"):  # filelock: flock on Linux and macOS, msvcrt on Windows
        if root.is_dir():  # another process made it while we waited
            return root
        staging = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
        try:
            for kind in DEMO_CLASSES:
                (staging / kind).mkdir()
                for i in range(images_per_class):
                    rng = random.Random(f"{seed}:{kind}:{i}")
                    _demo_image(kind, rng, *size).save(staging / kind / f"{kind}_{i:04d}.jpg", quality=90)
            os.rename(staging, root)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(staging)
    return root
