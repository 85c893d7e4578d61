"""One training epoch and one evaluation pass, the same for one process and for DDP."""

import sys

import torch
from torch import nn
from tqdm import tqdm

from compute import Compute
from multi_train_utils.distributed_utils import is_main_process, reduce_value
from utils import UserError


class NonFiniteLossError(UserError):
    """The loss became NaN or infinite (usually too high a learning rate, or bad data); raised on every rank at
    the same step, so no rank is left waiting, and before the step, so the weights stay finite."""


def train_one_epoch(
    model, optimizer, data_loader, device, epoch: int, compute: Compute = Compute(), scaler=None
) -> tuple[float, int]:
    """Train for one epoch; returns (mean loss over every sample of every rank, images seen by all ranks).

    The per-step loss is summed over the ranks, weighted by batch size, so the bar shows the same running mean
    on any world size and every rank sees a non-finite loss together. `scaler` is a torch.amp.GradScaler, needed
    for float16 only (its narrow range would underflow small gradients); disabled or None, steps are plain.
    """
    device = torch.device(device)
    scaler = scaler or torch.amp.GradScaler(device.type, enabled=False)
    model.train()
    loss_function = nn.CrossEntropyLoss()
    loss_and_count = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of sample losses, samples)
    progress = tqdm(data_loader, desc=f"[epoch {epoch}] train", file=sys.stdout, disable=not is_main_process())
    for images, labels in progress:
        images, labels = compute.batch_to(images, device), labels.to(device, non_blocking=device.type == "cuda")
        with compute.autocast(device):
            loss = loss_function(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()

        # (sum of the step's sample losses, samples), over every rank
        step = torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64, device=device)
        step = reduce_value(step, average=False)
        if not torch.isfinite(step[0]):
            raise NonFiniteLossError(
                f"non-finite loss at epoch {epoch}: stopped; lower --lr or check the data "
                "(the last checkpoint is from before this epoch)"
            )
        scaler.step(optimizer)  # with float16, skips the step (and lowers the scale) if a gradient overflowed
        scaler.update()
        loss_and_count += step
        progress.set_postfix(mean_loss=f"{(loss_and_count[0] / loss_and_count[1]).item():.3f}")
    total_loss, total_images = loss_and_count.tolist()
    return total_loss / max(total_images, 1), int(total_images)


@torch.no_grad()
def evaluate(model, data_loader, device, num_classes: int, compute: Compute = Compute()) -> torch.Tensor:
    """The confusion matrix (rows: true class, columns: predicted) summed over every rank's validation shard.

    Each rank evaluates its own disjoint shard, nothing padded, so every image counts exactly once: accuracy is
    its trace over its sum, per-class recall its diagonal over row sums.
    """
    device = torch.device(device)
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for images, labels in tqdm(
        data_loader, desc="validate", file=sys.stdout, disable=not is_main_process(), leave=False
    ):
        with compute.autocast(device):
            predictions = model(compute.batch_to(images, device)).argmax(dim=1)
        labels = labels.to(device)
        confusion += torch.bincount(labels * num_classes + predictions, minlength=num_classes * num_classes).view(
            num_classes, num_classes
        )
    return reduce_value(confusion, average=False).cpu()
