"""Evaluate a run's weights on the validation images it held out: accuracy, per-class scores, confusion matrix.

python evaluate.py --weights runs/train_single_gpu-20261122-201145/weights/best.pth
python evaluate.py --weights best.pth --class-indices class_indices.json --data-path flower_photos --all

The data folder, validation rate, seed and image size default to the run's own (its args.json), so the split is
the one the run validated on; flags override them. A data folder of train/ and val/ alone is split as given
(read_split_data decides, as it did for the run): its val/ images are evaluated, whatever the rate and seed.
Writes eval.json and confusion_matrix.png.

Top-5 accuracy (the true class among an image's 5 highest logits) is reported with more than 5 classes only: with
5 or fewer every image's true class is among its top 5, so it would always be 1. eval.json then has
"top5_accuracy": null and "top5_correct": null, and nothing is printed for it.
"""

from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from dataset.folders import read_split_data
from multi_train_utils.distributed_utils import resolve_device
from multi_train_utils.train_eval_utils import evaluate
from plot_results import save_png
from run.trained import add_model_arguments, image_loader, load_trained_model
from utils import HelpFormatter, Parser, UserError, check_writable, describe, entry_point, number, write_json

TOPK = 5  # top-5 accuracy, reported with more classes than this


def per_class_scores(confusion: torch.Tensor) -> dict[str, list]:
    """Precision, recall, F1 and support of each class, from a confusion matrix (rows: true class, columns:
    predicted).

    A class that was never predicted has precision 0.0 (no correct predictions), not an undefined 0/0; likewise
    the recall of a class without images. F1 is 2PR/(P+R), 0.0 where P+R is 0 (no correct predictions).
    """
    correct = confusion.diagonal().double()
    predicted, support = confusion.sum(dim=0), confusion.sum(dim=1)
    # correct <= predicted and correct <= support, so dividing by at least 1 changes only the 0/0 cases, to 0.0
    return {
        "precision": (correct / predicted.clamp(min=1)).tolist(),
        "recall": (correct / support.clamp(min=1)).tolist(),
        # 2PR/(P+R) with P = correct/predicted and R = correct/support is 2 correct/(predicted + support): in counts,
        # exact, and 0 when correct is 0
        "f1": (2 * correct / (predicted + support).clamp(min=1)).tolist(),
        "support": support.tolist(),
    }


def print_table(classes: list[str], scores: dict[str, list]) -> None:
    width = max(len("class"), *map(len, classes))
    print(f"{'class':<{width}}  precision  recall     f1  support")
    columns = (scores["precision"], scores["recall"], scores["f1"], scores["support"])
    for name, precision, recall, f1, support in zip(classes, *columns, strict=True):
        print(f"{name:<{width}}  {precision:9.3f}  {recall:6.3f}  {f1:5.3f}  {support:7d}")


def plot_confusion_matrix(confusion: torch.Tensor, classes: list[str], title: str, path: Path) -> None:
    """A PNG of the confusion matrix: counts in the cells, class names on both axes."""
    counts = confusion.numpy()
    side = max(5.0, 0.8 * len(classes) + 2.5)  # inches; room for names and counts with many classes
    # A Figure without pyplot draws with Agg: no display, no global backend state.
    figure = Figure(figsize=(side + 1, side), dpi=100, layout="constrained")
    axes = figure.subplots()
    image = axes.imshow(counts, cmap="Blues")
    figure.colorbar(image, ax=axes, label="images")
    axes.set_xticks(range(len(classes)), classes, rotation=45, ha="right", rotation_mode="anchor")
    axes.set_yticks(range(len(classes)), classes)
    axes.set(xlabel="predicted class", ylabel="true class", title=title)
    for (row, column), count in np.ndenumerate(counts):
        dark = count > counts.max() / 2  # white text on the dark cells
        axes.text(column, row, str(count), ha="center", va="center", color="white" if dark else "black")
    save_png(figure, path)


