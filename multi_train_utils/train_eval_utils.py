"""One training epoch and one evaluation pass, the same for one process and for DDP: the step as the textbook
takes it, its bookkeeping behind a few calls (multi_train_utils/bookkeeping.py)."""

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from multi_train_utils.bookkeeping import EpochSteps, Tally, progress_bar
from multi_train_utils.memory import out_of_memory
from multi_train_utils.stop_and_resume import Midway
from recipe.loss import Objective
from recipe.precision import Compute


@dataclass
class Training:
    """What a training step uses and changes: the model as it is trained (wrapped in DDP, compiled, ...), its
    optimizer and learning-rate schedule, how it computes (precision, memory layout, micro-batch, and the gradient
    scaler that float16 needs), the loss (`objective`), the weights' moving average (`ema`, or None), the number of
    batches whose gradients each optimizer step sums (`accumulate`), the largest total norm of a step's gradients
    (`clip_grad_norm`; 0: no limit), and where a resumed run continues an epoch it stopped in (`midway`, set by
    stop_and_resume.resume_from; None: at the epoch's start)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    compute: Compute = Compute()
    scaler: torch.amp.GradScaler | None = None
    objective: Objective = Objective()
    ema: nn.Module | None = None
    accumulate: int = 1
    clip_grad_norm: float = 0.0
    midway: Midway | None = None

    def epoch_lr(self) -> float:
        """The learning rate of the coming epoch's first step (the epoch's metrics report it): the optimizer's now,
        or, in an epoch a resumed run continues, the one it had when it started."""
        return self.optimizer.param_groups[0]["lr"] if self.midway is None else self.midway.lr

    def epoch_start(self) -> float:
        """When the coming epoch started, on time.perf_counter's clock (the epoch's metrics time it from there):
        now, or, in an epoch a resumed run continues, as long ago as it had trained before it stopped; the time
        the run was stopped does not count."""
        return time.perf_counter() - (0.0 if self.midway is None else self.midway.seconds)


def train_one_epoch(training: Training, data_loader, device, epoch: int, max_skipped=None) -> tuple[float, int]:
    """Train for one epoch; returns (mean loss over every sample of every rank, images trained on by all ranks).

    Each optimizer step sums the gradients of `training.accumulate` batches (the last step of an epoch those that
    are left), and a batch larger than `training.compute.micro_batch` is taken in micro-batches of that many
    images (what fits the device's memory: multi_train_utils/memory.py): each piece's loss is its share of the
    batch's mean, so the gradients add up to the whole batch's. In DDP only the last backward pass of a step
    synchronises (`no_sync` for the others), so a step costs one all-reduce of the gradients whatever the
    accumulation and the micro-batches; running out of memory ends in one line naming --micro-batch. After each
    optimizer step the scheduler steps and the EMA takes in the new weights. The gradient scaler is needed for
    float16 only (its narrow range would underflow small gradients); disabled or None, steps are plain.

    The books (EpochSteps): each batch's loss is summed over the ranks, weighted by its images, so the bar
    shows the same running mean on any world size and every rank sees a non-finite loss together. Images that
    could not be read (labelled SKIPPED) are left out of the loss; the count of them, summed with the loss, stops
    every rank at the same step once it passes `max_skipped` (None: no limit). A stop signal
    (multi_train_utils/stop_and_resume.py), summed with them too, raises StopRequested on every rank after the
    same optimizer step. With `training.midway`, the epoch continues from that step (the loader must batch with a
    SeededBatchSampler, as shuffled_batches does).

    The host never waits for the step it has just queued: each step's sums travel (all-reduce, copy to the host)
    while the next step computes, and are checked then, one step behind. So a non-finite loss or one unreadable
    image too many stops every rank during the step after it, before anything more is saved: the checkpoint and
    weights files keep the last epoch's finite weights.
    """
    model, compute, objective, device = training.model, training.compute, training.objective, torch.device(device)
    model.train()
    training.optimizer.zero_grad(set_to_none=True)
    steps = EpochSteps(training, data_loader, device, epoch, max_skipped)
    # Each batch on the device, mixed, in micro-batches (EpochSteps.batches). Where nothing of a batch could be read,
    # its step is a step of nothing (a loss of 0), taken on every rank alike
    for step, read, batch_size, pieces in steps.batches():
        loss_sum = 0.0
        for piece, (images, labels, mixing) in enumerate(pieces, start=1):
            # DDP: the backward passes before a step's last only add up their gradients here (no_sync); the last
            # one's all-reduces the sum, so a step costs one all-reduce whatever --accumulate and --micro-batch are
            with (
                synchronised(model, steps.last_of_group(step) and piece == len(pieces)),
                out_of_memory(training, images),
            ):
                with compute.autocast(device):
                    outputs = model(compute.batch_to(images, device))  # again: mixing may change the layout
                    piece_sum = objective.loss_sum(outputs, labels, mixing)
                    loss = piece_sum / read if read else outputs.sum() * 0.0  # its share of the batch's mean
                steps.scaler.scale(loss / steps.group_size(step)).backward()
            loss_sum = loss_sum + piece_sum.detach()
        steps.check(step, loss_sum, read, batch_size)  # the sums, one step behind: loss, unreadable, stop votes
        if steps.last_of_group(step):
            optimizer_step(training, steps.scaler)
            steps.stop_if_asked(step)  # a stop signal: StopRequested on every rank, after this same step
    return steps.result()


def optimizer_step(training: Training, step_scaler: torch.amp.GradScaler) -> None:
    """The step the summed gradients ask for (clipped first to a total norm of `training.clip_grad_norm`, in their
    true units: float16's scaling undone), then the schedule's and the weights' average's."""
    if training.clip_grad_norm:
        step_scaler.unscale_(training.optimizer)  # the scaled gradients' true values (a disabled scaler: as they are)
        trained = [parameter for group in training.optimizer.param_groups for parameter in group["params"]]
        nn.utils.clip_grad_norm_(trained, training.clip_grad_norm)  # on the device: the host waits for nothing
    step_scaler.step(training.optimizer)  # with float16, skips the step (and lowers the scale) if one overflowed
    step_scaler.update()
    training.optimizer.zero_grad(set_to_none=True)
    if training.scheduler is not None:
        training.scheduler.step()
    if training.ema is not None:
        training.ema.update_parameters(training.model)


def synchronised(model, sync: bool):
    """DDP's gradient all-reduce in this backward pass when `sync`; no_sync() (gradients only summed locally)
    for the micro-batches before the last of a step. Models without DDP need neither."""
    return contextlib.nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync()


@torch.no_grad()
def evaluate(
    model, data_loader, device, num_classes: int, compute: Compute = Compute(), max_skipped=None, topk=None
) -> torch.Tensor | tuple[torch.Tensor, int]:
    """The confusion matrix (rows: true class, columns: predicted) summed over every rank's validation shard.

    Each rank evaluates its own disjoint shard, nothing padded, so every image counts exactly once: accuracy is
    its trace over its sum, per-class recall its diagonal over row sums. Images that could not be read (labelled
    SKIPPED) are in neither: the data's image count less the matrix's sum is their number; more than
    `max_skipped` of them (None: no limit) stop every rank. With `topk` (k), returns (the matrix, the number of
    images whose true class is among their k highest logits), that number summed over the ranks too.
    """
    device = torch.device(device)
    model.eval()
    tally = Tally(num_classes, device, topk)
    for images, labels in progress_bar(data_loader, "validate", leave=False):
        with compute.autocast(device):
            logits = model(compute.batch_to(images, device))
        tally.add(logits, labels.to(device, non_blocking=device.type == "cuda"))
    return tally.over_all_ranks(data_loader, max_skipped)


def validate(model, training: Training, data_loader, device, num_classes: int, max_skipped=None):
    """The epoch's validation: the model's confusion matrix, and with an EMA its accuracy too (as `ema_` metrics,
    computed as run/metrics.py's epoch_metrics computes val_acc)."""
    confusion = evaluate(model, data_loader, device, num_classes, training.compute, max_skipped)
    if training.ema is None:
        return confusion, {}
    averaged = evaluate(training.ema.module, data_loader, device, num_classes, training.compute, max_skipped)
    correct, total = int(averaged.trace()), int(averaged.sum())
    return confusion, {"ema_val_acc": correct / max(total, 1), "ema_val_correct": correct}
