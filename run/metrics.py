"""An epoch's metrics: the line of metrics.jsonl (loss, accuracy overall and per class, rate, speed, time, images
left out, peak memory), computed from what the epoch summed over every process; and which network is the best."""

import json
import sys
from pathlib import Path

import torch

from read_back import advice, read_json_lines
from utils import write_atomically

METRICS_NAME = "metrics.jsonl"  # in a run's folder: a line per epoch


def epoch_metrics(epoch: int, lr: float, trained: tuple, seconds: tuple, confusion, expected: tuple, process):
    """One line of metrics.jsonl: the epoch's loss and images trained on (`trained`), its validation counts
    (overall and per class, from the confusion matrix), rate, speed and time (`seconds`: training, whole epoch;
    in an epoch resumed from a step, counted from Training.epoch_start, both parts of it), and the images skipped
    because they could not be read: `expected` (training, validation) less those used."""
    (train_loss, train_images), (train_seconds, epoch_seconds) = trained, seconds
    world_size, device = process.world_size, process.device
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
        "train_seconds": train_seconds,
        "validation_seconds": epoch_seconds - train_seconds,
        "train_images": train_images,
        "train_images_per_sec": train_images / train_seconds,
        "world_size": world_size,
        "skipped_images": expected[0] - train_images,
        "val_skipped_images": expected[1] - val_total,
        **peak_memory(device),
    }


def skipped_note(metrics: dict) -> str:
    skipped = (metrics["skipped_images"], metrics["val_skipped_images"])
    if not any(skipped):
        return ""
    return f"  (unreadable, left out: {skipped[0]} training, {skipped[1]} validation images)"


def epoch_accuracy(metrics: dict) -> float:
    """An epoch's validation accuracy (its metrics.jsonl line): the better of the model's and its average's."""
    return max(metrics["val_acc"], metrics.get("ema_val_acc", -1.0))


def best_so_far(metrics: dict, model, ema, best_acc: float):
    """(the network to save as best.pth, or None if this epoch did not improve on `best_acc`; the new best
    accuracy): the better of the model and its average (`ema`, if any; on a tie, the model)."""
    accuracy = epoch_accuracy(metrics)
    better = ema.module if metrics.get("ema_val_acc", -1.0) > metrics["val_acc"] else model
    return (better if accuracy > best_acc else None), max(best_acc, accuracy)


def peak_memory(device: torch.device) -> dict:
    """This process's peak resident memory so far (loader workers not included), where the OS tells it, and on
    CUDA its GPU's peak."""
    rss = peak_rss_mib()
    peak = {"peak_rss_mib": rss} if rss is not None else {}
    if device.type == "cuda":
        peak["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return peak


def peak_rss_mib() -> int | None:
    """This process's peak resident memory in MiB: from `resource` on Linux and macOS; on Windows, which has no
    `resource`, from psutil if it is installed (it is not required), else None."""
    try:
        import resource
    except ImportError:
        try:
            import psutil
        except ImportError:
            return None
        peak = getattr(psutil.Process().memory_info(), "peak_wset", None)  # Windows' peak working set, in bytes
        return round(peak / 2**20) if peak is not None else None
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, kilobytes on Linux
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / 2**20)


def read_metrics(path: Path) -> list[dict]:
    """The epochs metrics.jsonl holds (none before it is written); UserError naming the file and the line if one is
    not an epoch's (truncated, say, or edited by hand): a run stops rather than rewrite the record of its epochs."""
    if not path.exists():
        return []
    with advice("mend it (a JSON object a line, each with its epoch), then run again"):
        return read_json_lines(path, "metrics file", numbers=("epoch",))


def keep_metrics_before(path: Path, epoch: int) -> None:
    """Drop metrics lines of epochs the resumed run will train again (written after the last checkpoint)."""
    if path.exists():
        write_metrics(path, [metrics for metrics in read_metrics(path) if metrics["epoch"] < epoch])


def append_metrics(path: Path, metrics: dict) -> None:
    """Add the epoch's line to metrics.jsonl. The file is rewritten whole (it is small), never appended to: a full
    disk cannot leave half a line in it."""
    write_metrics(path, [*read_metrics(path), metrics])


def write_metrics(path: Path, epochs: list[dict]) -> None:
    write_atomically(path, lambda f: f.writelines(json.dumps(metrics) + "\n" for metrics in epochs))
