"""Gradient checkpointing of any model whose blocks are known, BatchNorm's running statistics updated once a step."""

import types

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from network.architectures import TIMM, is_timm
from utils import UserError

# torchvision's families whose blocks are known: the nn.Sequential(s) that hold them, one block after another.
FEATURES = ("AlexNet", "ConvNeXt", "DenseNet", "EfficientNet", "MobileNetV2", "MobileNetV3", "SqueezeNet", "VGG")
BLOCK_SEQUENCES = {
    "ResNet": ("layer1", "layer2", "layer3", "layer4"),
    "RegNet": ("trunk_output",),
    "ShuffleNetV2": ("stage2", "stage3", "stage4"),
    "MNASNet": ("layers",),
    "VisionTransformer": ("encoder.layers",),
    **dict.fromkeys(("SwinTransformer", *FEATURES), ("features",)),
}


def enable_grad_checkpointing(model: nn.Module, name: str) -> nn.Module:
    """`model` recomputing each block in the backward pass: same gradients, BatchNorm updated once (docs/recipes.md)."""
    if is_timm(name):
        from timm.layers import set_reentrant_ckpt

        set_reentrant_ckpt(False)  # non-reentrant, whatever TIMM_REENTRANT_CKPT says
        try:
            model.set_grad_checkpointing(True)
        except (AssertionError, NotImplementedError, AttributeError) as refusal:
            raise UserError(f"--grad-checkpointing: timm's {name.removeprefix(TIMM)} does not support it "
                            f"({refusal})") from None  # fmt: skip
    else:
        paths = BLOCK_SEQUENCES.get(type(model).__name__)
        if paths is None:
            raise UserError(f"--grad-checkpointing: {name}'s blocks are not known here (they are for torchvision's "
                            f"{', '.join(sorted(BLOCK_SEQUENCES))}, and for timm's models)")  # fmt: skip
        for path in paths:
            checkpoint_blocks(model.get_submodule(path))
    model.register_forward_hook(running_statistics_off)
    model.register_forward_pre_hook(running_statistics_on)  # if no backward pass came after the last forward pass
    return model


def checkpoint_blocks(sequence: nn.Sequential) -> None:
    """Run `sequence`'s children in checkpointed runs: each child with parameters and the parameterless ones after."""
    runs = []  # (checkpointed?, the names of the children it runs)
    for child_name, child in sequence.named_children():
        if is_sequence_of_blocks(child):
            checkpoint_blocks(child)
            runs.append((False, [child_name]))
        elif runs and runs[-1][0] and not any(True for _ in child.parameters()):
            runs[-1][1].append(child_name)
        else:
            runs.append((not getattr(child, "inplace", False), [child_name]))  # in place: it would change the input
    sequence.checkpointed_runs = runs
    sequence.forward = types.MethodType(forward_in_checkpointed_runs, sequence)


def is_sequence_of_blocks(module: nn.Module) -> bool:
    """A stage: a plain nn.Sequential whose every child has children itself."""
    children = list(module.children())
    plain = isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
    return plain and bool(children) and all(any(True for _ in child.children()) for child in children)


def forward_in_checkpointed_runs(self: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """nn.Sequential's forward, each run of checkpoint_blocks recomputed in the backward pass."""
    for checkpointed, names in self.checkpointed_runs:
        layers = [self._modules[name] for name in names]  # looked up each time: SyncBatchNorm replaces layers
        if checkpointed and torch.is_grad_enabled():
            x = checkpoint(run_layers, layers, x, use_reentrant=False, preserve_rng_state=True)
        else:
            x = run_layers(layers, x)
    return x


def run_layers(layers: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def running_statistics_on(model: nn.Module, *forward_args) -> None:
    """The BatchNorm layers running_statistics_off froze update their statistics again, their count restored."""
    for layer in model.modules():
        if hasattr(layer, "momentum_while_frozen"):
            layer.momentum = layer.__dict__.pop("momentum_while_frozen")
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(layer.__dict__.pop("batches_while_frozen"))


def running_statistics_off(model: nn.Module, args, output) -> None:
    """After a training forward pass, BatchNorm keeps its running statistics (momentum 0, its count aside) until the
    backward pass ends (not track_running_stats=False: BatchNorm would save other tensors, which checkpoint refuses)."""
    if not (model.training and torch.is_grad_enabled()):
        return
    for layer in model.modules():
        if isinstance(layer, _BatchNorm) and layer.track_running_stats and not hasattr(layer, "momentum_while_frozen"):
            layer.momentum_while_frozen, layer.momentum = layer.momentum, 0.0
            if layer.num_batches_tracked is not None:
                layer.batches_while_frozen = layer.num_batches_tracked.clone()  # on the device: nothing waits
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if trained:  # a hook of this backward pass alone (a parameter's hooks go when .to() replaces its data)

        def backward_done(gradients) -> None:
            running_statistics_on(model)
            handle.remove()

        handle = register_multi_grad_hook(trained, backward_done, mode="all")
