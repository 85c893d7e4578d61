"""Evaluate a run's weights on the validation images it held out: accuracy, per-class scores, confusion matrix.

python evaluate.py --weights runs/train_single_gpu-20261122-201145/weights/best.pth
python evaluate.py --weights best.pth --class-indices class_indices.json --data-path flower_photos --all
python evaluate.py --weights best.pth --results val.csv                        # and one row per image, a file
torchrun --nproc_per_node=2 evaluate.py --weights best.pth                     # DDP, torchrun
python evaluate.py --weights best.pth --world-size 2                           # DDP, spawn

Flags left out default to the run's own (args.json), so the split is the one it validated on (docs/trained-models.md).
"""

from collections import namedtuple
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from dataset.folders import read_split_data
from dataset.image_check import CHECKED_IMAGES, ImageCheck
from inference.results import add_results_arguments, check_results_file, results_file
from inference.scoring import add_scoring_arguments, join_group, rows_of, scored_batches, spawned_world_size
from inference.trained import add_model_arguments, image_loader, load_trained_model
from multi_train_utils.bookkeeping import Tally
from multi_train_utils.distributed_utils import cleanup, is_main_process, on_main_process, val_shard
from multi_train_utils.spawn_utils import choose_meeting_point, report_failures, run_workers
from plot_results import plot_confusion_matrix
from utils import (
    HelpFormatter,
    OutputError,
    Parser,
    UserError,
    check_writable,
    describe,
    entry_point,
    number,
    warn,
    write_json,
)

TOPK = 5  # top-5 accuracy, reported with more classes than this only (else always 1: null in eval.json)


def per_class_scores(confusion: torch.Tensor) -> dict[str, list]:
    """Precision, recall, F1 and support per class of a confusion matrix (rows: true class); 0.0 where 0/0."""
    correct, predicted, support = confusion.diagonal().double(), confusion.sum(dim=0), confusion.sum(dim=1)
    return {  # correct <= predicted and <= support: clamping to 1 changes only the 0/0 cases
        "precision": (correct / predicted.clamp(min=1)).tolist(),
        "recall": (correct / support.clamp(min=1)).tolist(),
        # 2PR/(P+R) in counts: 2 correct/(predicted + support), exact
        "f1": (2 * correct / (predicted + support).clamp(min=1)).tolist(),
        "support": support.tolist(),
    }


def parse_args(argv=None):
    p = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    add_model_arguments(p)
    p.add_argument("--data-path", type=Path, help="folder with one sub-folder per class (default: the run's)")
    p.add_argument("--val-rate", type=number(float, 0, 1, above_minimum=True),
                   help="fraction of each class held out for validation (default: the run's, else 0.2; a folder of "
                   "train/ and val/ is used as given)")  # fmt: skip
    p.add_argument("--seed", type=number(int, 0), help="seed of the split (default: the run's, else 0)")
    p.add_argument("--all", action="store_true",
                   help="evaluate every image of the data folder instead of the validation split")  # fmt: skip
    p.add_argument("--output-dir", type=Path, help="where eval.json and confusion_matrix.png go (default: RUN/eval)")
    add_results_arguments(p)
    add_scoring_arguments(p)
    return p.parse_args(argv)


# What evaluate.py scores (images, labels; split: eval.json's "split") and where it writes (output_dir)
Evaluation = namedtuple("Evaluation", ["images", "labels", "split", "announcement", "unreadable", "output_dir"])


def plan(args, trained) -> Evaluation:
    """The images to evaluate and where the results go, every input checked (UserError otherwise)."""
    data_path = trained.setting("data_path", args.data_path)
    if data_path is None:
        raise UserError(f"no data: give --data-path (the flags of the run of {args.weights} were not found)")
    if args.data_path is None and not Path(data_path).is_dir():
        raise UserError(f"the run's data path {data_path} is not a folder here: give --data-path")
    val_rate, seed = trained.setting("val_rate", args.val_rate), trained.setting("seed", args.seed)
    output_dir = args.output_dir or trained.run_folder / "eval"
    check_writable(output_dir)
    # Split as training did, unreadable images out first; with --all each is found as it is scored, and reported
    verify = False if args.all else ImageCheck(data_path, trained.run_folder)
    split = read_split_data(data_path, val_rate, seed, verify_images=verify)
    if split.classes != trained.classes:
        raise UserError(f"{args.weights} was trained on classes {trained.classes}, but {data_path} has {split.classes}")
    # The run's verdicts kept up to date, as a training run does (none made beside weights of no run)
    if verify and is_main_process() and (trained.run_folder / CHECKED_IMAGES).exists():
        try:
            verify.save(trained.run_folder, merge=True)
        except OutputError as error:  # a run folder this user may not write: its images are checked again next time
            warn(f"{error}: the verdicts of its images are not kept")
    used = {"images": "all" if args.all else "validation", "data_path": str(data_path)}  # eval.json's "split"
    if args.all:
        images, labels = split.train_images + split.val_images, split.train_labels + split.val_labels
        line = f"Evaluating {args.weights} on all {len(images)} images of {data_path}"
        return Evaluation(images, labels, used, line, split.unreadable, output_dir)
    how = "(its val/ folder, as given)" if split.given else f"(val-rate {val_rate}, seed {seed})"
    line = f"Evaluating {args.weights} on the {len(split.val_images)} validation images of {data_path} {how}"
    used |= {"given": True} if split.given else {"val_rate": val_rate, "seed": seed}
    return Evaluation(split.val_images, split.val_labels, used, line, split.unreadable, output_dir)


