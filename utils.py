"""Reading and splitting a class-per-folder image dataset, offline demo data, and small helpers.

A dataset here is a folder with one sub-folder per class (the layout of flower_photos):

    flower_photos/daisy/1234.jpg, flower_photos/roses/5678.jpg, ...
"""

import argparse
import contextlib
import fcntl
import functools
import json
import math
import os
import pickle
import random
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
DEMO_DATA_PATH = Path(__file__).resolve().parent / "data" / "demo_flower_photos"


class UserError(Exception):
    """A problem with the user's input: shown as one line on stderr, exit status 2, never a traceback."""


def entry_point(function):
    """Decorate a script's main (or a spawned worker): a UserError becomes one line on stderr and exit status 2,
    Ctrl-C a short note and status 130. Bugs stay tracebacks."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted: the last checkpoint (if any) is intact; --resume continues from it", file=sys.stderr)
            sys.exit(130)

    return wrapper


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default where it has one worth showing (not None, not an off switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with errors in one line, like every other user error here."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


def number(kind, minimum, maximum=None, above_minimum=False):
    """An argparse type: a number of `kind` within [minimum, maximum] (or above minimum)."""

    def parse(text):
        value = kind(text)
        if value < minimum or (above_minimum and value == minimum) or (maximum is not None and value > maximum):
            bound = f"greater than {minimum}" if above_minimum else f"at least {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and at most {maximum}" if maximum else ""))
        return value

    return parse


positive_int, positive_float = number(int, 1), number(float, 0, above_minimum=True)


def describe(paths: list[str], shown: int = 5) -> str:
    return ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def safe_load(path, what: str):
    """torch.load(weights_only=True) of a file the user named, with any failure as a UserError.

    weights_only=True unpickles tensors and plain containers only: a file whose pickle would run code is refused
    before any of it runs.
    """
    import torch  # here, so that the data helpers above do not need torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).split("WeightsUnpickler error:")[-1].strip().split(". ")[0].split("\n")[0]
        raise UserError(f"{what} {path} was refused by the safe loader (weights_only=True): {reason}") from None
    except Exception as error:  # torch.load raises many types for a file that is not a (whole) torch file
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise UserError(
            f"{what} {path} cannot be read as a PyTorch file ({type(error).__name__}: {first_line})"
        ) from None


@dataclass
class DataSplit:
    train_images: list[str]
    train_labels: list[int]
    val_images: list[str]
    val_labels: list[int]
    classes: list[str]
    unreadable: list[str] = field(default_factory=list)  # left out of both sets (with verify_images=True)


def list_images(folder: Path) -> list[Path]:
    """Image files directly inside `folder`, extension matched case-insensitively, sorted by name."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )


def image_problem(path) -> str | None:
    """Why PIL cannot decode this file (truncated, not an image, ...), or None if it can."""
    try:
        with Image.open(path) as image:
            image.draft("RGB", (32, 32))  # JPEGs decode at reduced scale: fast, and still reads every byte
            image.load()
    except Exception as error:  # PIL raises many types for bad files; each means "unusable image"
        return f"{type(error).__name__}: {error}"
    return None


def read_split_data(root, val_rate: float = 0.2, seed: int = 0, output_dir=None, verify_images=False) -> DataSplit:
    """Split a class-per-folder dataset into training and validation lists.

    Classes are the sorted sub-folder names. Each class is split on its own (so every class is in both sets),
    from its sorted file list shuffled by a generator seeded with (seed, class name): the split is the same on
    every rank, every run and every filesystem. With `verify_images`, every image is decoded once and those
    that cannot be are left out (listed in .unreadable). With `output_dir`, class_indices.json is written there.
    """
    root = Path(root)
    if not root.exists():
        raise UserError(f"data path {root} does not exist")
    if not root.is_dir():
        raise UserError(f"data path {root} is a file, not a folder with one sub-folder per class")
    if not 0.0 < val_rate < 1.0:
        raise UserError(f"validation rate must be between 0 and 1, got {val_rate}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise UserError(f"data path {root} has no class sub-folders (expected e.g. {root}/daisy/*.jpg)")

    split = DataSplit([], [], [], [], classes)
    for label, name in enumerate(classes):
        images = list_images(root / name)
        if verify_images:
            bad = [path for path in images if image_problem(path) is not None]
            split.unreadable += map(str, bad)
            images = [path for path in images if path not in bad]
        if not images:
            raise UserError(f"class folder {root / name} holds no readable images ({' '.join(IMAGE_EXTENSIONS)})")
        if len(images) < 2:
            raise UserError(f"class folder {root / name} has {len(images)} image; at least 2 are needed to split it")
        random.Random(f"{seed}:{name}").shuffle(images)
        num_val = min(max(1, round(len(images) * val_rate)), len(images) - 1)
        for i, path in enumerate(images):
            images_out, labels_out = (
                (split.val_images, split.val_labels) if i < num_val else (split.train_images, split.train_labels)
            )
            images_out.append(str(path))
            labels_out.append(label)

    if output_dir is not None:
        write_class_indices(classes, output_dir)
    return split


def write_class_indices(classes: list[str], output_dir) -> None:
    """class_indices.json: {"0": "daisy", "1": "dandelion", ...}, how predictions map back to names."""
    write_json(Path(output_dir) / "class_indices.json", {str(i): name for i, name in enumerate(classes)})


def write_atomically(path, write, binary: bool = False) -> None:
    """Create or replace `path` with what write(file) writes, so that readers and crashes see either the old
    file or the whole new one: a temporary file in the same folder, fsync, rename, fsync of the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # make the rename itself durable
    finally:
        os.close(folder)


def write_json(path, data) -> None:
    write_atomically(path, lambda f: f.write(json.dumps(data, indent=2) + "\n"))


def plain_args(args) -> dict:
    """The flags of a run as JSON-able plain data (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# --- Offline demo data -------------------------------------------------------------------------------------------
# Five classes of drawn "flowers" on cluttered backgrounds. Colour alone does not tell them apart (daisies and
# roses can both be white, dandelions and sunflowers are both yellow, tulips take any of those colours): a network
# has to learn shapes (petal count and form, centre size) too. Everything is drawn from a generator seeded by
# (seed, class, image number), so the same call always gives the same files.

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


def _petal_ring(draw, rng, cx, cy, count, length, width, colour, start=None):
    start = rng.uniform(0, 2 * math.pi) if start is None else start
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
    """Create a small flower_photos-shaped folder of JPEGs once; later calls find it and return at once.

    Safe to call from several processes at the same time (a file lock), and a crash while writing leaves no
    half-made folder behind (the images are written to a temporary folder that is renamed when complete).
    """
    root = Path(root)
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
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
