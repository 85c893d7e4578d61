"""What a step minimises: cross-entropy against soft targets (label smoothing, class weights, mixup and cutmix)."""

import functools
import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torchvision.transforms import v2

from dataset.images import SKIPPED
from dataset.sampling import sample_seed
from dataset.transforms import normalise


def balanced_class_weights(labels: list[int], num_classes: int) -> torch.Tensor:
    """Each class's weight: the inverse of its share of `labels`, scaled to average 1 over the images."""
    counts = Counter(labels)
    return torch.tensor([len(labels) / (num_classes * counts[c]) if counts[c] else 0.0 for c in range(num_classes)])


@dataclass(frozen=True, eq=False)
class Objective:
    """Cross-entropy on smoothed, mixed (by the step's seed), class-weighted targets; SKIPPED images add nothing."""

    label_smoothing: float = 0.0
    class_weights: torch.Tensor | None = None
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    seed: int = 0

    @functools.cached_property
    def mixer(self) -> nn.Module | None:
        alphas = ((v2.MixUp, self.mixup_alpha), (v2.CutMix, self.cutmix_alpha))
        mixers = [mix(alpha=alpha) for mix, alpha in alphas if alpha > 0]
        return v2.RandomChoice(mixers) if len(mixers) > 1 else next(iter(mixers), None)

    def mix(self, images: torch.Tensor, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch mixed as drawn for this step, and the mixing matrix (row i: each image's share in mixed image
        i) that `loss_sum` applies to the targets; (images, None) without mixup or cutmix."""
        if self.mixer is None:
            return images, None
        images = normalise(images)  # the network's inputs are mixed (as Choice.batch_to gives them, unchanged)
        with torch.random.fork_rng(devices=[]):  # the draw leaves the training's own random stream alone
            torch.default_generator.manual_seed(sample_seed(self.seed, epoch, step))
            return self.mixer(images, torch.eye(len(images), device=images.device))  # the identity, mixed: the matrix

    @staticmethod
    def pieces(images: torch.Tensor, labels: torch.Tensor, mixing: torch.Tensor | None, size: int | None):
        """The batch in as few, as even micro-batches of at most `size` images as can be, each (images, labels,
        mixing): a mixed piece keeps every label, so that the pieces' loss sums add up to the whole batch's."""
        count = 1 if size is None else math.ceil(len(images) / size)
        if count <= 1:
            return [(images, labels, mixing)]
        if mixing is None:
            return list(zip(images.tensor_split(count), labels.tensor_split(count), [None] * count, strict=True))
        parts = zip(images.tensor_split(count), mixing.tensor_split(count), strict=True)
        return [(part, labels, rows) for part, rows in parts]

    def targets(self, labels: torch.Tensor, num_classes: int, mixing=None, dtype=torch.float32) -> torch.Tensor:
        """Smoothed one-hot targets (batch x classes), mixed by `mixing`, made without reading a label on the host."""
        classes = torch.arange(num_classes, device=labels.device)
        one_hot = (labels[:, None] == classes).to(dtype)  # a SKIPPED label (-1) matches no class
        read = (labels != SKIPPED).to(dtype)[:, None]
        smoothed = (one_hot * (1 - self.label_smoothing) + self.label_smoothing / num_classes) * read
        return smoothed if mixing is None else mixing.to(dtype) @ smoothed

    def loss_sum(self, outputs: torch.Tensor, labels: torch.Tensor, mixing: torch.Tensor | None = None):
        # in float32 at least: autocast's bfloat16 or float16 logits would round the loss
        log_p = F.log_softmax(outputs, dim=1, dtype=torch.promote_types(outputs.dtype, torch.float32))
        targets = self.targets(labels, outputs.shape[1], mixing, log_p.dtype)
        if self.class_weights is not None:
            targets = targets * self.class_weights  # on the device already (build_objective)
        return -(targets * log_p).sum()


def class_weights(config, split) -> torch.Tensor | None:
    """The class weights --class-weights asks for, from the training split; None for none."""
    balanced = config.class_weights == "balanced"
    return balanced_class_weights(split.train_labels, len(split.classes)) if balanced else None


def describe_class_weights(config, split) -> str | None:
    weights = class_weights(config, split)
    if weights is None:
        return None
    named = zip(split.classes, weights.tolist(), strict=True)
    return "Class weights (balanced): " + ", ".join(f"{name} {weight:.2f}" for name, weight in named)


def build_objective(config, split, device: torch.device | str = "cpu") -> Objective:
    """The loss the configuration asks for, its class weights copied to `device` once, not every step."""
    weights = class_weights(config, split)
    weights = None if weights is None else weights.to(device)
    return Objective(config.label_smoothing, weights, config.mixup_alpha, config.cutmix_alpha, config.seed)
