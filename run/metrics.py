"""An epoch's metrics: its metrics.jsonl line (summed over every process), written and read back; the best network."""

import json
import sys
from pathlib import Path

import torch

from read_back import advice, read_json_lines
from utils import write_atomically

METRICS_NAME = "metrics.jsonl"  # in a run's folder: a line per epoch


def epoch_metrics(epoch: int, lr: float, trained: tuple, seconds: tuple, confusion, expected: tuple, process):
    """One line of metrics.jsonl. `trained`: (loss, images); `seconds`: (training, whole epoch), a resumed epoch's
    counted from Training.epoch_start; `expected`: (training, validation) images, those not used being skipped."""
    (train_loss, train_images), (train_seconds, epoch_seconds) = trained, seconds
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
        "world_size": process.world_size,
        "skipped_images": expected[0] - train_images,
        "val_skipped_images": expected[1] - val_total,
        **peak_memory(process.device),
    }


def skipped_note(metrics: dict) -> str:
    skipped = (metrics["skipped_images"], metrics["val_skipped_images"])
    return f"  (unreadable, left out: {skipped[0]} training, {skipped[1]} validation images)" if any(skipped) else ""


def epoch_accuracy(metrics: dict) -> float:
    """An epoch's validation accuracy (its metrics.jsonl line): the better of the model's and its average's."""
    return max(metrics["val_acc"], metrics.get("ema_val_acc", -1.0))


def best_so_far(metrics: dict, model, ema, best_acc: float):
    """(the network to save as best.pth, or None if this epoch did not improve on `best_acc`; the new best
    accuracy): the better of the model and its average (on a tie, the model)."""
    accuracy = epoch_accuracy(metrics)
    better = ema.module if metrics.get("ema_val_acc", -1.0) > metrics["val_acc"] else model
    return (better if accuracy > best_acc else None), max(best_acc, accuracy)


def peak_memory(device: torch.device) -> dict:
    """This process's peak resident memory in MiB (loader workers aside), where the OS tells it: from `resource`,
    else (Windows) from psutil if it is installed (it is not required); and on CUDA its GPU's peak."""
    try:
        import resource
    except ImportError:
        try:
            import psutil
        except ImportError:
            psutil = None
        rss = getattr(psutil.Process().memory_info(), "peak_wset", None) if psutil else None  # Windows', in bytes
    else:
        unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is in bytes on macOS, kilobytes on Linux
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    peak = {"peak_rss_mib": round(rss / 2**20)} if rss is not None else {}
    if device.type == "cuda":
        peak["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
    return peak


def read_metrics(path: Path) -> list[dict]:
    """The epochs metrics.jsonl holds (none before it is written); UserError naming the file and the line if one is
    not an epoch's: a run stops rather than rewrite the record of its epochs."""
    if not path.exists():
        return []
    with advice("mend it (a JSON object a line, each with its epoch), then run again"):
        return read_json_lines(path, "metrics file", numbers=("epoch",))


def keep_metrics_before(path: Path, epoch: int) -> None:
    """Drop metrics lines of epochs the resumed run will train again (written after the last checkpoint)."""
    if path.exists():
        write_metrics(path, [metrics for metrics in read_metrics(path) if metrics["epoch"] < epoch])


def append_metrics(path: Path, metrics: dict) -> None:
    """Add the epoch's line to metrics.jsonl, rewritten whole (it is small): a full disk leaves no half line."""
    write_metrics(path, [*read_metrics(path), metrics])


def write_metrics(path: Path, epochs: list[dict]) -> None:
    write_atomically(path, lambda f: f.writelines(json.dumps(metrics) + "\n" for metrics in epochs))
