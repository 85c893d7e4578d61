"""The network as a run starts it (any torchvision classifier, ResNet-34 by default, or timm's as `timm/NAME`),
and the checks of its options made before a run starts; its parts, every architecture-specific name among them,
are in network/."""

import functools
from pathlib import Path

import torch
from torch import nn

from network.architectures import create_model, freeze_all_but_head, model_skeleton
from network.checkpointing import enable_grad_checkpointing
from network.groups import layer_scales
from network.weights import load_weights
from utils import UserError


def initial_model(
    name: str, num_classes: int, device: torch.device, memory_format=torch.contiguous_format, *, seed: int = 0,
    weights: Path | None = None, freeze: bool = False, grad_checkpointing: bool = False) -> nn.Module:  # fmt: skip
    """The model `name` as a run starts it: seeded (the same initial weights in every process), then `weights`
    loaded into it (run/plan.py's prepare checked the file), on `device` in `memory_format`."""
    torch.manual_seed(seed)
    model = create_model(num_classes, name)
    if freeze:
        freeze_all_but_head(model, name)
    if grad_checkpointing:  # (parameter names unchanged: the weights load as they would)
        enable_grad_checkpointing(model, name)
    if weights is not None:
        load_weights(model, weights, name=name)
    return model.to(device, memory_format=memory_format)


def check_model_options(name: str, grad_checkpointing: bool, layer_decay: float) -> None:
    """Refuse (UserError) --grad-checkpointing or --layer-decay for a model whose blocks or layers are not known."""
    model = model_skeleton(name)
    if grad_checkpointing:
        enable_grad_checkpointing(model, name)
    if layer_decay != 1:
        layer_scales(model, name, layer_decay)


def check_input_size(name: str, img_size: int) -> None:
    """Refuse (UserError) an --img-size the model cannot take, tried without memory (else its first step will tell)."""
    model = sizing_skeleton(name)
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, img_size, img_size, device=next(model.parameters()).device))
    except NotImplementedError:
        return
    except (AssertionError, RuntimeError, ValueError) as error:
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"--model {name} does not take --img-size {img_size} images: {said}") from None


@functools.cache
def sizing_skeleton(name: str) -> nn.Module:
    """model_skeleton(name) in eval mode (a batch of one is fine there), built once."""
    return model_skeleton(name).eval()


def data_parallel_over_gpus(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.DataParallel over every visible GPU, `device` first (it gathers); the model itself where only one."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        print(f"--data-parallel: only one device ({device}) to run on, so the model trains as it is")
        return model
    print(f"DataParallel over {gpus} GPUs: each step splits its batch between them, cuda:{device.index} gathers")
    return torch.nn.DataParallel(model, device_ids=[device.index, *(i for i in range(gpus) if i != device.index)])
