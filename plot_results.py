"""Draw the training curves of one or more runs, or the throughput chart of a benchmark, as one PNG.

    python plot_results.py runs/train_single_gpu-20261122-201145
    python plot_results.py runs/A runs/B --labels "one process" "torchrun, 2 processes" --output curves.png
    python plot_results.py benchmark.json

A run folder is read through its metrics.jsonl (one line per epoch, written by run_log.py): the picture has
three panels, training loss, validation accuracy and learning rate against the epoch, with several runs overlaid.
A benchmark.json (or a folder holding one and no metrics.jsonl) gives a bar chart of images per second: trained,
or for the loader rows loaded.

Where the PNG goes unless --output says: training_curves.png in the run folder for one run, in the current folder
for several; benchmark.png next to the benchmark.json. An existing file of that name is replaced.
"""

import argparse
import textwrap
import warnings
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # not pyplot: no display, no global state, so other scripts can draw
from matplotlib.ticker import MaxNLocator

from read_back import read_json, read_json_lines
from utils import Parser, UserError, entry_point, printable, write_atomically

# Glyphs the font lacks are drawn as boxes, warned of each epoch; set once, as TensorBoard draws in a thread
warnings.filterwarnings("ignore", r"Glyph \d+ .*missing from font", UserWarning)

METRICS_NAME, BENCHMARK_NAME = "metrics.jsonl", "benchmark.json"
CURVES_PNG, BENCHMARK_PNG = "training_curves.png", "benchmark.png"
PANELS = (("train_loss", "training loss"), ("val_acc", "validation accuracy"), ("lr", "learning rate"))


def read_metrics(path: Path) -> list[dict]:
    epochs = read_json_lines(path, "metrics file", numbers=("epoch", *(key for key, _ in PANELS)))
    if not epochs:
        raise UserError(f"{path} holds no epochs (is the run still in its first epoch?)")
    return sorted(epochs, key=lambda record: record["epoch"])


def read_benchmark(path: Path) -> dict:
    """A benchmark.json as written by benchmark.py; UserError if it is not one."""
    benchmark = read_json(path, "benchmark file")
    rows = benchmark.get("rows")
    if not rows or not isinstance(rows, list):
        raise UserError(f"{path} has no benchmark rows (expected {{'rows': [{{'name': ..., 'img_per_sec': ...}}]}})")
    for number, row in enumerate(rows, start=1):
        if not (isinstance(row, dict) and "name" in row and "img_per_sec" in row):
            raise UserError(f"{path}: row {number} needs a name and an img_per_sec")
        if not isinstance(row["img_per_sec"], int | float | None):
            raise UserError(f"{path}: row {number} has img_per_sec {row['img_per_sec']!r}, not a number (or null)")
    return benchmark


def classify(argument: Path) -> tuple[str, Path]:
    """("run", run folder) or ("benchmark", benchmark.json) for a command-line argument."""
    if not argument.exists():
        raise UserError(f"{argument} does not exist")
    if argument.is_file():
        if argument.name == METRICS_NAME:
            return "run", argument.parent
        if argument.suffix == ".json":
            return "benchmark", argument
    elif (argument / METRICS_NAME).is_file():
        return "run", argument
    elif (argument / BENCHMARK_NAME).is_file():
        return "benchmark", argument / BENCHMARK_NAME
    raise UserError(f"{argument} is neither a run folder (with {METRICS_NAME}) nor a {BENCHMARK_NAME}")


def run_label(folder: Path, epochs: list[dict]) -> str:
    """The run folder's name and its number of processes, e.g. "train_multi_gpu_using_launch-... (2 processes)"."""
    processes = epochs[-1].get("world_size", 1)
    return f"{printable(folder.resolve().name)} ({processes} process{'es' if processes != 1 else ''})"


