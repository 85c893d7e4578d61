"""The data: a dataset read into training and validation lists, the dataset over those lists, its transform
presets, and per-sample seeding of augmentation.

A dataset here is a folder with one sub-folder per class (the layout of flower_photos), split at random:

    flower_photos/daisy/1234.jpg, flower_photos/roses/5678.jpg, ...

or a folder of train/ and val/ alone, each with one sub-folder per class (ImageNet's layout), used as given:

    flowers/train/daisy/1234.jpg, flowers/val/daisy/5678.jpg, ...
"""

import hashlib
import itertools
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps
from torch.utils.data import Dataset, Sampler
from torchvision.transforms import v2

from plumbing.machine import cores_per_process, physical_memory
from utils import UserError, write_json

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MEAN_PIXEL = [round(255 * mean) for mean in IMAGENET_MEAN]  # the mean colour in 8 bits: what erasing fills with
# Validation resizes to img_size * 256/224 (256 for 224) and takes the centre img_size, as for ImageNet.
RESIZE_RATIO = 256 / 224
AUTO_AUGMENT = {"trivialaugment": v2.TrivialAugmentWide, "randaugment": v2.RandAugment}  # --auto-augment's choices


@dataclass
class DataSplit:
    train_images: list[str]
    train_labels: list[int]
    val_images: list[str]
    val_labels: list[int]
    classes: list[str]
    unreadable: list[str] = field(default_factory=list)  # left out of both sets (with verify_images=True)
    given: bool = False  # True: the data folder's own train/ and val/, not a random split by val_rate and seed


def split_fingerprint(split: DataSplit, root) -> dict:
    """What tells one split from another, for a run's record: per set, its image count and a sha256 over its
    images' paths relative to `root` (a moved data folder is the same data) with their labels, sorted (the order
    the files were listed in does not matter)."""

    def digest(images: list[str], labels: list[int]) -> str:
        pairs = zip(relative_posix(images, root), labels, strict=True)
        lines = sorted(f"{image}\t{label}\n" for image, label in pairs)
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    return {
        "train_images": len(split.train_images),
        "train_sha256": digest(split.train_images, split.train_labels),
        "val_images": len(split.val_images),
        "val_sha256": digest(split.val_images, split.val_labels),
    }


def relative_posix(paths, root) -> list[str]:
    """Each of `paths` relative to `root`, with / between its parts on every system ("daisy/1234.jpg"). Paths
    that start with `root` as read_split_data writes them are cut as strings: a Path object per image costs about
    10 us, a second at 100,000 images."""
    prefix = os.path.join(str(root), "")
    return [
        path[len(prefix) :].replace(os.sep, "/") if path.startswith(prefix) else Path(path).relative_to(root).as_posix()
        for path in map(str, paths)
    ]


def image_names(folder) -> list[str]:
    """The names of the image files directly inside `folder`, extension matched case-insensitively, sorted
    (ignoring case where the system does, as Path's own order does).

    os.scandir tells files from folders without a stat call per file on most filesystems: listing and splitting
    100,000 images with Path.iterdir and is_file took 2.1 s, with this and strings 0.2 s (AMD EPYC, 2 cores)."""
    with os.scandir(folder) as entries:
        names = [
            entry.name
            for entry in entries
            if not entry.name.startswith(".") and entry.name.lower().endswith(IMAGE_EXTENSIONS) and entry.is_file()
        ]
    return sorted(names, key=os.path.normcase)


def list_images(folder: Path) -> list[Path]:
    """The image files directly inside `folder` (image_names), as paths."""
    return [folder / name for name in image_names(folder)]


def paths_in(folder) -> list[str]:
    """The image files directly inside `folder` (image_names), as strings: str(folder / name), at a tenth of
    the cost."""
    prefix = os.path.join(folder, "")
    return [prefix + name for name in image_names(folder)]


