"""The network (any torchvision classification model, ResNet-34 by default, or any of timm's as `timm/NAME`),
finding the weights file `--weights` names (that model's pretrained weights from torchvision's or Hugging Face's
cache, downloaded there once), loading pretrained or previously saved weights into it, and what the training
options need to know of its architecture: which blocks gradient checkpointing recomputes, the order of its layers
(layer-wise learning-rate decay), which of its parameters are norms and biases (their own weight decay).

Every architecture-specific name lives here. The one that differs most between models is the classifier head
(`fc` in a ResNet, `classifier.3` in MobileNetV3, `heads.head` in a ViT): `head_names` finds it for any model as
the tensors whose shape changes with the number of classes, so replacing, freezing around and loading past the
head need no table of models. timm's models say the rest themselves (set_grad_checkpointing, group_matcher,
no_weight_decay); for torchvision's, two small tables below name where each family keeps its blocks.
"""

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
    name: str,
    num_classes: int,
    device: torch.device,
    memory_format: torch.memory_format = torch.contiguous_format,
    *,
    seed: int = 0,
    weights: Path | None = None,
    freeze: bool = False,
    grad_checkpointing: bool = False,
) -> nn.Module:
    """The model `name` as a run starts it: seeded (the same initial weights in every process), then `weights`
    loaded into it (run/plan.py's prepare checked the file, and said what loads), all but its head frozen when
    `freeze`, its blocks recomputed in the backward pass when `grad_checkpointing`, on `device` in
    `memory_format`."""
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
    """Refuse, before anything starts, --grad-checkpointing for a model without blocks known to recompute and
    --layer-decay for one whose order of layers is not known (UserError, one line); built without memory."""
    model = model_skeleton(name)
    if grad_checkpointing:
        enable_grad_checkpointing(model, name)
    if layer_decay != 1:
        layer_scales(model, name, layer_decay)


def check_input_size(name: str, img_size: int) -> None:
    """Refuse, before anything starts, an --img-size the model cannot take (a ViT's fixed size, say): one image of
    that size through the model without memory (model_skeleton, in eval mode: a batch of one is fine there), and
    the model's own refusal, in one line. Where the meta device cannot run the model, its first step will tell."""
    model = sizing_skeleton(name)
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            model(torch.empty(1, 3, img_size, img_size, device=device))
    except NotImplementedError:
        return
    except (AssertionError, RuntimeError, ValueError) as error:
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"--model {name} does not take --img-size {img_size} images: {said}") from None


@functools.cache
def sizing_skeleton(name: str) -> nn.Module:
    """model_skeleton(name) in eval mode, built once (check_input_size asks for every configuration checked)."""
    return model_skeleton(name).eval()


def data_parallel_over_gpus(model: nn.Module, device: torch.device) -> nn.Module:
    """nn.DataParallel over every visible GPU, `device` first (it gathers the outputs and holds the master copy);
    the model itself where there is only one device to run on."""
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus < 2:
        print(f"--data-parallel: only one device ({device}) to run on, so the model trains as it is")
        return model
    print(f"DataParallel over {gpus} GPUs: each step splits its batch between them, cuda:{device.index} gathers")
    return torch.nn.DataParallel(model, device_ids=[device.index, *(i for i in range(gpus) if i != device.index)])