def parse_args(argv=None):
    parser = Parser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--data-path", type=Path, help="folder with one sub-folder per class (default: the run's)")
    parser.add_argument(
        "--val-rate",
        type=number(float, 0, 1, above_minimum=True),
        help="fraction of each class held out for validation (default: the run's, else 0.2; a folder of train/ and "
        "val/ is used as given)",
    )
    parser.add_argument("--seed", type=number(int, 0), help="seed of the split (default: the run's, else 0)")
    parser.add_argument(
        "--all", action="store_true", help="evaluate every image of the data folder instead of the validation split"
    )
    parser.add_argument(
        "--output-dir", type=Path, help="where eval.json and confusion_matrix.png go (default: RUN/eval)"
    )
    return parser.parse_args(argv)


def chosen_images(args, split, data_path, val_rate: float, seed: int) -> tuple[list, list, dict]:
    """The images to evaluate (the validation split, or --all), their labels, and eval.json's "split"."""
    if args.all:
        images, labels = split.train_images + split.val_images, split.train_labels + split.val_labels
        print(f"Evaluating {args.weights} on all {len(images)} images of {data_path}")
        return images, labels, {"images": "all", "data_path": str(data_path)}
    print(
        f"Evaluating {args.weights} on the {len(split.val_images)} validation images of {data_path} "
        + ("(its val/ folder, as given)" if split.given else f"(val-rate {val_rate}, seed {seed})")
    )
    how = {"given": True} if split.given else {"val_rate": val_rate, "seed": seed}
    return split.val_images, split.val_labels, {"images": "validation", "data_path": str(data_path), **how}


def scores_report(classes: list[str], confusion: torch.Tensor, scores: dict, in_top5: int | None) -> dict:
    """eval.json's scores: accuracy, top-5 accuracy (null with 5 classes or fewer), per class, confusion matrix."""
    correct, total = int(confusion.trace()), int(confusion.sum())
    return {
        "accuracy": correct / total,
        "correct": correct,
        "total": total,
        "top5_accuracy": None if in_top5 is None else in_top5 / total,
        "top5_correct": in_top5,
        "per_class": {name: {key: values[c] for key, values in scores.items()} for c, name in enumerate(classes)},
        "classes": classes,
        "confusion_matrix": confusion.tolist(),  # rows: true class, columns: predicted class
    }


@entry_point
def main(argv=None):
    args = parse_args(argv)
    trained = load_trained_model(args.weights, args.class_indices, resolve_device(args.device), args.model)
    data_path = trained.setting("data_path", args.data_path)
    if data_path is None:
        raise UserError(f"no data: give --data-path (the flags of the run of {args.weights} were not found)")
    if args.data_path is None and not Path(data_path).is_dir():
        raise UserError(f"the run's data path {data_path} is not a folder here: give --data-path")
    val_rate, seed = trained.setting("val_rate", args.val_rate), trained.setting("seed", args.seed)
    output_dir = args.output_dir or trained.run_folder / "eval"
    check_writable(output_dir)

    # Split exactly as training does (unreadable images left out first, as they were from the run's split).
    split = read_split_data(data_path, val_rate, seed, verify_images=True)
    if split.classes != trained.classes:
        raise UserError(f"{args.weights} was trained on classes {trained.classes}, but {data_path} has {split.classes}")
    if split.unreadable:
        print(f"warning: skipped {len(split.unreadable)} unreadable image(s): {describe(split.unreadable)}")
    images, labels, used = chosen_images(args, split, data_path, val_rate, seed)

    loader = image_loader(trained, args, images, labels)
    topk = TOPK if len(split.classes) > TOPK else None  # with fewer classes it is always 1
    scored = evaluate(trained.model, loader, trained.device, len(split.classes), trained.compute, topk=topk)
    confusion, in_top5 = scored if topk else (scored, None)
    correct, total = int(confusion.trace()), int(confusion.sum())
    scores = per_class_scores(confusion)
    left_out = f"; {len(images) - total} unreadable image(s) left out" if total < len(images) else ""
    print(f"accuracy {correct / total:.3f} ({correct}/{total}{left_out})")
    if in_top5 is not None:
        print(f"top-5 accuracy {in_top5 / total:.3f} ({in_top5}/{total})")
    print()
    print_table(split.classes, scores)

    img_size = trained.setting("img_size", args.img_size)
    report = {"weights": str(args.weights), "split": used, "img_size": img_size}
    write_json(output_dir / "eval.json", report | scores_report(split.classes, confusion, scores, in_top5))
    title = f"{args.weights.name}: accuracy {correct / total:.3f} ({correct}/{total}, {used['images']} images)"
    plot_confusion_matrix(confusion, split.classes, title, output_dir / "confusion_matrix.png")
    print(f"\nWrote {output_dir / 'eval.json'} and {output_dir / 'confusion_matrix.png'}")


if __name__ == "__main__":
    main()
