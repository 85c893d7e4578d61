"""The architectures: torchvision's and timm's models built by name, and what their structure says."""

import difflib
import functools
import re

import torch
import torchvision
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.models import get_model, list_models

from utils import UserError

WRAPPERS = re.compile(r"^(module\.|_orig_mod\.)+")  # the prefixes DataParallel/DDP and torch.compile add to names
DEFAULT_MODEL = "resnet34"
# Models with an auxiliary classifier (a tuple out in training) are built without it; its ImageNet tensors ignored.
BUILD_OPTIONS = {name: {"aux_logits": False, "init_weights": True} for name in ("googlenet", "inception_v3")}

IMAGENET = "imagenet"  # `--weights imagenet`: the model's pretrained weights (torchvision's ImageNet-1K, timm's own)
TIMM = "timm/"  # `--model timm/NAME`: timm's model NAME (as Hugging Face names timm's weights: timm/resnet50.a1_in1k)


def model_names() -> list[str]:
    """torchvision's classification models, the choices of --model."""
    return list_models(module=torchvision.models)


def is_timm(name: str) -> bool:
    return name.startswith(TIMM)


def unknown_model(name: str) -> str | None:
    """Why `name` names no model we can build (None: it does): torchvision's, or timm/ and timm's (with its tag)."""
    if name in model_names():
        return None
    if not is_timm(name):
        return (f"{name} is not a torchvision classification model (choose from {', '.join(model_names())}) "
                f"nor {TIMM}NAME, one of timm's")  # fmt: skip
    import timm  # here: only timm's models need it (0.4 s more at start-up)
    from timm.models import get_arch_pretrained_cfgs

    architecture, _, tag = name.removeprefix(TIMM).partition(".")
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models(), n=3)
        hint = f"close: {', '.join(close)}; " if close else ""
        return f"timm has no model {architecture} ({hint}timm.list_models() lists them)"
    tags = [known.partition(".")[2] for known in get_arch_pretrained_cfgs(architecture)]
    if tag and tag not in tags:
        return f"timm's {architecture} has no pretrained tag {tag} (it has {', '.join(tags) or 'none'})"
    return None


def check_model_name(name: str) -> str:
    if reason := unknown_model(name):
        raise UserError(f"--model {reason}")
    return name


def create_model(num_classes: int, name: str = DEFAULT_MODEL) -> nn.Module:
    """torchvision's or timm's `name` with a freshly initialised head of `num_classes` outputs."""
    if is_timm(check_model_name(name)):
        import timm

        return timm.create_model(name.removeprefix(TIMM), num_classes=num_classes)
    return get_model(name, num_classes=num_classes, **BUILD_OPTIONS.get(name, {}))


def model_skeleton(name: str, num_classes: int = 2) -> nn.Module:
    """The model `name` on the meta device (no memory), for its structure; on the CPU where it must compute (RegNet)."""
    try:
        with torch.device("meta"):
            return create_model(num_classes, name)
    except NotImplementedError:
        return create_model(num_classes, name)


@functools.cache
def head_names(name: str = DEFAULT_MODEL) -> frozenset[str]:
    """The names of the model's classifier tensors: those whose shape changes with the number of classes."""
    two, three = (model_skeleton(name, classes).state_dict() for classes in (2, 3))
    return frozenset(key for key, tensor in two.items() if tensor.shape != three[key].shape)


@functools.cache
def random_draws(name: str = DEFAULT_MODEL) -> tuple[str, ...]:
    """The class names of the model's layers that draw at random while training (dropout, stochastic depth)."""
    return layer_kinds(name, lambda layer: any(getattr(layer, rate, 0) for rate in ("p", "drop_prob", "drop_rate")))


@functools.cache
def batch_statistics(name: str = DEFAULT_MODEL) -> tuple[str, ...]:
    """The class names of the model's layers that normalise by a batch's statistics (BatchNorm)."""
    return layer_kinds(name, lambda layer: isinstance(layer, _BatchNorm))


def layer_kinds(name: str, which) -> tuple[str, ...]:
    return tuple(sorted({type(layer).__name__ for layer in model_skeleton(name).modules() if which(layer)}))


def freeze_all_but_head(model: nn.Module, name: str = DEFAULT_MODEL) -> None:
    head = head_names(name)
    for key, parameter in model.named_parameters():
        parameter.requires_grad_(key in head)


def unwrapped(model: nn.Module) -> nn.Module:
    """The network inside its wrappers: DDP's and DataParallel's `module`, torch.compile's `_orig_mod`."""
    while True:
        if isinstance(model, nn.DataParallel | nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