def image_problem(path) -> str | None:
    """Why PIL cannot decode this file (truncated, not an image, ...), or None if it can."""
    try:
        with Image.open(path) as image:
            image.draft("RGB", (32, 32))  # JPEGs decode at reduced scale: fast, and still reads every byte
            image.load()
    except Exception as error:  # PIL raises many types for bad files; each means "unusable image"
        return f"{type(error).__name__}: {error}"
    return None


def unreadable_images(images: list[str]) -> list[str]:
    """Those of `images` that PIL cannot decode (image_problem), each decoded once."""
    return [path for path in images if image_problem(path) is not None]


def read_split_data(root, val_rate: float = 0.2, seed: int = 0, output_dir=None, verify_images=False) -> DataSplit:
    """The training and validation lists of a dataset in either layout (see given_split_folders for the rule
    that tells them apart): a class-per-folder dataset is split at random, a folder of train/ and val/ is used as
    it is. Training, evaluate.py and predict.py all call this, so all of them see the same split.

    With `verify_images`, the images that cannot be decoded are left out (listed in .unreadable): True decodes
    every image (unreadable_images); a function does the same job its own way, given every listed image at once
    and returning the unreadable ones (the training scripts pass plumbing/image_check.py's ImageCheck, which
    remembers its verdicts from one start of a run to the next).
    With `output_dir`, class_indices.json is written there.
    """
    root = Path(root)
    if not root.exists():
        raise UserError(f"data path {root} does not exist")
    if not root.is_dir():
        raise UserError(f"data path {root} is a file, not a folder with one sub-folder per class")
    if not 0.0 < val_rate < 1.0:
        raise UserError(f"validation rate must be between 0 and 1, got {val_rate}")
    check = unreadable_images if verify_images is True else verify_images or None
    if given_split_folders(root):
        split = given_split(root, check)
    else:
        split = random_split(root, val_rate, seed, check)
    if output_dir is not None:
        write_class_indices(split.classes, output_dir)
    return split


