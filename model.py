"""The network (torchvision's ResNet-34) and loading pretrained or previously saved weights into it."""

from dataclasses import dataclass, field

import torch
from torch import nn
from torchvision.models import resnet34

from utils import UserError, safe_load

# Prefixes that wrappers add to parameter names: DataParallel/DDP ("module.") and torch.compile ("_orig_mod.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
HEAD_PREFIX = "fc."  # the classifier, replaced when the number of classes differs


def create_model(num_classes: int) -> nn.Module:
    return resnet34(num_classes=num_classes)


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped_shape: list[str] = field(default_factory=list)  # e.g. the 1000-class ImageNet head
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [f"loaded {len(self.loaded)} tensors"]
        for label, names in (
            ("skipped for a different shape", self.skipped_shape),
            ("missing from the file (left as initialised)", self.missing),
            ("in the file but not in the model (ignored)", self.unexpected),
        ):
            if names:
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                parts.append(f"{len(names)} {label}: {shown}")
        return "; ".join(parts)


def strip_wrapper_prefixes(state_dict: dict) -> dict:
    def strip(name: str) -> str:
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        return name

    return {strip(name): tensor for name, tensor in state_dict.items()}


def read_state_dict(path) -> dict:
    """A state dict from a weights file: a plain state dict, or a checkpoint holding one under "model"."""
    data = safe_load(path, "weights file")
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict) or not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise UserError(f"weights file {path} does not hold a state dict (a mapping of names to tensors)")
    return strip_wrapper_prefixes(data)


def load_weights(model: nn.Module, path) -> LoadReport:
    """Load what fits from a weights file into `model`; tensors whose shape differs (a new head) are skipped."""
    state_dict = read_state_dict(path)
    own = model.state_dict()
    report = LoadReport()
    usable = {}
    for name, tensor in state_dict.items():
        if name not in own:
            report.unexpected.append(name)
        elif own[name].shape != tensor.shape:
            report.skipped_shape.append(name)
        else:
            usable[name] = tensor
            report.loaded.append(name)
    report.missing = [name for name in own if name not in state_dict]
    if not usable:
        raise UserError(f"weights file {path} has no tensor that fits this model (is it for another architecture?)")
    # Only the classifier head may differ (another class count); files older than torchvision 0.4.1 (such as
    # resnet34-333f7ec4.pth) lack the num_batches_tracked counters. Anything else means another network.
    misfits = [
        name
        for name in report.missing + report.skipped_shape
        if not name.startswith(HEAD_PREFIX) and not name.endswith("num_batches_tracked")
    ]
    if misfits:
        raise UserError(
            f"weights file {path} does not fit ResNet-34: {len(misfits)} tensors missing or of another shape "
            f"({', '.join(misfits[:3])}, ...); is it for another architecture?"
        )
    model.load_state_dict(usable, strict=False)
    return report


def freeze_all_but_head(model: nn.Module) -> None:
    """Train only the final fully connected layer (transfer learning from pretrained features)."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("fc."))