def plot_curves(runs: list[tuple[str, list[dict]]]) -> Figure:
    """The PANELS against the epoch, one line per (label, epochs) run."""
    fig = Figure(figsize=(12, 4.2), dpi=120, layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for label, epochs in runs:
        x = [record["epoch"] for record in epochs]
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            ax.plot(x, [record[key] for record in epochs], marker="o", markersize=3, label=label)
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set(title=title, xlabel="epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[1].set_ylim(0, 1)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=min(len(runs), 2), frameon=False)
    return fig


def plot_benchmark(benchmark: dict, path=None) -> Figure:
    """Images per second, a bar per row, the rows not comparable with training apart; saved to `path` if given."""
    rows, settings = benchmark["rows"], benchmark.get("settings", {})
    colours = {kind: f"C{i}" for i, kind in enumerate(dict.fromkeys(row.get("kind") for row in rows))}
    apart = [row for row in rows if row.get("kind") in ("loader", "demo", "predict")]
    panels = [(row_list, label) for row_list, label in (
        ([row for row in rows if row not in apart], "images per second trained (higher is better)"),
        (apart, "images per second: loaded (loader rows), trained at the demo's size, or scored (predict.py)"),
    ) if row_list]  # fmt: skip
    fig = Figure(figsize=(10, 1.8 + 0.55 * len(rows) + 0.6 * (len(panels) - 1)), dpi=120, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=[len(panel) for panel, _ in panels])[:, 0]
    for ax, (panel, label) in zip(axes, panels, strict=True):  # a bar per row, the first on top
        values = [row["img_per_sec"] for row in panel]
        positions = range(len(panel))  # not the names as categories: two rows of the same name stay two bars
        bars = ax.barh(positions, [value or 0 for value in values], color=[colours[row.get("kind")] for row in panel])
        ax.bar_label(bars, [f"{value:.1f}" if value is not None else "not measured" for value in values], padding=4)
        ax.set_yticks(positions, labels=[textwrap.fill(row["name"], 40) for row in panel])
        ax.invert_yaxis()
        ax.set_xlim(0, max(value or 0 for value in values) * 1.15 or 1)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    where = [str(benchmark[key]) for key in ("machine", "date") if benchmark.get(key)]
    # files written before the precision named its layout too
    old_layout = settings.get("channels_last") and "channels_last" not in settings.get("precision", "")
    how = [
        f"{settings['img_size']} px" if "img_size" in settings else None,
        f"batch {settings['batch_size']} per process" if "batch_size" in settings else None,
        settings.get("precision"),
        "channels_last" if old_layout else None,
        f"torch {benchmark['torch']}" if benchmark.get("torch") else None,
    ]
    lines = [", ".join(["Training throughput", *where]), ", ".join(filter(None, how))]
    # wrapped: the title is centred over the plot, which the row names leave narrower than the figure
    axes[0].set_title("\n".join(textwrap.fill(line, 80) for line in lines), fontsize=10)
    if path is not None:
        save_png(fig, path)
    return fig


def plot_predictions(images, true_labels: list[int], predicted: list[int], classes: list[str]) -> Figure:
    """A grid of HxWx3 images in 0..1 titled with the predicted class (and the true one when wrong), for TensorBoard.
    One axes, as subplots cost 8 times as much; numpy, as torch's threads would slow training (docs/performance.md)."""
    columns = min(4, len(images))
    height, width = images[0].shape[:2]
    pad = max(height // 2, 8)  # room for a two-line label above each picture, at any image size
    rows = -(-len(images) // columns)
    grid = np.ones((pad + rows * (height + pad), pad + columns * (width + pad), 3))  # white between pictures
    fig = Figure(figsize=(2.2 * columns, 2.2 * columns * grid.shape[0] / grid.shape[1]), dpi=80)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.axis("off")
    classes = [printable(name) for name in classes]
    for i, (image, truth, guess) in enumerate(zip(images, true_labels, predicted, strict=True)):
        row, column = divmod(i, columns)
        top, left = pad + row * (height + pad), pad + column * (width + pad)
        grid[top : top + height, left : left + width] = image
        label = classes[guess] if guess == truth else f"{classes[guess]}\n(true: {classes[truth]})"
        x, y = left + width / 2, top - pad * 0.1
        ax.text(x, y, label, ha="center", va="bottom", fontsize=9, color="green" if guess == truth else "red")
    ax.imshow(grid)
    return fig


def plot_confusion_matrix(confusion, classes: list[str], title: str, path: Path) -> None:
    """A PNG of a confusion matrix (a tensor, rows: true class): counts in the cells, class names on both axes."""
    counts = confusion.numpy()
    side = max(5.0, 0.8 * len(classes) + 2.5)  # inches; room for names and counts with many classes
    figure = Figure(figsize=(side + 1, side), dpi=100, layout="constrained")
    axes = figure.subplots()
    figure.colorbar(axes.imshow(counts, cmap="Blues"), ax=axes, label="images")
    classes = [printable(name) for name in classes]
    axes.set_xticks(range(len(classes)), classes, rotation=45, ha="right", rotation_mode="anchor")
    axes.set_yticks(range(len(classes)), classes)
    axes.set(xlabel="predicted class", ylabel="true class", title=printable(title))
    for (row, column), count in np.ndenumerate(counts):
        dark = count > counts.max() / 2  # white text on the dark cells
        axes.text(column, row, str(count), ha="center", va="center", color="white" if dark else "black")
    save_png(figure, path)


def save_png(fig: Figure, path) -> None:
    try:
        write_atomically(path, lambda f: fig.savefig(f, format="png"), binary=True)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None


def output_path(requested: Path | None, kind: str, sources: list[Path]) -> Path:
    """Where the PNG goes: --output, checked, else the default for `kind`."""
    if requested is None:
        if kind == "benchmark":
            return sources[0].parent / BENCHMARK_PNG
        return (sources[0] if len(sources) == 1 else Path.cwd()) / CURVES_PNG
    if requested.suffix.lower() != ".png":
        raise UserError(f"--output {requested} must end in .png")
    if requested.is_dir():
        raise UserError(f"--output {requested} is a folder; name the PNG file")
    if not requested.parent.is_dir():
        raise UserError(f"--output {requested}: the folder {requested.parent} does not exist")
    return requested


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", type=Path, metavar="RUN_DIR", help="run folders, or one benchmark.json")
    p.add_argument("--output", type=Path, help="the PNG to write (default: see above)")
    p.add_argument("--labels", nargs="+", metavar="NAME", help="legend names, one per run folder, in order")
    return p.parse_args(argv)


@entry_point
def main(argv=None) -> Figure:
    """Draw what the command line names and write the PNG; returns the Figure (for tests)."""
    args = parse_args(argv)
    found = [classify(path) for path in args.paths]
    kinds, sources = {kind for kind, _ in found}, [source for _, source in found]
    if kinds == {"benchmark"}:
        if len(sources) > 1 or args.labels:
            raise UserError("give one benchmark.json on its own (run folders and --labels draw training curves)")
        benchmark = read_benchmark(sources[0])
        path = output_path(args.output, "benchmark", sources)
        fig = plot_benchmark(benchmark)
    elif kinds == {"run"}:
        if args.labels is not None and len(args.labels) != len(sources):
            raise UserError(f"--labels gives {len(args.labels)} name(s) for {len(sources)} run folder(s)")
        runs = [read_metrics(folder / METRICS_NAME) for folder in sources]
        labels = args.labels or [run_label(folder, epochs) for folder, epochs in zip(sources, runs, strict=True)]
        path = output_path(args.output, "run", sources)
        fig = plot_curves(list(zip(labels, runs, strict=True)))
    else:
        raise UserError("give run folders or one benchmark.json, not both")
    save_png(fig, path)
    print(f"Wrote {path}")
    return fig


if __name__ == "__main__":
    main()
