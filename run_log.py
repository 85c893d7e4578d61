"""What a run writes besides its weights: args.json, class_indices.json, metrics.jsonl (one line per epoch),
TensorBoard's scalars, flags and prediction previews, and the line printed after each epoch. Rank 0 alone
writes; every other rank's RunLog does nothing."""

import json
import resource
import sys
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from compute import Compute
from my_dataset import IMAGENET_MEAN, IMAGENET_STD, write_class_indices
from utils import OutputError, write_atomically, write_failure, write_json


class RunLog:
    """A run's log files in `output_dir`, opened for the epochs from `start_epoch` on (a resumed run keeps the
    lines of the epochs before it and drops any later ones, which it trains again)."""

    def __init__(self, output_dir: Path, run: dict, classes: list[str], start_epoch: int, preview_set, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        self.output_dir, self.classes = output_dir, classes
        write_class_indices(classes, output_dir)
        if start_epoch > 0:
            keep_metrics_before(output_dir / "metrics.jsonl", start_epoch)
        self.writer = SummaryWriter(str(output_dir / "tb"), purge_step=start_epoch)
        print(f'Output: {output_dir}  (TensorBoard: tensorboard --logdir "{output_dir / "tb"}")', flush=True)
        write_json(output_dir / "args.json", run)
        write_hparams(self.writer, run)
        self.preview = preview_batch(preview_set)

    def epoch(self, metrics: dict, best_acc: float, model, compute: Compute) -> None:
        """Print the epoch's line, add its scalars and prediction preview to TensorBoard, its line to metrics.jsonl."""
        if not self.enabled:
            return
        epoch = metrics["epoch"]
        print(
            f"[epoch {epoch}] train loss {metrics['train_loss']:.3f}  val acc {metrics['val_acc']:.3f} "
            f"({metrics['val_correct']}/{metrics['val_total']})  lr {metrics['lr']:.2e}  "
            f"{metrics['epoch_seconds']:.1f} s, {metrics['train_images_per_sec']:.1f} img/s" + skipped_note(metrics),
            flush=True,
        )
        try:
            self.write_epoch(metrics, best_acc, model, compute)
        except OSError as error:  # TensorBoard's writer: a full disk, a vanished folder, ...
            raise OutputError(write_failure(Path(error.filename or self.output_dir), error)) from None

    def write_epoch(self, metrics: dict, best_acc: float, model, compute: Compute) -> None:
        epoch = metrics["epoch"]
        for tag, value in (
            ("loss", metrics["train_loss"]),
            ("accuracy", metrics["val_acc"]),
            ("learning_rate", metrics["lr"]),
            (BEST_ACC_TAG, best_acc),
        ):
            self.writer.add_scalar(tag, value, epoch)
        self.writer.add_figure(
            "validation_predictions", preview_figure(model, self.preview, self.classes, compute), epoch
        )
        self.writer.flush()  # now, so that a failure to write the event file surfaces now
        # The file rewritten whole (it is small), never appended to: a full disk cannot leave half a line in it.
        path = self.output_dir / "metrics.jsonl"
        lines = path.read_text() if path.exists() else ""
        write_atomically(path, lambda f: f.write(lines + json.dumps(metrics) + "\n"))

    def close(self) -> None:
        if self.enabled:
            self.writer.close()


def skipped_note(metrics: dict) -> str:
    skipped = (metrics["skipped_images"], metrics["val_skipped_images"])
    if not any(skipped):
        return ""
    return f"  (unreadable, left out: {skipped[0]} training, {skipped[1]} validation images)"


def run_record(args, **decided) -> dict:
    """The run's flags as JSON-able plain data (paths as strings), with what was decided from them (`decided`,
    e.g. the data folder --demo chose, the memory layout "auto" chose): args.json, and the checkpoint's "args"."""
    plain = lambda value: str(value) if isinstance(value, Path) else value  # noqa: E731
    return {key: plain(value) for key, value in {**vars(args), **decided}.items()}


def epoch_metrics(
    epoch, train_loss, train_images, train_seconds, epoch_seconds, confusion, lr, world_size, device, expected
):
    """One line of metrics.jsonl: the epoch's loss, validation counts (overall and per class), rate and speed,
    and the images skipped because they could not be read: `expected` (training, validation) less those used."""
    val_correct, val_total = int(confusion.trace()), int(confusion.sum())
    return {
        "epoch": epoch,
        "train_loss": train_loss,
        "val_acc": val_correct / val_total,
        "val_correct": val_correct,
        "val_total": val_total,
        "val_per_class_correct": confusion.diagonal().tolist(),
        "val_per_class_total": confusion.sum(dim=1).tolist(),
        "lr": lr,
        "epoch_seconds": epoch_seconds,
        "train_images": train_images,
        "train_images_per_sec": train_images / train_seconds,
        "world_size": world_size,
        "skipped_images": expected[0] - train_images,
        "val_skipped_images": expected[1] - val_total,
        **peak_memory(device),
    }


BEST_ACC_TAG = "hparams/best_val_acc"  # the metric TensorBoard's HPARAMS tab shows beside each run's flags


def write_hparams(writer: SummaryWriter, run: dict) -> None:
    """The run's flags in TensorBoard's HPARAMS tab, in the run's own event file (add_hparams would make another
    folder), with the best validation accuracy, logged each epoch, as their metric."""
    # Numbers stay numbers (sortable there); switches, paths and None become text ("True", not the 1 that
    # TensorBoard would make of a bool).
    flags = {
        key: value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)
        for key, value in run.items()
    }
    for summary in hparams(flags, {BEST_ACC_TAG: None}):
        writer.file_writer.add_summary(summary)


def preview_batch(val_set, count: int = 16):
    """`count` validation images spread over the set (so over the classes, which it lists in order) and their
    labels: the same images every epoch, to watch the predictions change."""
    picks = sorted({round(i * (len(val_set) - 1) / max(count - 1, 1)) for i in range(min(count, len(val_set)))})
    samples = [val_set[i] for i in picks]
    return torch.stack([image for image, _ in samples]), [label for _, label in samples]


@torch.no_grad()
def preview_figure(model, preview, classes: list[str], compute: Compute):
    """The preview images titled with the model's predictions (green right, red wrong), for TensorBoard."""
    images, labels = preview
    device = next(model.parameters()).device
    model.eval()
    with compute.autocast(device):
        predicted = model(compute.batch_to(images, device)).argmax(dim=1).tolist()
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    pixels = (images * std + mean).clamp(0, 1).permute(0, 2, 3, 1).numpy()  # undo Normalize, to HxWx3
    from plot_results import plot_predictions  # matplotlib: imported by rank 0 alone, when it first draws

    return plot_predictions(pixels, labels, predicted, classes)


def peak_memory(device: torch.device) -> dict:
    """This process's peak resident memory so far (loader workers not included), and on CUDA its GPU's peak."""
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, kilobytes on Linux
    peak = {"peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20)}
    if device.type == "cuda":
        peak["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return peak


def keep_metrics_before(path: Path, epoch: int) -> None:
    """Drop metrics lines of epochs the resumed run will train again (written after the last checkpoint)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["epoch"] < epoch]
        write_atomically(path, lambda f: f.writelines(lines))
