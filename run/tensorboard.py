"""What a run shows in TensorBoard: each epoch's loss, accuracy, learning rate and best accuracy, a grid of
validation images titled with the model's predictions, and the run's flags in the HPARAMS tab."""

from pathlib import Path

import numpy as np
import torch
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


class Board:
    """A run's TensorBoard event file in `folder`, from `start_epoch` on (what a resumed run trains again is
    replaced), with the run's flags (`record`) and the same validation images every epoch (from `preview_set`)."""

    def __init__(self, folder: Path, record: dict, preview_set, start_epoch: int):
        self.writer = SummaryWriter(str(folder), purge_step=start_epoch)
        write_hparams(self.writer, record)
        self.preview = preview_batch(preview_set)
        # Its pixels for the grid, made here once: the background writer that draws it runs no torch operation,
        # which would start a team of OpenMP threads of its own for the rest of the run (docs/performance.md).
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
        """The epoch's scalars and prediction grid (the preview images titled with `predicted`), flushed, so that a
        failure to write surfaces here (run/run_log.py calls this in the background writer)."""
        epoch = metrics["epoch"]
        for tag, value in (
            ("loss", metrics["train_loss"]),
            ("accuracy", metrics["val_acc"]),
            ("learning_rate", metrics["lr"]),
            (BEST_ACC_TAG, best_acc),
        ):
            self.writer.add_scalar(tag, value, epoch)
        figure = preview_figure(self.pixels, self.preview[1], predicted, classes)
        grid = figure_pixels(figure)  # without pyplot: any thread
        self.writer.add_image("validation_predictions", grid, epoch, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


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


def figure_pixels(figure) -> np.ndarray:
    """A matplotlib Figure drawn into RGB pixels (height x width x 3, 8-bit) by the Agg renderer, as add_figure
    would draw it but without pyplot (whose GUI backends must stay in the main thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported by rank 0 alone, when it first draws

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def preview_figure(pixels: np.ndarray, labels: list[int], predicted: list[int], classes: list[str]):
    """The preview images (`pixels`: NxHxWx3 from 0 to 1) titled with the model's predictions (green right, red
    wrong), for TensorBoard."""
    from plot_results import plot_predictions  # matplotlib: imported by rank 0 alone, when it first draws

    return plot_predictions(pixels, labels, predicted, classes)
