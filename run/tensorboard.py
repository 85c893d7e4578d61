"""What a run shows in TensorBoard: each epoch's scalars, a grid of validation images titled with the model's
predictions, and the run's flags in the HPARAMS tab."""

import threading
from pathlib import Path

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from utils import writing

BEST_ACC_TAG = "hparams/best_val_acc"  # the metric TensorBoard's HPARAMS tab shows beside each run's flags


class Board:
    """A run's TensorBoard event file in `folder`, from `start_epoch` on (what a resumed run trains again is
    replaced), with the run's flags (`record`) and the same validation images every epoch (from `preview_set`).
    A failure to write is an OutputError naming the folder (utils.writing), raised where the run writes next."""

    def __init__(self, folder: Path, record: dict, preview_set, start_epoch: int):
        self.folder = folder
        quiet_writer_thread()
        # In the run's own event file (add_hparams makes another); numbers stay numbers, the rest text (not a bool's 1)
        flags = {
            key: value if isinstance(value, int | float) and not isinstance(value, bool) else str(value)
            for key, value in record.items()
        }
        with writing(folder):
            self.writer = SummaryWriter(str(folder), purge_step=start_epoch)
            for summary in hparams(flags, {BEST_ACC_TAG: None}):
                self.writer.file_writer.add_summary(summary)
        # 16 validation images spread over the set, so over its classes (listed in order)
        picks = sorted({round(i * (len(preview_set) - 1) / 15) for i in range(min(16, len(preview_set)))})
        samples = [preview_set[i] for i in picks]
        self.preview = torch.stack([image for image, _ in samples]), [label for _, label in samples]
        # The grid's pixels, made once here: a torch operation in the background writer would start OpenMP threads
        self.pixels = (self.preview[0].permute(0, 2, 3, 1) / 255).numpy()  # 8-bit, as HxWx3 from 0 to 1

    @torch.no_grad()
    def predictions(self, model, choice) -> list[int]:
        """The model's predicted class for each preview image, now (the weights of the epoch that just ended)."""
        images, _ = self.preview
        device = next(model.parameters()).device
        model.eval()
        with choice.autocast(device):
            return model(choice.batch_to(images, device)).argmax(dim=1).tolist()

    def epoch(self, metrics: dict, best_acc: float, predicted: list[int], classes: list[str]) -> None:
        """The epoch's scalars and prediction grid, flushed, so that a failure to write surfaces here."""
        epoch = metrics["epoch"]
        figure = preview_figure(self.pixels, self.preview[1], predicted, classes)
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # not pyplot, whose GUIs need the main thread

        canvas = FigureCanvasAgg(figure)
        canvas.draw()
        grid = np.asarray(canvas.buffer_rgba())[..., :3].copy()
        with writing(self.folder):
            for tag, key in (("loss", "train_loss"), ("accuracy", "val_acc"), ("learning_rate", "lr")):
                self.writer.add_scalar(tag, metrics[key], epoch)
            self.writer.add_scalar(BEST_ACC_TAG, best_acc, epoch)
            self.writer.add_image("validation_predictions", grid, epoch, dataformats="HWC")
            self.writer.flush()

    def close(self) -> None:
        with writing(self.folder):
            self.writer.close()


def quiet_writer_thread() -> None:
    """TensorBoard's writer thread raises its failure to write again in the thread that writes next, where the run
    names it in one line (Board): the thread's own traceback, printed as it ends, is left out."""
    shown = threading.excepthook
    if getattr(shown, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not type(args.thread).__module__.startswith("tensorboard."):
            shown(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


def preview_figure(pixels: np.ndarray, labels: list[int], predicted: list[int], classes: list[str]):
    """The preview images (NxHxWx3 from 0 to 1) titled with the predictions (green right, red wrong)."""
    from plot_results import plot_predictions  # matplotlib: imported by rank 0 alone, when it first draws

    return plot_predictions(pixels, labels, predicted, classes)
