"""One training epoch and one evaluation pass, the same for one process and for DDP, and how they compute (Choice)."""

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from dataset.transforms import normalise
from multi_train_utils.bookkeeping import EpochBooks, Tally, count_readable, progress_bar
from multi_train_utils.memory import out_of_memory
from multi_train_utils.stop_and_resume import Midway
from recipe.loss import Objective

AMP_DTYPES = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --amp: what autocast computes in


@dataclass(frozen=True)
class Choice:
    """How a run trains where the flags leave it to auto (autotune/choose.py decides it once, for every rank)."""

    amp: str = "off"
    channels_last: bool = False
    micro_batch: int | None = None  # None: the whole batch
    batches: str = "loader"  # made by the loader, or on the device: "device" (images held there), "stream"
    workers: int = 0
    threads: int | None = None  # None: torch's
    lines: tuple[str, ...] = field(default=(), compare=False)  # what the run prints about it

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.amp]

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @property
    def on_device(self) -> bool:
        return self.batches in ("device", "stream")

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler:
        """Active for float16 alone, whose narrow range would underflow small gradients; a pass-through otherwise."""
        return torch.amp.GradScaler(device.type, enabled=self.amp == "fp16")

    def batch_to(self, images: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A batch on `device` in this layout: 8-bit on the way (a quarter of float32's bytes), normalised there."""
        device = torch.device(device)
        return normalise(images.to(device, non_blocking=device.type == "cuda", memory_format=self.memory_format))

    def name(self) -> str:
        """E.g. "bfloat16 channels_last"."""
        precision = "float32" if self.amp_dtype is None else str(self.amp_dtype).removeprefix("torch.")
        return f"{precision} {'channels_last' if self.channels_last else 'NCHW'}"


@dataclass
class Training:
    """What a training step uses and changes; the model as trained (in DDP, compiled, ...), clip_grad_norm 0: none."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    choice: Choice = Choice()
    scaler: torch.amp.GradScaler | None = None
    objective: Objective = Objective()
    ema: nn.Module | None = None
    accumulate: int = 1
    clip_grad_norm: float = 0.0
    midway: Midway | None = None

    def epoch_lr(self) -> float:
        """The learning rate of the coming epoch's first step: the optimizer's, or a resumed epoch's own."""
        return self.optimizer.param_groups[0]["lr"] if self.midway is None else self.midway.lr

    def epoch_start(self) -> float:
        """When the coming epoch started (perf_counter): now, less what a resumed epoch trained before it stopped."""
        return time.perf_counter() - (0.0 if self.midway is None else self.midway.seconds)


def train_one_epoch(training: Training, data_loader, device, epoch: int, max_skipped=None) -> tuple[float, int]:
    """Train for one epoch; returns (the mean loss over every image of every rank, the images trained on). Each
    optimizer step sums `training.accumulate` batches' gradients, each batch's in micro-batches."""
    model, choice, objective, device = training.model, training.choice, training.objective, torch.device(device)
    model.train()
    training.optimizer.zero_grad(set_to_none=True)
    books = EpochBooks(training, data_loader, device, epoch, max_skipped)
    for step, (images, labels) in books.steps():  # each step's random draws seeded; a resumed epoch goes on midway
        read, batch_size = count_readable(labels), len(labels)  # counted on the host: on the device it would wait
        images = choice.batch_to(images, device)  # 8-bit to the device, normalised there in the model's layout
        labels = labels.to(device, non_blocking=device.type == "cuda")
        images, mixing = objective.mix(images, epoch, step)  # mixup or cutmix, drawn for this step
        pieces, loss_sum = objective.pieces(images, labels, mixing, choice.micro_batch), 0.0
        for piece, (images, labels, mixing) in enumerate(pieces, start=1):
            last = books.last_of_group(step) and piece == len(pieces)  # DDP: the one backward pass that all-reduces
            with synchronised(model, last), out_of_memory(training, images):
                with choice.autocast(device):
                    outputs = model(choice.batch_to(images, device))  # (again: mixing may change the layout)
                    piece_sum = objective.loss_sum(outputs, labels, mixing)
                    loss = piece_sum / read if read else outputs.sum() * 0.0  # its share of the batch's mean
                books.scaler.scale(loss / books.group_size(step)).backward()
            loss_sum = loss_sum + piece_sum.detach()
        books.check(step, loss_sum, read, batch_size)  # the sums one step behind: loss, unreadable, stop votes
        if books.last_of_group(step):
            optimizer_step(training, books.scaler)
            books.stop_if_asked(step)  # a stop signal: StopRequested on every rank, after this same step
    return books.result()


def optimizer_step(training: Training, scaler: torch.amp.GradScaler) -> None:
    """The step the summed gradients ask for (clipped first, in their true units), the schedule's and the EMA's."""
    if training.clip_grad_norm:
        scaler.unscale_(training.optimizer)  # float16's scaling undone (a disabled scaler: as they are)
        trained = [parameter for group in training.optimizer.param_groups for parameter in group["params"]]
        nn.utils.clip_grad_norm_(trained, training.clip_grad_norm)  # on the device: the host waits for nothing
    scaler.step(training.optimizer)  # float16: skips a step whose gradients overflowed, and lowers the scale
    scaler.update()
    training.optimizer.zero_grad(set_to_none=True)
    if training.scheduler is not None:
        training.scheduler.step()
    if training.ema is not None:
        training.ema.update_parameters(training.model)


def synchronised(model, sync: bool):
    """DDP's gradient all-reduce in this backward pass when `sync`, else no_sync(); nothing for a model without DDP."""
    return contextlib.nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync()


@torch.no_grad()
def evaluate(model, data_loader, device, num_classes: int, choice: Choice = Choice(), max_skipped=None, topk=None):
    """The confusion matrix (rows: true class) summed over every rank's validation shard (Tally.over_all_ranks)."""
    device = torch.device(device)
    model.eval()
    tally = Tally(num_classes, device, topk)
    for images, labels in progress_bar(data_loader, "validate", leave=False):
        with choice.autocast(device):
            logits = model(choice.batch_to(images, device))
        tally.add(logits, labels.to(device, non_blocking=device.type == "cuda"))
    return tally.over_all_ranks(data_loader, max_skipped)


def validate(model, training: Training, data_loader, device, num_classes: int, max_skipped=None):
    """The epoch's validation: the model's confusion matrix, and with an EMA its accuracy (`ema_` metrics)."""
    confusion = evaluate(model, data_loader, device, num_classes, training.choice, max_skipped)
    if training.ema is None:
        return confusion, {}
    averaged = evaluate(training.ema.module, data_loader, device, num_classes, training.choice, max_skipped)
    correct, total = int(averaged.trace()), int(averaged.sum())
    return confusion, {"ema_val_acc": correct / max(total, 1), "ema_val_correct": correct}
