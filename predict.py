"""Classify images with weights a training run saved: each image's top-k classes by name, with probabilities.

python predict.py photo.jpg more_photos/ --weights runs/train_single_gpu-20261122-201145/weights/best.pth
python predict.py photos/ --weights best.pth --results predictions.csv                 # one row per image, a file
torchrun --nproc_per_node=2 predict.py photos/ --weights best.pth --results predictions.csv     # DDP, torchrun
python predict.py photos/ --weights best.pth --results predictions.jsonl --world-size 2        # DDP, spawn

Under DDP each process scores its share of the images and rank 0 gathers them in their order: the same lines, or
rows, as one process gives. An image that cannot be read is reported in its line (or row).
"""

import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from dataset.folders import IMAGE_EXTENSIONS, list_images
from inference.results import add_results_arguments, check_results_file, results_file
from inference.scoring import UNKNOWN, add_scoring_arguments, join_group, rows_of, scored_batches, spawned_world_size
from inference.trained import add_model_arguments, image_loader, load_trained_model
from multi_train_utils.distributed_utils import cleanup, is_main_process, val_shard
from multi_train_utils.spawn_utils import choose_meeting_point, report_failures, run_workers
from utils import HelpFormatter, Parser, UserError, entry_point


def find_images(paths: list[Path]) -> list[Path]:
    """The files named, and the images of the folders named and their sub-folders (hidden ones left out), folder by
    folder in name order; UserError for a name that holds none."""
    images = []
    for path in paths:
        if not path.exists():
            raise UserError(f"{path} does not exist")
        folders = [] if path.is_file() else [path, *sorted(sub for sub in path.rglob("*") if sub.is_dir())]
        visible = [sub for sub in folders if not any(part.startswith(".") for part in sub.relative_to(path).parts)]
        found = [path] if path.is_file() else [image for sub in visible for image in list_images(sub)]
        if not found:
            raise UserError(f"folder {path} holds no images ({' '.join(IMAGE_EXTENSIONS)}, in it or its sub-folders)")
        images += found
    return images


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE_OR_FOLDER",
                   help="image files, or folders to search for images")  # fmt: skip
    add_model_arguments(p)
    add_results_arguments(p)
    add_scoring_arguments(p)
    return p.parse_args(argv)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    images = find_images(args.images)
    check_results_file(args.results, args.force)
    if args.world_size is None:  # one process, or one of torchrun's
        return predict(None, args, images)
    world_size = spawned_world_size(args.world_size, args.device)
    load_trained_model(args.weights, args.class_indices, torch.device("cpu"), args.model)  # spawn: checked once
    print(f"Starting {world_size} processes; they meet at {choose_meeting_point()}", file=sys.stderr)
    run_workers(worker, (args, images), world_size)  # spawn: worker(rank, ...) in each new process


@entry_point
@report_failures
def worker(rank: int, args, images: list[Path]) -> None:
    predict(rank, args, images)


def predict(rank: int | None, args, images: list[Path]) -> None:
    # DDP: join the process group: spawn passes the rank, torchrun sets it in the environment (alone: no group)
    process = join_group(args.device, rank, args.world_size)
    try:
        trained = load_trained_model(args.weights, args.class_indices, process.device, args.model)
        topk, labels = min(args.topk, len(trained.classes)), [UNKNOWN] * len(images)
        # DDP: this process scores images rank, rank + world size, ...: every image once, none padded
        shard = val_shard(images, process.rank, process.world_size)
        given = {"img_size": args.img_size, "batch_size": args.batch_size, "workers": args.workers}  # None: the run's
        loader = image_loader(trained, images, labels, shard, process.local_world_size, **given)
        start, unreadable = time.perf_counter(), 0
        progress = "predict" if args.results else None  # without --results, the lines show the progress
        # DDP: rank 0 gathers every batch, in the order of the images, and alone prints and writes them
        with torch.inference_mode(), results_file(args.results, topk, enabled=is_main_process()) as results:
            for batch in scored_batches(trained, loader, len(images), process.world_size, args.tta, progress=progress):
                rows = rows_of(batch, images, labels, trained.classes, topk)
                results.write(rows)
                unreadable += sum(row.unreadable is not None for row in rows)
                if args.results is None:
                    print("\n".join(row.line() for row in rows), flush=True)
        if args.results is not None and is_main_process():  # tools/benchmark.py reads the speed
            seconds, n = time.perf_counter() - start, process.world_size
            print(f"Wrote {args.results}: {results.rows} rows, scored in {seconds:.1f} s "
                  f"({len(images) / seconds:.1f} images/s, {n} process{'es' * (n > 1)})")  # fmt: skip
        if unreadable:
            where = "rows" if args.results else "lines"
            print(f"warning: {unreadable} image(s) could not be read; their {where} say why", file=sys.stderr)
    finally:
        cleanup()  # DDP: leave the process group


if __name__ == "__main__":
    record(main)()  # DDP: under torchrun, a crash's traceback goes to torchrun's error file, naming its rank
