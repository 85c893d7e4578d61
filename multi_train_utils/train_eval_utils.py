"""One training epoch and one evaluation pass, the same for one process and for DDP."""

import contextlib
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from multi_train_utils.distributed_utils import all_reduce_in_background, is_main_process, reduce_value
from my_dataset import SKIPPED
from plumbing.checkpoint import set_rng_states
from plumbing.compute import Compute
from plumbing.preemption import Midway, StopRequested, agreed_signal, stop_votes
from plumbing.recipe import Objective
from utils import UserError


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite (usually too high a learning rate, or bad data); raised on every rank at
    the same step, so no rank is left waiting, and before the step, so the weights stay finite."""


@dataclass
class Training:
    """What a training step uses and changes: the model as it is trained (wrapped in DDP, compiled, ...), its
    optimizer and learning-rate schedule, how it computes (precision, memory layout, and the gradient scaler that
    float16 needs), the loss (`objective`), the weights' moving average (`ema`, or None), the number of
    micro-batches whose gradients each optimizer step sums (`accumulate`), and where a resumed run continues an
    epoch it stopped in (`midway`, set by plumbing.checkpoint.restore; None: at the epoch's start)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    compute: Compute = Compute()
    scaler: torch.amp.GradScaler | None = None
    objective: Objective = Objective()
    ema: nn.Module | None = None
    accumulate: int = 1
    midway: Midway | None = None

    def epoch_lr(self) -> float:
        """The learning rate of the coming epoch's first step (the epoch's metrics report it): the optimizer's now,
        or, in an epoch a resumed run continues, the one it had when it started."""
        return self.optimizer.param_groups[0]["lr"] if self.midway is None else self.midway.lr


def train_one_epoch(training: Training, data_loader, device, epoch: int, max_skipped=None) -> tuple[float, int]:
    """Train for one epoch; returns (mean loss over every sample of every rank, images trained on by all ranks).

    Each step sums the gradients of `training.accumulate` micro-batches (the last step of an epoch those that are
    left) before the optimizer steps; in DDP only the last of them synchronises (`no_sync` for the others), so a
    step costs one all-reduce of the gradients whatever the accumulation. After each optimizer step the scheduler
    steps and the EMA takes in the new weights.

    The per-micro-batch loss is summed over the ranks, weighted by batch size, so the bar shows the same running
    mean on any world size and every rank sees a non-finite loss together. The gradient scaler is needed for
    float16 only (its narrow range would underflow small gradients); disabled or None, steps are plain. Images
    that could not be read (labelled SKIPPED) are left out of the loss; the count of them, summed over the ranks
    with the loss, stops every rank at the same step once it passes `max_skipped` (None: no limit). A stop signal
    (plumbing/preemption.py), summed with them too, raises StopRequested on every rank after the same optimizer
    step. With `training.midway`, the epoch continues from that step (the loader must batch with a
    SeededBatchSampler, as shuffled_batches does).

    The host never waits for the step it has just queued: each step's sums travel (all-reduce, copy to the host)
    while the next step computes, and are checked then, one step behind (StepTotals). So a non-finite loss or one
    unreadable image too many stops every rank during the step after it, before anything more is saved: the
    checkpoint and weights files keep the last epoch's finite weights.
    """
    model, optimizer, compute, objective = training.model, training.optimizer, training.compute, training.objective
    device, first_lr, midway, training.midway = torch.device(device), training.epoch_lr(), training.midway, None
    model.train()
    start = 0 if midway is None else midway.step
    # (sum of sample losses, samples, skipped), over every rank: the steps checked so far
    totals = [0.0, 0.0, 0.0] if midway is None else midway.totals
    if midway is not None:
        data_loader.batch_sampler.start_at(start)
    progress = tqdm(
        data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process(), initial=start
    )
    batches = enumerate(progress, start=start)  # the loader draws a seed from torch's generator as it starts...
    if midway is not None:
        set_rng_states(midway.rng)  # ... which the uninterrupted run drew before the step the checkpoint holds
    step_scaler = training.scaler or torch.amp.GradScaler(device.type, enabled=False)
    optimizer.zero_grad(set_to_none=True)
    stopping, pending = None, None
    for step, (images, labels) in batches:
        last_of_group = (step + 1) % training.accumulate == 0 or step + 1 == len(data_loader)
        read = int((labels != SKIPPED).sum())  # on the host: the loader's labels are still there
        images, labels = compute.batch_to(images, device), labels.to(device, non_blocking=device.type == "cuda")
        images, mixing = objective.mix(images, epoch, step)
        with synchronised(model, last_of_group):
            with compute.autocast(device):
                outputs = model(compute.batch_to(images, device))  # batch_to again: mixing may change the layout
                # A batch of nothing but skipped images still takes its step (every rank steps together): loss 0.
                loss_sum = objective.loss_sum(outputs, labels, mixing)
                loss = loss_sum / read if read else outputs.sum() * 0.0
            step_scaler.scale(loss / group_size(training, step, len(data_loader))).backward()

        sent = StepTotals(loss_sum, [read, len(labels) - read, *stop_votes()], device)
        if pending is not None:  # the step before's sums, long arrived
            stopping = check_step(pending.get(), totals, epoch, max_skipped) or stopping
        pending = sent
        last_step = step + 1 == len(data_loader)
        if last_of_group and (stopping is not None or last_step):  # stopping, or the epoch's end: all checked
            stopping = check_step(pending.get(), totals, epoch, max_skipped) or stopping
            pending = None
        if last_of_group:
            optimizer_step(training, step_scaler)
            if stopping is not None:
                progress.close()
                raise StopRequested(stopping, epoch, step + 1, totals, first_lr)
        progress.set_postfix(mean_loss=f"{totals[0] / max(totals[1], 1):.3f}")  # as of the step checked last
    total_loss, total_images, _ = totals
    return total_loss / max(total_images, 1), int(total_images)


class StepTotals:
    """A step's (sum of sample losses, images read, images skipped, stop votes), summed over the ranks on their
    way to the host: the all-reduce and, on a GPU, the copy to pinned host memory are queued behind the step's
    work, and `get` waits for them alone (a step later, when they have long arrived), never for the work queued
    after them."""

    def __init__(self, loss_sum: torch.Tensor, counts: list, device: torch.device):
        counts = torch.tensor(counts, dtype=torch.float64).to(device, non_blocking=True)
        self.values = torch.cat([loss_sum.detach().double().reshape(1), counts])
        self.work = all_reduce_in_background(self.values)
        self.ready = None
        if device.type == "cuda":
            if self.work is not None:
                self.work.wait()  # on a GPU: the copy below waits for the all-reduce on the device, not the host
            self.values = self.values.to("cpu", non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def get(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()
        elif self.work is not None:
            self.work.wait()
        return self.values.tolist()


def group_size(training: Training, step: int, batches: int) -> int:
    """The micro-batches in the optimizer step that `step` belongs to: training.accumulate, or at the end of an
    epoch of `batches` micro-batches, those that are left."""
    return min(training.accumulate, batches - step // training.accumulate * training.accumulate)


def check_step(step_totals: list[float], totals: list[float], epoch: int, max_skipped) -> int | None:
    """Add a step's summed `step_totals` (StepTotals.get) to the epoch's `totals`; returns the stop signal the
    ranks agreed on, if any. Stops every rank (all see the same sums) on a non-finite loss or once the skipped
    images pass `max_skipped`."""
    if not math.isfinite(step_totals[0]):
        raise NonFiniteLossError(
            f"non-finite loss at epoch {epoch}: stopped; lower --lr or check the data "
            "(the last checkpoint is from before this epoch)"
        )
    for i in range(3):
        totals[i] += step_totals[i]
    if max_skipped is not None and totals[2] > max_skipped:
        raise UserError(too_many_skipped(int(totals[2]), max_skipped, f"epoch {epoch}'s training images"))
    return agreed_signal(step_totals[3:])


def optimizer_step(training: Training, step_scaler: torch.amp.GradScaler) -> None:
    """The step the summed gradients ask for, then the schedule's and the weights' average's."""
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


def too_many_skipped(skipped: int, limit: int, of_what: str) -> str:
    if limit == 0:
        return f"an image of {of_what} could not be read (--strict-images): stopped; the warning above names it"
    return (
        f"{skipped} of {of_what} could not be read, more than the {limit} (1 %) a run skips: stopped; the "
        "warnings above name them (the last checkpoint is from before this epoch)"
    )


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
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    in_topk = torch.zeros((), dtype=torch.int64, device=device)
    for images, labels in tqdm(
        data_loader, desc="validate", file=sys.stdout, disable=not is_main_process(), leave=False
    ):
        with compute.autocast(device):
            logits = model(compute.batch_to(images, device))
            predictions = logits.argmax(dim=1)
        labels = labels.to(device)
        read = labels != SKIPPED  # images that could not be read count neither as right nor as wrong
        pairs = labels[read] * num_classes + predictions[read]
        confusion += torch.bincount(pairs, minlength=num_classes * num_classes).view(num_classes, num_classes)
        if topk is not None:
            in_topk += (logits[read].topk(topk, dim=1).indices == labels[read, None]).any(dim=1).sum()
    confusion = reduce_value(confusion, average=False).cpu()
    skipped = max_skipped is not None and len(data_loader.dataset) - int(confusion.sum())
    if skipped and skipped > max_skipped:  # the same on every rank: the matrix is the sum over all of them
        raise UserError(too_many_skipped(skipped, max_skipped, "the validation images"))
    return confusion if topk is None else (confusion, int(reduce_value(in_topk, average=False)))


def validate(model, training: Training, data_loader, device, num_classes: int, max_skipped=None):
    """The epoch's validation: the model's confusion matrix, and with an EMA its accuracy too (as `ema_` metrics,
    computed as run_log.epoch_metrics computes val_acc)."""
    confusion = evaluate(model, data_loader, device, num_classes, training.compute, max_skipped)
    if training.ema is None:
        return confusion, {}
    averaged = evaluate(training.ema.module, data_loader, device, num_classes, training.compute, max_skipped)
    correct, total = int(averaged.trace()), int(averaged.sum())
    return confusion, {"ema_val_acc": correct / max(total, 1), "ema_val_correct": correct}


def unreadable_limits(train_images: int, val_images: int, strict: bool) -> tuple[int, int]:
    """How many of an epoch's training and validation images may be unreadable before the run stops: 1 % (at
    least one), or none with --strict-images."""
    return tuple(0 if strict else max(1, count // 100) for count in (train_images, val_images))