@entry_point
def main(argv=None):
    args = parse_args(argv)
    check_results_file(args.results, args.force)
    if args.world_size is None:  # one process, or one of torchrun's
        return evaluate_weights(None, args)
    world_size = spawned_world_size(args.world_size, args.device)
    plan(args, load_trained_model(args.weights, args.class_indices, torch.device("cpu"), args.model))  # spawn: once
    print(f"Starting {world_size} processes; they meet at {choose_meeting_point()}")
    run_workers(worker, (args,), world_size)  # spawn: worker(rank, ...) in each new process


@entry_point
@report_failures
def worker(rank: int, args) -> None:
    evaluate_weights(rank, args)


def evaluate_weights(rank: int | None, args) -> None:
    # DDP: join the process group: spawn passes the rank, torchrun sets it in the environment (alone: no group)
    process = join_group(args.device, rank, args.world_size)
    try:
        trained = load_trained_model(args.weights, args.class_indices, process.device, args.model)
        evaluation = plan(args, trained)
        images, labels, classes = evaluation.images, evaluation.labels, trained.classes
        if is_main_process():
            if evaluation.unreadable:
                warn(f"skipped {len(evaluation.unreadable)} unreadable image(s): {describe(evaluation.unreadable)}")
            print(evaluation.announcement, flush=True)
        # DDP: this process scores images rank, rank + world size, ...: every image once, none padded
        shard = val_shard(images, process.rank, process.world_size)
        given = {"img_size": args.img_size, "batch_size": args.batch_size, "workers": args.workers}  # None: the run's
        loader = image_loader(trained, images, labels, shard, process.local_world_size, **given)
        tally = Tally(len(classes), process.device, TOPK if len(classes) > TOPK else None)
        shown = min(args.topk, len(classes))
        batches = scored_batches(trained, loader, len(images), process.world_size, args.tta, tally, "evaluate")
        # DDP: rank 0 gathers every batch, in the order of the images, and alone writes them
        with torch.inference_mode():
            with results_file(args.results, shown, enabled=is_main_process()) as results:
                for batch in batches:
                    results.write(rows_of(batch, images, labels, classes, shown))
            scored = tally.over_all_ranks(loader)  # DDP: every process's counts, summed
        # DDP: rank 0 prints and writes the report; the others wait for it, and stop with it if it cannot
        on_main_process(report, args, trained, evaluation, scored)
    finally:
        cleanup()  # DDP: leave the process group


def report(args, trained, evaluation: Evaluation, scored) -> None:
    """Print the scores, and write eval.json and confusion_matrix.png."""
    confusion, in_top5 = scored if isinstance(scored, tuple) else (scored, None)
    correct, total, classes = int(confusion.trace()), int(confusion.sum()), trained.classes
    scores, images = per_class_scores(confusion), len(evaluation.images)
    left_out = f"; {images - total} unreadable image(s) left out" if total < images else ""
    print(f"accuracy {correct / total:.3f} ({correct}/{total}{left_out})")
    if in_top5 is not None:
        print(f"top-5 accuracy {in_top5 / total:.3f} ({in_top5}/{total})")
    width = max(len("class"), *map(len, classes))
    print(f"\n{'class':<{width}}  precision  recall     f1  support")
    columns = (scores["precision"], scores["recall"], scores["f1"], scores["support"])
    for name, precision, recall, f1, support in zip(classes, *columns, strict=True):
        print(f"{name:<{width}}  {precision:9.3f}  {recall:6.3f}  {f1:5.3f}  {support:7d}")
    output_dir = evaluation.output_dir
    report_json = {
        "weights": str(args.weights), "split": evaluation.split, "img_size": trained.setting("img_size", args.img_size),
        "tta": args.tta, "accuracy": correct / total, "correct": correct, "total": total,
        "top5_accuracy": None if in_top5 is None else in_top5 / total, "top5_correct": in_top5,
        "per_class": {name: {key: values[c] for key, values in scores.items()} for c, name in enumerate(classes)},
        "classes": classes, "confusion_matrix": confusion.tolist(),  # rows: true class, columns: predicted class
    }  # fmt: skip
    write_json(output_dir / "eval.json", report_json)
    used = evaluation.split["images"]
    title = f"{args.weights.name}: accuracy {correct / total:.3f} ({correct}/{total}, {used} images)"
    plot_confusion_matrix(confusion, classes, title, output_dir / "confusion_matrix.png")
    files = [output_dir / "eval.json", output_dir / "confusion_matrix.png", *filter(None, [args.results])]
    print(f"\nWrote {', '.join(map(str, files[:-1]))} and {files[-1]}")


if __name__ == "__main__":
    record(main)()  # DDP: under torchrun, a crash's traceback goes to torchrun's error file, naming its rank
