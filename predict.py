"""Classify images with weights a training run saved: each image's top-k classes by name, with probabilities.

python predict.py photo.jpg more_photos/ --weights runs/train_single_gpu-20261122-201145/weights/best.pth
"""

from pathlib import Path

import torch

from dataset.folders import IMAGE_EXTENSIONS, list_images
from dataset.images import image_problem
from multi_train_utils.distributed_utils import resolve_device
from my_dataset import SKIPPED
from run.trained import add_model_arguments, image_loader, load_trained_model
from utils import HelpFormatter, Parser, UserError, describe, entry_point, positive_int


def images_in(folder: Path) -> list[Path]:
    """The images in `folder` and in its sub-folders (hidden ones left out), folder by folder in name order."""
    folders = [folder, *sorted(sub for sub in folder.rglob("*") if sub.is_dir())]
    visible = [sub for sub in folders if not any(part.startswith(".") for part in sub.relative_to(folder).parts)]
    return [image for sub in visible for image in list_images(sub)]


def find_images(paths: list[Path]) -> list[Path]:
    """The files named, and the images in the folders named and their sub-folders; every one must be readable."""
    images = []
    for path in paths:
        if not path.exists():
            raise UserError(f"{path} does not exist")
        if path.is_file():
            images.append(path)
            continue
        found = images_in(path)
        if not found:
            raise UserError(f"folder {path} holds no images ({' '.join(IMAGE_EXTENSIONS)}, in it or its sub-folders)")
        images += found
    unreadable = [f"{image} ({problem})" for image in images if (problem := image_problem(image)) is not None]
    if unreadable:
        raise UserError(f"cannot read {len(unreadable)} image(s): {describe(unreadable, shown=3)}")
    return images


@entry_point
def main(argv=None):
    parser = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "images", nargs="+", type=Path, metavar="IMAGE_OR_FOLDER", help="image files, or folders to search for images"
    )
    add_model_arguments(parser)
    parser.add_argument("--topk", type=positive_int, default=3, help="classes shown per image (at most all of them)")
    args = parser.parse_args(argv)

    images = find_images(args.images)
    trained = load_trained_model(args.weights, args.class_indices, resolve_device(args.device), args.model)
    topk = min(args.topk, len(trained.classes))
    # The dataset's "label" of each image is its position in `images`, to name the file when its batch comes back.
    loader = image_loader(trained, args, images, list(range(len(images))))
    with torch.inference_mode():
        for batch, positions in loader:
            with trained.compute.autocast(trained.device):
                logits = trained.model(trained.compute.batch_to(batch, trained.device))
            probabilities = logits.float().softmax(dim=1)
            top = probabilities.topk(topk, dim=1)
            for position, values, labels in zip(
                positions.tolist(), top.values.tolist(), top.indices.tolist(), strict=True
            ):
                if position == SKIPPED:  # it vanished or broke since it was checked; the loader warned
                    continue
                ranked = ", ".join(
                    f"{trained.classes[label]} {value:.3f}" for label, value in zip(labels, values, strict=True)
                )
                print(f"{images[position]}: {ranked}", flush=True)


if __name__ == "__main__":
    main()
