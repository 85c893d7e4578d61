"""The data folder read into training and validation lists: class sub-folders split at random, or train/ and val/."""

import hashlib
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from dataset.images import image_problem
from utils import NAMES, UserError, describe, write_json

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


@dataclass
class DataSplit:
    train_images: list[str]
    train_labels: list[int]
    val_images: list[str]
    val_labels: list[int]
    classes: list[str]
    unreadable: list[str] = field(default_factory=list)  # left out of both sets (verify_images)
    given: bool = False  # the data folder's own train/ and val/, not a random split


def split_fingerprint(split: DataSplit, root) -> dict:
    """Per set, its count and a sha256 of its sorted (path relative to `root`, label) pairs: a moved folder's same."""
    found = {}
    for part in ("train", "val"):
        images, labels = getattr(split, f"{part}_images"), getattr(split, f"{part}_labels")
        lines = sorted(f"{image}\t{label}\n" for image, label in zip(relative_posix(images, root), labels, strict=True))
        digest = hashlib.sha256("".join(lines).encode("utf-8", NAMES)).hexdigest()
        found |= {f"{part}_images": len(images), f"{part}_sha256": digest}
    return found


def relative_posix(paths, root) -> list[str]:
    """`paths` relative to `root`, with / on every system; cut as strings where they can be (Paths: 1 s a 100,000)."""
    prefix = os.path.join(str(root), "")
    return [
        path[len(prefix) :].replace(os.sep, "/") if path.startswith(prefix) else Path(path).relative_to(root).as_posix()
        for path in map(str, paths)
    ]


def image_names(folder) -> list[str]:
    """The sorted names of the image files directly inside `folder` (os.scandir: docs/performance.md, Start-up)."""
    with os.scandir(folder) as entries:
        images = (entry for entry in entries if entry.name.lower().endswith(IMAGE_EXTENSIONS))
        names = [entry.name for entry in images if not entry.name.startswith(".") and entry.is_file()]
    return sorted(names, key=os.path.normcase)


def list_images(folder: Path) -> list[Path]:
    return [folder / name for name in image_names(folder)]


def paths_in(folder) -> list[str]:
    """The image files directly inside `folder`, as strings (a tenth of the cost of paths)."""
    prefix = os.path.join(folder, "")
    return [prefix + name for name in image_names(folder)]


def unreadable_images(images: list[str]) -> list[str]:
    return [path for path in images if image_problem(path) is not None]


def read_split_data(root, val_rate: float = 0.2, seed: int = 0, output_dir=None, verify_images=False) -> DataSplit:
    """The training and validation lists of a dataset in either layout. `verify_images`: True decodes each image, a
    function (ImageCheck) returns those of them it finds unreadable; those are left out, listed in .unreadable."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"data path {root} does not exist")
    if not root.is_dir():
        raise UserError(f"data path {root} is a file, not a folder with one sub-folder per class")
    if not 0.0 < val_rate < 1.0:
        raise UserError(f"validation rate must be between 0 and 1, got {val_rate}")
    check = unreadable_images if verify_images is True else verify_images or None
    split = given_split(root, check) if given_split_folders(root) else random_split(root, val_rate, seed, check)
    if output_dir is not None:
        write_class_indices(split.classes, output_dir)
    return split


def sub_folders(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def given_split_folders(root: Path) -> bool:
    """Whether `root` holds a split made in advance: exactly `train` and `val` sub-folders (others beside: refused)."""
    names = sub_folders(root)
    if not {"train", "val"} <= set(names):
        return False
    if names != ["train", "val"]:
        others = ", ".join(name for name in names if name not in ("train", "val"))
        raise UserError(f"data path {root} holds train/ and val/ beside other folders ({others}): a split given in "
                        "advance is a folder of train/ and val/ alone, each with one sub-folder per class")  # fmt: skip
    return True


def given_split(root: Path, check) -> DataSplit:
    """train/ and val/ as they are; both must have the same classes, and every class images in both."""
    classes = {part: sub_folders(root / part) for part in ("train", "val")}
    for part, names in classes.items():
        if not names:
            raise UserError(f"{root / part} has no class sub-folders: a data folder of train/ and val/ alone is "
                            "read as a split given in advance, each with one sub-folder per class (e.g. "
                            f"{root / part}/daisy/*.jpg)")  # fmt: skip
    if classes["train"] != classes["val"]:
        train, val = set(classes["train"]), set(classes["val"])
        only = {"train": train - val, "val": val - train}
        lists = "; ".join(f"only in {part}/: {', '.join(sorted(names))}" for part, names in only.items() if names)
        raise UserError(f"train/ and val/ of {root} have different classes: {lists}")
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
    """Each class split on its own, so that it is in both sets, its sorted list shuffled by (seed, class name)."""
    classes = sub_folders(root)
    if not classes:
        raise UserError(f"data path {root} has no class sub-folders (expected e.g. {root}/daisy/*.jpg)")
    split = DataSplit([], [], [], [], classes)
    found = class_images([root / name for name in classes], check, split.unreadable)
    for label, (name, images) in enumerate(zip(classes, found, strict=True)):
        if len(images) < 2:
            raise UserError(f"class folder {root / name} has {len(images)} image; at least 2 are needed to split it")
        random.Random(f"{seed}:{name}".encode("utf-8", NAMES)).shuffle(images)  # (as str: the same draws)
        num_val = min(max(1, round(len(images) * val_rate)), len(images) - 1)
        split.val_images += images[:num_val]
        split.val_labels += [label] * num_val
        split.train_images += images[num_val:]
        split.train_labels += [label] * (len(images) - num_val)
    return split


def class_images(folders: list[Path], check, unreadable: list[str]) -> list[list[str]]:
    """Each class folder's image paths, less those `check` finds unreadable (into `unreadable`); UserError if none."""
    found = [paths_in(folder) for folder in folders]
    if check is not None:
        bad = set(check([path for images in found for path in images]))
        unreadable += [path for images in found for path in images if path in bad]
        found = [[path for path in images if path not in bad] for images in found]
    for folder in (folder for folder, images in zip(folders, found, strict=True) if not images):
        message = f"class folder {folder} holds no readable images ({' '.join(IMAGE_EXTENSIONS)})"
        if inside := sub_folders(folder):
            message += (f", only sub-folders ({describe(inside)}), whose images are not read: a class's images lie "
                        "directly in its folder (is the data path one level too high?)")  # fmt: skip
        raise UserError(message)
    return found


def write_class_indices(classes: list[str], output_dir) -> None:
    """class_indices.json ({"0": "daisy", ...}): how predictions map back to names."""
    write_json(Path(output_dir) / "class_indices.json", {str(i): name for i, name in enumerate(classes)})
