"""The data folder: its class folders and their images, read into training and validation lists.

A dataset here is a folder with one sub-folder per class (the layout of flower_photos), split at random:

    flower_photos/daisy/1234.jpg, flower_photos/roses/5678.jpg, ...

or a folder of train/ and val/ alone, each with one sub-folder per class (ImageNet's layout), used as given:

    flowers/train/daisy/1234.jpg, flowers/val/daisy/5678.jpg, ...
"""

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
    unreadable: list[str] = field(default_factory=list)  # left out of both sets (with verify_images=True)
    given: bool = False  # True: the data folder's own train/ and val/, not a random split by val_rate and seed


def split_fingerprint(split: DataSplit, root) -> dict:
    """What tells one split from another, for a run's record: per set, its image count and a sha256 over its
    images' paths relative to `root` (a moved data folder is the same data) with their labels, sorted (the order
    the files were listed in does not matter)."""

    def digest(images: list[str], labels: list[int]) -> str:
        pairs = zip(relative_posix(images, root), labels, strict=True)
        lines = sorted(f"{image}\t{label}\n" for image, label in pairs)
        return hashlib.sha256("".join(lines).encode("utf-8", NAMES)).hexdigest()

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

    os.scandir tells files from folders without a stat call per file on most filesystems, ten times faster than
    Path.iterdir and is_file at 100,000 images (docs/performance.md, Start-up)."""
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


def unreadable_images(images: list[str]) -> list[str]:
    """Those of `images` that PIL cannot decode (image_problem), each decoded once."""
    return [path for path in images if image_problem(path) is not None]


def read_split_data(root, val_rate: float = 0.2, seed: int = 0, output_dir=None, verify_images=False) -> DataSplit:
    """The training and validation lists of a dataset in either layout (see given_split_folders for the rule
    that tells them apart): a class-per-folder dataset is split at random, a folder of train/ and val/ is used as
    it is. Training, evaluate.py and predict.py all call this, so all of them see the same split.

    With `verify_images`, the images that cannot be decoded are left out (listed in .unreadable): True decodes
    every image (unreadable_images); a function does the same job its own way, given every listed image at once
    and returning the unreadable ones (the training scripts pass dataset/image_check.py's ImageCheck, which
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
        random.Random(f"{seed}:{name}".encode("utf-8", NAMES)).shuffle(images)  # (as str: the same draws)
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
            raise UserError(no_images_in(folder))
    return found


def no_images_in(folder: Path) -> str:
    """Why class folder `folder` gives no image, in a line: none readable in it, or only folders of images (most
    often a data path one level too high: data/ given for data/flower_photos/daisy/*.jpg)."""
    message = f"class folder {folder} holds no readable images ({' '.join(IMAGE_EXTENSIONS)})"
    inside = sub_folders(folder)
    if inside:
        message += (
            f", only sub-folders ({describe(inside)}), whose images are not read: a class's images lie directly in "
            "its folder (is the data path one level too high?)"
        )
    return message


def write_class_indices(classes: list[str], output_dir) -> None:
    """class_indices.json: {"0": "daisy", "1": "dandelion", ...}, how predictions map back to names."""
    write_json(Path(output_dir) / "class_indices.json", {str(i): name for i, name in enumerate(classes)})
