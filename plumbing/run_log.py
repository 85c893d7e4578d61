"""What a run prints and writes: its first lines (announce), and each epoch's line, metrics.jsonl line,
TensorBoard scalars and prediction preview, weights and checkpoint (RunLog), with args.json and
class_indices.json at the start. In DDP rank 0 alone writes; every other rank's RunLog does nothing."""

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from multi_train_utils.distributed_utils import on_main_process, print_once
from my_dataset import DataSplit, split_fingerprint, write_class_indices
from plumbing.checkpoint import CHECKPOINT_NAME, save_atomically, save_epoch, training_state
from plumbing.compute import Compute, amp_flag
from plumbing.preemption import StopRequested, stop_signals_noted
from utils import OutputError, describe, write_atomically, write_failure, write_json


def announce(script: str, process, split: DataSplit, workers: int, decoded: str) -> None:
    """The run's first lines: how many processes on what, and the data (`decoded`: whether its images were
    decoded once into memory, my_dataset.decode_once's line)."""
    backend = f", backend {torch.distributed.get_backend()}" if process.distributed else ""
    print_once(f"{script}: {process.world_size} process(es) on {process.device.type}{backend}")
    if process.device.type == "cpu" and not torch.cuda.is_available():
        print_once("No CUDA GPU found: training on the CPU.")
    if split.unreadable:
        print_once(f"warning: skipped {len(split.unreadable)} unreadable image(s): {describe(split.unreadable)}")
    print_once(
        f"Data: {len(split.train_images)} training / {len(split.val_images)} validation images, "
        f"{len(split.classes)} classes{' (train/, val/ as given)' * split.given}; {workers} loader workers per process"
    )
    print_once(decoded)


def best_so_far(metrics: dict, model, ema, best_acc: float):
    """(the network to save as best.pth, or None if this epoch did not improve on `best_acc`; the new best
    accuracy): the better of the model and its average (`ema`, if any; on a tie, the model)."""
    accuracy = max(metrics["val_acc"], metrics.get("ema_val_acc", -1.0))
    better = ema.module if metrics.get("ema_val_acc", -1.0) > metrics["val_acc"] else model
    return (better if accuracy > best_acc else None), max(best_acc, accuracy)


