"""The recipe around the network: the optimizer and its learning-rate schedule, the loss (label smoothing, class
weights, mixup and cutmix), and the weights' moving average (EMA).

Each piece is torch's or torchvision's own (torch.optim.SGD and AdamW, LambdaLR, cross_entropy, v2.MixUp and
v2.CutMix, swa_utils.AveragedModel); what is written here is how they are combined, so that every option means
the same on one process and on eight.
"""

import functools
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2

from multi_train_utils.distributed_utils import print_once
from my_dataset import SKIPPED, normalise, sample_seed


def build_optimizer(model, config, batches_per_epoch: int, world_size: int = 1):
    """The optimizer over the trainable parameters, and its schedule, stepped after every optimizer step: a
    linear warmup over --warmup-epochs, then a half cosine from the full rate down to rate * --lrf.

    The full rate is --lr times the batches of --batch-size images a step averages over: `world_size` processes,
    each summing --accumulate micro-batches (the linear scaling rule: a global batch that many times larger); an
    epoch of `batches_per_epoch` micro-batches takes that many optimizer steps, the last with what is left.
    `config` is a Config (lr, opt, momentum, weight_decay, epochs, lrf, warmup_epochs, accumulate, batch_size).
    """
    rate = config.lr * world_size * config.accumulate
    params = [p for p in model.parameters() if p.requires_grad]
    if config.opt == "adamw":
        optimizer = torch.optim.AdamW(params, lr=rate, weight_decay=config.weight_decay)
    else:
        optimizer = torch.optim.SGD(params, lr=rate, momentum=config.momentum, weight_decay=config.weight_decay)
    factor = functools.partial(
        schedule_factor,
        steps_per_epoch=math.ceil(batches_per_epoch / config.accumulate),
        epochs=config.epochs,
        warmup_epochs=config.warmup_epochs,
        lrf=config.lrf,
    )
    print_once(
        f"Learning rate {rate:g} (--lr {config.lr:g} x {world_size} process(es) x {config.accumulate} "
        f"micro-batch(es)) for a global batch of {config.batch_size * world_size * config.accumulate}"
    )
    return optimizer, lr_scheduler.LambdaLR(optimizer, factor)


def schedule_factor(step: int, *, steps_per_epoch: int, epochs: int, warmup_epochs: int, lrf: float) -> float:
    """The learning rate at optimizer step `step` (counted from 0 over the run) as a share of the full rate.

    Warmup: 1/W, 2/W, ..., 1 over its W steps. Then the cosine: 1 at the first step after warmup, falling to lrf
    at the end of the last epoch; without warmup, each epoch starts at (1 + cos(pi * epoch / epochs)) / 2 of the
    way from lrf to 1.
    """
    warmup = warmup_epochs * steps_per_epoch
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, epochs * steps_per_epoch - warmup)
    return lrf + (1 - lrf) * (1 + math.cos(math.pi * min(progress, 1.0))) / 2


def balanced_class_weights(labels: list[int], num_classes: int) -> torch.Tensor:
    """Each class's weight: the inverse of its share of `labels`, scaled so that the weights average 1 over the
    images (images of a class half as common count twice as much; the loss keeps its scale)."""
    counts = Counter(labels)
    return torch.tensor([len(labels) / (num_classes * counts[c]) if counts[c] else 0.0 for c in range(num_classes)])


@dataclass(frozen=True, eq=False)
class Objective:
    """What a training step minimises: cross-entropy against soft targets.

    Each image's target is its one-hot class, smoothed (`label_smoothing` of it spread evenly over the classes),
    then mixed with another image's by mixup or cutmix; the loss of an image is -sum_c weight_c * target_c *
    log p_c (weight 1 without class weights), and a step's loss is the mean over its readable images. With
    neither, it is nn.CrossEntropyLoss's. An image that could not be read (label SKIPPED) has an all-zero
    target: it adds nothing, wherever it is mixed to.

    Mixing is drawn per step from sample_seed(seed, epoch, step) alone, on the training process (not in loader
    workers): the same for any number of workers, and every rank mixes its own batch by the same draw.
    """

    label_smoothing: float = 0.0
    class_weights: torch.Tensor | None = None
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    seed: int = 0

    @functools.cached_property
    def mixer(self) -> nn.Module | None:
        mixers = [
            mix(alpha=alpha)
            for mix, alpha in ((v2.MixUp, self.mixup_alpha), (v2.CutMix, self.cutmix_alpha))
            if alpha > 0
        ]
        return v2.RandomChoice(mixers) if len(mixers) > 1 else next(iter(mixers), None)

    def mix(self, images: torch.Tensor, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch mixed by mixup or cutmix as drawn for this step, and the mixing matrix (batch x batch: row i
        holds the shares of each image in mixed image i) that mixes their targets alike; (images, None) when
        both are off.

        torchvision's transforms mix images and labels together; given the identity matrix as the labels, they
        return the mixing itself, which `loss_sum` then applies to targets of any number of classes.
        """
        if self.mixer is None:
            return images, None
        images = normalise(images)  # the network's inputs are mixed (as Compute.batch_to gives them, unchanged)
        with torch.random.fork_rng(devices=[]):  # the draw leaves the training's own random stream alone
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, step))
            return self.mixer(images, torch.eye(len(images), device=images.device))

    def targets(self, labels: torch.Tensor, num_classes: int, mixing=None, dtype=torch.float32) -> torch.Tensor:
        """Smoothed one-hot targets (batch x classes), mixed by `mixing`; rows of skipped images are zero."""
        one_hot = F.one_hot(labels.clamp(min=0), num_classes).to(dtype)
        smoothed = (one_hot * (1 - self.label_smoothing) + self.label_smoothing / num_classes) * (labels != SKIPPED)[
            :, None
        ]
        return smoothed if mixing is None else mixing.to(dtype) @ smoothed

    def loss_sum(self, outputs: torch.Tensor, labels: torch.Tensor, mixing: torch.Tensor | None = None):
        """The sum over the batch of each image's loss."""
        # in float32 at least: autocast's bfloat16 or float16 logits would round the loss
        log_p = F.log_softmax(outputs, dim=1, dtype=torch.promote_types(outputs.dtype, torch.float32))
        targets = self.targets(labels, outputs.shape[1], mixing, log_p.dtype)
        if self.class_weights is not None:
            targets = targets * self.class_weights.to(targets)
        return -(targets * log_p).sum()


def build_objective(config, split) -> Objective:
    """The loss the configuration asks for: label smoothing, class weights from the training split (saying them),
    mixup and cutmix."""
    weights = None
    if config.class_weights == "balanced":
        weights = balanced_class_weights(split.train_labels, len(split.classes))
        shown = (f"{name} {weight:.2f}" for name, weight in zip(split.classes, weights.tolist(), strict=True))
        print_once("Class weights (balanced): " + ", ".join(shown))
    return Objective(config.label_smoothing, weights, config.mixup_alpha, config.cutmix_alpha, config.seed)


def model_ema(model: nn.Module, decay: float) -> AveragedModel:
    """An exponential moving average of `model`'s weights and buffers (BatchNorm's running statistics included):
    after each optimizer step, average = decay * average + (1 - decay) * weights; the first step copies them."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