def sub_folders(folder: Path) -> list[str]:
    """The sorted names of the sub-folders of `folder`, hidden ones (.git, .ipynb_checkpoints) left out."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def given_split_folders(root: Path) -> bool:
    """Whether `root` holds a split made in advance: its sub-folders are exactly `train` and `val` (loose files
    beside them are ignored, as they are beside class folders).

    A root with `train/` and `val/` and other sub-folders too (a `test/`, say) is refused rather than guessed at.
    A root with only one of the two is read as class-per-folder: `train` can be a class (of vehicles, say). The
    one layout this cannot tell apart is a class-per-folder dataset whose only classes are named train and val;
    its images lie directly in train/ and val/, which given_split then refuses, naming the rule.
    """
    names = sub_folders(root)
    if not {"train", "val"} <= set(names):
        return False
    if names != ["train", "val"]:
        others = ", ".join(name for name in names if name not in ("train", "val"))
        raise UserError(
            f"data path {root} holds train/ and val/ beside other folders ({others}): a split given in advance "
            "is a folder of train/ and val/ alone, each with one sub-folder per class"
        )
    return True


def given_split(root: Path, check) -> DataSplit:
    """train/ and val/ as they are, each a class-per-folder set: no image moves from one to the other, whatever
    the validation rate or seed. Both must have the same classes, and every class images in both."""
    classes = {part: sub_folders(root / part) for part in ("train", "val")}
    for part, names in classes.items():
        if not names:
            raise UserError(
                f"{root / part} has no class sub-folders: a data folder of train/ and val/ alone is read as a "
                f"split given in advance, each with one sub-folder per class (e.g. {root / part}/daisy/*.jpg)"
            )
    if classes["train"] != classes["val"]:
        train, val = set(classes["train"]), set(classes["val"])
        only = {"train": train - val, "val": val - train}
        raise UserError(
            f"train/ and val/ of {root} have different classes: "
            + "; ".join(f"only in {part}/: {', '.join(sorted(names))}" for part, names in only.items() if names)
        )
    split = DataSplit([], [], [], [], classes["train"], given=True)
    folders = [root / part / name for name in split.classes for part in ("train", "val")]
    found = iter(class_images(folders, check, split.unreadable))
    for label in range(len(split.classes)):
        for images_out, labels_out in ((split.train_images, split.train_labels), (split.val_images, split.val_labels)):
            images = next(found)
            images_out += images
            labels_out += [label] * len(images)
    return split


def random_split(root: Path, val_rate: float, seed: int, check) -> DataSplit:
    """Classes are the sorted sub-folder names. Each class is split on its own (so every class is in both sets),
    from its sorted file list shuffled by a generator seeded with (seed, class name): the split is the same on
    every rank, every run and every filesystem."""
    classes = sub_folders(root)
    if not classes:
        raise UserError(f"data path {root} has no class sub-folders (expected e.g. {root}/daisy/*.jpg)")
    split = DataSplit([], [], [], [], classes)
    found = class_images([root / name for name in classes], check, split.unreadable)
    for label, (name, images) in enumerate(zip(classes, found, strict=True)):
        if len(images) < 2:
            raise UserError(f"class folder {root / name} has {len(images)} image; at least 2 are needed to split it")
        random.Random(f"{seed}:{name}").shuffle(images)
        num_val = min(max(1, round(len(images) * val_rate)), len(images) - 1)
        for i, path in enumerate(images):
            images_out, labels_out = (
                (split.val_images, split.val_labels) if i < num_val else (split.train_images, split.train_labels)
            )
            images_out.append(path)
            labels_out.append(label)
    return split


def class_images(folders: list[Path], check, unreadable: list[str]) -> list[list[str]]:
    """The paths of the images of each class folder. With `check` (read_split_data's verify_images function),
    run once over all of them, those it finds unreadable are left out and added to `unreadable`. A class folder
    without a readable image is an error, in a training set and a validation set alike: a class never validated
    would score an undefined recall, one never trained could not be learned.

    Paths are strings here, as the split keeps them: Path objects would cost seconds at 100,000 images."""
    found = [paths_in(folder) for folder in folders]
    if check is not None:
        bad = set(check([path for images in found for path in images]))
        unreadable += [path for images in found for path in images if path in bad]
        found = [[path for path in images if path not in bad] for images in found]
    for folder, images in zip(folders, found, strict=True):
        if not images:
            raise UserError(f"class folder {folder} holds no readable images ({' '.join(IMAGE_EXTENSIONS)})")
    return found


def write_class_indices(classes: list[str], output_dir) -> None:
    """class_indices.json: {"0": "daisy", "1": "dandelion", ...}, how predictions map back to names."""
    write_json(Path(output_dir) / "class_indices.json", {str(i): name for i, name in enumerate(classes)})


class Preset(v2.Compose):
    """A transform, and the shortest image side it needs for its output to keep full resolution (`min_side`):
    MyDataSet decodes large JPEGs at reduced scale down to that side, see load_rgb."""

    def __init__(self, transforms: list, min_side: int):
        super().__init__(transforms)
        self.min_side = min_side


def train_transform(img_size: int, auto_augment: str = "none", random_erase: float = 0.0) -> Preset:
    """Random crop and flip, as for ImageNet training; then, if asked, TrivialAugmentWide or RandAugment (one or
    two random changes of colour, contrast, geometry ... per image), and random erasing of a rectangle.

    The image stays 8-bit throughout: cropping, resizing and flipping 8-bit pixels is cheaper than on PIL images
    or floats (measured 1.33 against 1.63 ms an image at 224 px), and the crop travels to the device in a quarter
    of float32's bytes, to be normalised there (normalise, called by Compute.batch_to). Erasing fills with the
    mean colour (MEAN_PIXEL), about 0 once normalised.
    """
    crop = v2.RandomResizedCrop(img_size, antialias=True)
    # The smallest crop RandomResizedCrop takes (its smallest area fraction, at its most elongated aspect) spans
    # sqrt(scale * aspect) of the image's shorter side, and should still hold img_size pixels.
    narrowest = min(crop.ratio[0], 1 / crop.ratio[1])
    min_side = math.ceil(img_size / math.sqrt(crop.scale[0] * narrowest))
    augment = [AUTO_AUGMENT[auto_augment]()] if auto_augment != "none" else []
    erase = [v2.RandomErasing(random_erase, value=MEAN_PIXEL)] if random_erase > 0 else []
    steps = [v2.ToImage(), crop, v2.RandomHorizontalFlip(), *augment, *erase]
    return Preset(steps, min_side)


def val_transform(img_size: int) -> Preset:
    """Resize to img_size * RESIZE_RATIO and take the centre img_size, as for ImageNet validation (8-bit, as
    train_transform's)."""
    resize = round(img_size * RESIZE_RATIO)
    return Preset([v2.ToImage(), v2.Resize(resize, antialias=True), v2.CenterCrop(img_size)], resize)


def normalise(images: torch.Tensor) -> torch.Tensor:
    """Images as the network takes them (one, or a batch; on any device): 8-bit ones, as the transforms above
    leave them, become float32 from 0 to 1, less the ImageNet mean, over its standard deviation; any other type
    is taken to be the network's input already (normalised by an earlier call) and returned as it is."""
    if images.dtype != torch.uint8:
        return images
    pixels = v2.functional.to_dtype(images, torch.float32, scale=True)
    return v2.functional.normalize(pixels, IMAGENET_MEAN, IMAGENET_STD)


def load_rgb(path, min_side: int | None = None) -> Image.Image:
    """Open any image PIL reads as 8-bit RGB: grey, palette, alpha, CMYK and 16-bit or float images included.

    With `min_side`, a JPEG much larger than needed is decoded at 1/2, 1/4 or 1/8 scale (JPEG's own cheap
    reduced decoding), keeping its shorter side at least `min_side`: a 4000x3000 phone photo validated at
    224 px decodes 64 times fewer pixels. Smaller images, and other formats, are decoded in full.
    """
    with Image.open(path) as image:
        draft(image, min_side)
        image = ImageOps.exif_transpose(image)  # phone photos are often stored sideways with a rotation tag
        if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
            # 16-bit and float pixels: scale to 0..255 instead of clipping everything above 255 to white.
            pixels = np.asarray(image, dtype=np.float64)
            peak = 65535.0 if image.mode != "F" or pixels.max() > 255 else 255.0
            image = Image.fromarray(np.clip(np.rint(pixels * (255.0 / peak)), 0, 255).astype(np.uint8), mode="L")
        elif "A" in image.mode or "transparency" in image.info:
            image = image.convert("RGBA")
        return image.convert("RGB")


def draft(image: Image.Image, min_side: int | None) -> None:
    """Have PIL decode a JPEG opened as `image` at 1/2, 1/4 or 1/8 scale where its shorter side stays at least
    `min_side` (load_rgb). The image's size says the reduced size at once, before anything is decoded."""
    if min_side is not None and min(image.size) > 2 * min_side:
        scale = min_side / min(image.size)
        image.draft("RGB", (math.ceil(image.width * scale), math.ceil(image.height * scale)))


def decoded_size(path, min_side: int | None = None) -> tuple[int, int] | None:
    """(height, width) of load_rgb(path, min_side)'s image, from the file's header alone (nothing is decoded):
    the reduced JPEG scale, and the sides swapped by an EXIF rotation of a quarter turn. None if PIL cannot
    open the file."""
    try:
        with Image.open(path) as image:
            draft(image, min_side)
            width, height = image.size
            quarter_turn = image.getexif().get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)
    except Exception:  # PIL raises many types for a file that is not an image
        return None
    return (width, height) if quarter_turn else (height, width)


# The label of an image that could not be read during a run (deleted or broken after the start-up check): the
# loss ignores it (nn.CrossEntropyLoss's ignore_index), evaluation leaves it out of its counts.
SKIPPED = -100


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


class DecodedImages:
    """The images of a MyDataSet decoded once, as load_rgb decodes them, and kept as 8-bit pixels in one tensor:
    image i is `shapes[i]` (height, width) x 3 bytes from `pixels[offsets[i]]`, given out as the 3 x height x
    width tensor v2.ToImage makes of load_rgb's image, so every transform computes exactly what it would on the
    file's image. An offset of -1: the image was not decoded (its file could not be), and is read from its file.

    Loader workers share the tensor, not copies of it: those started by fork (Linux) inherit it, those started by
    spawn (Windows, macOS) receive it in shared memory, as torch hands tensors to other processes."""

    def __init__(self, pixels: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor):
        self.pixels, self.offsets, self.shapes = pixels, offsets, shapes

    def __getitem__(self, index: int) -> torch.Tensor | None:
        offset = int(self.offsets[index])
        if offset < 0:
            return None
        height, width = self.shapes[index].tolist()
        return self.pixels[offset : offset + height * width * 3].view(height, width, 3).permute(2, 0, 1)


def decode_once(sets: list[MyDataSet], gigabytes: float | None, processes_here: int = 1) -> str:
    """Decode every image of `sets` once into memory (DecodedImages), if all of them fit in `gigabytes` (None: a
    quarter of this machine's memory, shared among its `processes_here` training processes, each of which holds
    its own; 0: none), so that an epoch only crops and flips them. Returns the line saying what it did.

    The sizes come first, from the files' headers (decoded_size), to know whether they fit before decoding any.
    This process's share of the cores decode them, in threads (PIL decodes without holding the GIL), a chunk of
    images to a task (in_chunks)."""
    memory = physical_memory() if gigabytes is None else None
    if gigabytes is None and memory is None:
        return "Images: decoded from their files every epoch: this system does not say its memory (--image-cache-gb)"
    budget = memory / 4 / processes_here if gigabytes is None else gigabytes * 1e9
    if not budget:
        return "Images: decoded from their files every epoch (--image-cache-gb 0)"
    start, threads = time.perf_counter(), cores_per_process(processes_here)
    with ThreadPoolExecutor(threads) as pool:
        # Each set's (height, width) per image; (0, 0) for a file PIL cannot open, which is not decoded
        shapes = [
            torch.tensor(
                [
                    size or (0, 0)
                    for size in in_chunks(pool, partial(decoded_size, min_side=data.min_side), data.images_path)
                ],
                dtype=torch.int64,
            ).reshape(-1, 2)
            for data in sets
        ]
        needed = sum(3 * int(table.prod(dim=1).sum()) for table in shapes)
        if needed > budget:
            return (
                f"Images: decoded from their files every epoch: decoded, they would take {needed / 1e9:.1f} GB, "
                f"more than the {budget / 1e9:.1f} GB of --image-cache-gb"
            )
        for data, table in zip(sets, shapes, strict=True):
            data.decoded = decoded_images(data, table, pool)
    images = sum(int((data.decoded.offsets >= 0).sum()) for data in sets)
    return (
        f"Images: {images} decoded once into memory ({needed / 1e9:.2f} GB, {time.perf_counter() - start:.1f} s, "
        f"{threads} threads): every epoch crops and flips them there"
    )


def decoded_images(data: MyDataSet, shapes: torch.Tensor, pool: ThreadPoolExecutor) -> DecodedImages:
    """`data`'s images decoded by `pool`'s threads into one tensor, image i where `shapes[i]` (its height and
    width, from decoded_size) says it fits; one whose file cannot be decoded, or decodes to another size than its
    header said, is left to be read from its file (offset -1)."""
    sizes = 3 * shapes.prod(dim=1)
    ends = sizes.cumsum(dim=0)
    offsets = ends - sizes
    pixels = torch.empty(int(ends[-1]) if len(ends) else 0, dtype=torch.uint8)
    # Plain Python numbers and a NumPy view for the threads: indexing a tensor costs microseconds an image
    flat, starts, stops, sides = pixels.numpy(), offsets.tolist(), ends.tolist(), shapes.tolist()

    def decode(index: int) -> bool:
        if starts[index] == stops[index]:
            return False
        try:
            image = np.asarray(load_rgb(data.images_path[index], data.min_side))
        except Exception:  # PIL raises many types for a file that is gone or no longer an image
            return False
        if image.shape != (*sides[index], 3):
            return False
        flat[starts[index] : stops[index]] = image.reshape(-1)
        return True

    decoded = torch.tensor(in_chunks(pool, decode, range(len(shapes))), dtype=torch.bool)
    offsets[~decoded] = -1
    return DecodedImages(pixels, offsets, shapes)


def in_chunks(pool: ThreadPoolExecutor, function, items, chunk: int = 64) -> list:
    """[function(item) for item in items], computed by `pool`'s threads `chunk` items to a task: a task per item
    costs the pool about 0.1 ms in locking and switching between threads, more than a small image takes to decode."""
    items = list(items)
    parts = [items[start : start + chunk] for start in range(0, len(items), chunk)]
    return [result for part in pool.map(lambda part: [function(item) for item in part], parts) for result in part]


def datasets(split: DataSplit, config, processes_here: int = 1) -> tuple["SeededSamples", MyDataSet, str]:
    """The training set (augmented, each image seeded by SeededBatchSampler) and the validation set of a split,
    at `config`'s image size and augmentation (a Config: img_size, auto_augment, random_erase), their images
    decoded once into memory where --image-cache-gb allows (decode_once, for one of `processes_here` training
    processes on this machine); and the line saying whether they were."""
    augment = train_transform(config.img_size, auto_augment=config.auto_augment, random_erase=config.random_erase)
    train_set = MyDataSet(split.train_images, split.train_labels, augment)
    val_set = MyDataSet(split.val_images, split.val_labels, val_transform(config.img_size))
    decoded = decode_once([train_set, val_set], config.image_cache_gb, processes_here)
    return SeededSamples(train_set), val_set, decoded


class SeededSamples(Dataset):
    """A dataset whose items are asked for as (index, seed), as SeededBatchSampler gives them: the random
    augmentation of each is drawn from `seed` alone, so it does not depend on which loader worker (or how many)
    loads it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, item):
        index, seed = item
        with torch.random.fork_rng(devices=[]):
            # The CPU's generator alone, which the transforms draw from: torch.manual_seed would also queue seeds
            # for CUDA, XPU and MTIA, each with a formatted stack trace, a third of an item's time at 48 px.
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]


class SeededBatchSampler(Sampler):
    """Wraps a batch sampler: each index goes out as (index, seed), the seed a function of (seed, epoch, index).

    `set_epoch` is passed on to the wrapped sampler (a DistributedSampler), which reshuffles by epoch. `start_at`
    makes the next pass begin part way through the epoch, where a run stopped at a step resumes.
    """

    def __init__(self, batch_sampler, seed: int):
        self.batch_sampler = batch_sampler
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_sampler.sampler.set_epoch(epoch)

    def start_at(self, batch: int) -> None:
        """The next pass skips the epoch's first `batch` batches (their images are not loaded); later passes
        start at 0."""
        self.start = batch

    def __iter__(self):
        start, self.start = self.start, 0
        for batch in itertools.islice(self.batch_sampler, start, None):
            yield [(index, sample_seed(self.seed, self.epoch, index)) for index in batch]

    def __len__(self):
        return len(self.batch_sampler)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one sample of one epoch; distinct (seed, epoch, index) give unrelated streams."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)