class RunLog:
    """A run's log files and weights in `plan.output_dir`, opened for the epochs from `start_epoch` on (a resumed
    run keeps the lines of the epochs before it and drops any later ones, which it trains again). Disabled (on
    every rank but 0 in DDP), it writes nothing."""

    def __init__(self, config, plan, process, compute: Compute, preview_set, start_epoch: int, enabled: bool = True):
        self.enabled, self.output_dir, self.classes = enabled, plan.output_dir, plan.split.classes
        self.compute, self.world_size, self.save_every = compute, process.world_size, config.save_every
        self.device = process.device
        # The run's record (args.json, and each checkpoint's "args"): its flags and what was decided from them.
        self.record = config.record(
            data_path=plan.data_path, weights=plan.weights, resume=plan.resume, output_dir=plan.output_dir,
            world_size=process.world_size, device=str(process.device), channels_last=compute.channels_last,
            amp=amp_flag(compute),  # what auto chose, so that predict.py and evaluate.py compute as the run did
            split=split_fingerprint(plan.split, plan.data_path),  # a resume checks it has the same images
            **plan.given,  # the run's --batch-size and --lr as given, and for how many processes
        )  # fmt: skip
        if not enabled:
            return
        write_class_indices(self.classes, self.output_dir)
        if start_epoch > 0:
            keep_metrics_before(self.output_dir / "metrics.jsonl", start_epoch)
        self.writer = SummaryWriter(str(self.output_dir / "tb"), purge_step=start_epoch)
        print(f'Output: {self.output_dir}  (TensorBoard: tensorboard --logdir "{self.output_dir / "tb"}")', flush=True)
        write_json(self.output_dir / "args.json", self.record)
        write_hparams(self.writer, self.record)
        self.preview = preview_batch(preview_set)

    def epoch(self, metrics: dict, model, training, best, best_acc: float) -> None:
        """Everything an epoch leaves: its printed line, its log lines, its weights (and `best`'s, the model or
        its average, when it improved on the best accuracy), then the checkpoint of `model` and `training`."""
        epoch, self.best_acc = metrics["epoch"], best_acc
        try:
            self.log_epoch(metrics, best_acc, model)
            keep = self.save_every > 0 and (epoch + 1) % self.save_every == 0
            best_weights = best.state_dict() if best is not None else None
            state = training_state(
                epoch, model, training, best_acc, self.classes, self.world_size, self.record, self.device
            )
            save_epoch(self.output_dir, epoch, model.state_dict(), best_weights, state, keep=keep)
        except OutputError as error:
            last = self.output_dir / CHECKPOINT_NAME  # each finished epoch wrote one: the epoch before this one's
            kept = f"{last} (epoch {epoch - 1}) is untouched" if last.exists() else "no checkpoint yet"
            raise OutputError(f"{error}; stopped, {kept}: make room, then continue with --resume {last}") from None

    @contextlib.contextmanager
    def saving_a_step_on_stop(self, model, training, best_acc: float):
        """Inside, a stop signal (SIGTERM, SIGUSR1: plumbing/preemption.py) ends the run at a training step every
        rank agrees on: rank 0 saves that step as the checkpoint, while the others wait for it, and every process
        exits with status 128 + the signal. --auto-resume (or --resume) continues from that step. `best_acc` is the
        best validation accuracy when it starts; each epoch's call to epoch() brings it up to date."""
        self.best_acc = best_acc
        with stop_signals_noted():
            try:
                yield
            except StopRequested as stop:
                on_main_process(self.save_step, model, training, stop)
                raise SystemExit(stop.status) from None

    def save_step(self, model, training, stop: StopRequested) -> None:
        """The checkpoint of a run stopped at step `stop.step` of epoch `stop.epoch`: the training state then, and
        where in the epoch it is (its "midway")."""
        state = training_state(
            stop.epoch - 1, model, training, self.best_acc, self.classes, self.world_size, self.record, self.device
        )
        path = self.output_dir / CHECKPOINT_NAME
        try:
            save_atomically(state | {"midway": stop.midway()}, path)
        except OutputError as error:
            raise OutputError(f"{error}; stopped by a signal, the checkpoint of the last epoch is untouched") from None
        print(
            f"{stop}: saved in {path}; to continue from this step, run the same command with --auto-resume (or "
            f"--resume {path})",
            flush=True,
        )

    def done(self, best_acc: float) -> None:
        if self.enabled:
            self.writer.close()
            print(f"Done: best val acc {best_acc:.3f}; weights in {self.output_dir / 'weights'}", flush=True)

    def log_epoch(self, metrics: dict, best_acc: float, model) -> None:
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
            self.write_epoch(metrics, best_acc, model)
        except OSError as error:  # TensorBoard's writer: a full disk, a vanished folder, ...
            raise OutputError(write_failure(Path(error.filename or self.output_dir), error)) from None

    def write_epoch(self, metrics: dict, best_acc: float, model) -> None:
        epoch = metrics["epoch"]
        for tag, value in (
            ("loss", metrics["train_loss"]),
            ("accuracy", metrics["val_acc"]),
            ("learning_rate", metrics["lr"]),
            (BEST_ACC_TAG, best_acc),
        ):
            self.writer.add_scalar(tag, value, epoch)
        self.writer.add_figure(
            "validation_predictions", preview_figure(model, self.preview, self.classes, self.compute), epoch
        )
        self.writer.flush()  # now, so that a failure to write the event file surfaces now
        # The file rewritten whole (it is small), never appended to: a full disk cannot leave half a line in it.
        path = self.output_dir / "metrics.jsonl"
        lines = path.read_text() if path.exists() else ""
        write_atomically(path, lambda f: f.write(lines + json.dumps(metrics) + "\n"))


def skipped_note(metrics: dict) -> str:
    skipped = (metrics["skipped_images"], metrics["val_skipped_images"])
    if not any(skipped):
        return ""
    return f"  (unreadable, left out: {skipped[0]} training, {skipped[1]} validation images)"


def epoch_metrics(epoch: int, lr: float, trained: tuple, seconds: tuple, confusion, expected: tuple, process):
    """One line of metrics.jsonl: the epoch's loss and images trained on (`trained`), its validation counts
    (overall and per class, from the confusion matrix), rate, speed and time (`seconds`: training, whole epoch),
    and the images skipped because they could not be read: `expected` (training, validation) less those used."""
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
    pixels = (images.permute(0, 2, 3, 1) / 255).numpy()  # the loader's 8-bit pixels, as HxWx3 from 0 to 1
    from plot_results import plot_predictions  # matplotlib: imported by rank 0 alone, when it first draws

    return plot_predictions(pixels, labels, predicted, classes)


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


def keep_metrics_before(path: Path, epoch: int) -> None:
    """Drop metrics lines of epochs the resumed run will train again (written after the last checkpoint)."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines(keepends=True) if json.loads(line)["epoch"] < epoch]
        write_atomically(path, lambda f: f.writelines(lines))
